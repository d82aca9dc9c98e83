"""Kernel generator: validated `KernelConfig` -> kernel source, by backend (Triton or Gluon)."""

from .backends import BACKENDS, HOPPER, Backend, Target, backend_of
from .config import (
    CHOICES,
    GENERATOR_VERSION,
    HEAD_DIMS,
    ConfigError,
    KernelConfig,
    gluon_o_parts,
    gluon_qk_padded,
    gluon_qk_parts,
    gluon_registers,
    head_dim_error,
    o_in_p_tile,
    p_tiles,
)
from .emitted import EmittedKernel
from .gluon_sm90.emit import emit as _gluon_emit
from .rules import GLUON_HEAD_DIMS
from .triton.emit import chunk_skips, chunks_of, head_chunks
from .triton.emit import emit as _triton_emit


def emit(
    config: KernelConfig, serving: bool = False, lse: bool = False, window: bool = False, paged: bool = False
) -> EmittedKernel:
    """Emit the kernel source of `config` with its backend's emitter (deterministic). `serving`: the
    variant that also takes packed sequences, a paged KV cache, a window and an LSE output (generator/triton/emit.py);
    the Gluon backend's serving variant takes packed sequences only (generator/gluon_sm90/emit.py, varlen).
    `lse`, `window`: the Gluon kernel (rectangular, or varlen with `serving`) that also writes the LSE, or
    takes a sliding window's bounds; a Triton kernel's LSE and window are call options of its serving variant.
    `paged`: the Gluon varlen kernel reading K / V from paged caches (a Triton kernel's serving variant takes them)."""
    if not isinstance(config, KernelConfig):
        raise TypeError(f"emit() takes a KernelConfig, got {type(config).__name__}")
    for name, on in (("lse", lse), ("window", window), ("paged", paged)):
        if on and config.backend != "gluon":
            raise ValueError(f"{name}: backend={config.backend!r} takes it in its serving variant (serving=True)")
    if config.backend == "gluon" and (serving or lse or window or paged):
        return _gluon_emit(config, varlen=bool(serving), lse=bool(lse), window=bool(window), paged=bool(paged))
    if serving:
        if config.backend != "triton":
            raise ValueError(
                f"config: backend={config.backend!r} has no kernel for varlen, paged KV caches, window_size or "
                "return_lse; "
                "the Triton backend serves them"
            )
        return _triton_emit(config, serving=True)
    return backend_of(config).emit(config)


__all__ = [
    "BACKENDS",
    "HOPPER",
    "Backend",
    "Target",
    "backend_of",
    "CHOICES",
    "GENERATOR_VERSION",
    "GLUON_HEAD_DIMS",
    "HEAD_DIMS",
    "head_dim_error",
    "ConfigError",
    "KernelConfig",
    "EmittedKernel",
    "emit",
    "gluon_o_parts",
    "gluon_qk_padded",
    "gluon_qk_parts",
    "gluon_registers",
    "chunk_skips",
    "chunks_of",
    "head_chunks",
    "o_in_p_tile",
    "p_tiles",
]
