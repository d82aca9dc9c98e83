"""Build cache and launcher: config -> emitted source -> Triton JIT function -> launch."""

from __future__ import annotations

import functools
import math

import torch

from zyfa_tune.generator import EmittedKernel, KernelConfig, emit, head_chunks
from zyfa_tune.generator.build import jit_function

LOG2E = 1.4426950408889634

_INT32_MAX = 2**31 - 1


@functools.lru_cache(maxsize=None)
def emitted(config: KernelConfig) -> EmittedKernel:
    """Emit once per config (configs are frozen and hashable)."""
    return emit(config)


@functools.lru_cache(maxsize=None)
def kernel(config: KernelConfig):
    """The Triton JIT function of `config` (emitted, written and imported once per process)."""
    return jit_function(emitted(config))


def launch(config: KernelConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
           softmax_scale: float, causal: bool,
           q_descale: torch.Tensor | None = None, k_descale: torch.Tensor | None = None,
           v_descale: torch.Tensor | None = None) -> torch.Tensor:
    """Launch `config` on validated inputs (last dims contiguous) into `out` (bf16).

    Descales are all None or all contiguous float32 (batch, kv_heads) tensors.
    """
    grid, args, options = prepare(config, q, k, v, out, softmax_scale, causal, q_descale, k_descale, v_descale)
    kernel(config)[grid](*args, **options)
    return out


def prepare(config: KernelConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
            softmax_scale: float, causal: bool, q_descale: torch.Tensor | None = None,
            k_descale: torch.Tensor | None = None, v_descale: torch.Tensor | None = None):
    """Grid, positional arguments and launch options of one call (makes the V^T copy if needed)."""
    b, sq, h, _ = q.shape
    sk, hk = k.shape[1], k.shape[2]
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
        if t.shape[1] * t.stride(1) + t.shape[2] * t.stride(2) > _INT32_MAX:
            raise ValueError(f"{name}: one batch entry spans more than 2^31 elements; split the batch")
    n_m = math.ceil(sq / config.block_m)
    if n_m * b * h > _INT32_MAX:
        raise ValueError(f"q: {n_m * b * h} programs exceed the grid limit; split the batch")
    # no descales: None specialises the kernel to skip them (no tensor to allocate, so a first
    # call inside CUDA graph capture is safe)
    ds0, ds1 = q_descale.stride() if q_descale is not None else (0, 0)
    if config.v_layout == "transposed":
        v = transpose_v(v)
    if config.loads == "tma":
        inputs = _descriptors(config, q, k, v)
    else:
        vrow = v.stride(2) if config.v_layout == "transposed" else v.stride(1)
        vhead = v.stride(1) if config.v_layout == "transposed" else v.stride(2)
        inputs = (q, k, v, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                  v.stride(0), vrow, vhead)
    args = (*inputs, out, q_descale, k_descale, v_descale,
            out.stride(0), out.stride(1), out.stride(2), ds0, ds1,
            h, h // hk, sq, sk, n_m, float(softmax_scale) * LOG2E)
    options = dict(CAUSAL=bool(causal), num_warps=config.num_warps, num_stages=config.num_stages,
                   maxnreg=config.maxnreg or None)
    return (n_m * b * h,), args, options


def transpose_v(v: torch.Tensor) -> torch.Tensor:
    """(B, Sk, Hkv, Dv) -> (B, Hkv, Dv, Sk) copy whose key stride is padded to 16 bytes (TMA)."""
    b, sk, hk, dv = v.shape
    pad = -(-sk // 16) * 16
    vt = torch.empty(b, hk, dv, pad, dtype=v.dtype, device=v.device)
    vt[..., :sk].copy_(v.permute(0, 2, 3, 1))
    return vt[..., :sk]


def _tma_ready(t: torch.Tensor) -> torch.Tensor:
    """TMA reads (batch*seqlen, heads*dim) rows from a 16-byte aligned base: copy if not so."""
    if t.stride(2) != t.shape[3] or t.stride(0) != t.shape[1] * t.stride(1) or t.data_ptr() % 16:
        return t.contiguous() if t.data_ptr() % 16 == 0 else t.clone(memory_format=torch.contiguous_format)
    return t


def _descriptors(config: KernelConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list:
    """Host TMA descriptors over 2-D views: Q (B*Sq, H*Dqk), K (B*Sk, Hkv*Dqk), V (B*Sk, Hkv*Dv)
    or V^T (B*Hkv*Dv, Sk); one descriptor per tensor and head-dim chunk width."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    b, sq, h, dqk = q.shape
    sk, hk, dv = k.shape[1], k.shape[2], (v.shape[3] if config.v_layout == "natural" else v.shape[2])
    q, k = _tma_ready(q), _tma_ready(k)
    if config.v_layout == "natural":
        v = _tma_ready(v)
    descs = []
    for tname, t, chunks, rows_block in (("q", q, head_chunks(dqk), config.block_m),
                                         ("k", k, head_chunks(dqk), config.block_n),
                                         ("v", v, head_chunks(dv), config.block_n)):
        for w in sorted({w for _, w in chunks}, reverse=True):
            if tname == "v" and config.v_layout == "transposed":
                d = TensorDescriptor(t, [b * hk * dv, sk], [t.stride(2), 1], [w, rows_block])
            else:
                d = TensorDescriptor(t, [t.shape[0] * t.shape[1], t.shape[2] * t.shape[3]],
                                     [t.stride(1), 1], [rows_block, w])
            descs.append(d)
    return descs
