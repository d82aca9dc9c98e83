"""The backend registry: which emitter builds a config's kernel, and for which GPU architecture.

A backend is a sub-package with an `emit(config) -> EmittedKernel`; registering it here is the one
line that makes `emit`, the tuner and the dispatcher use it. A new architecture is a new `Target`
and a backend folder for it (for example `gluon_sm100/`), registered beside the others.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .config import CHOICES, KernelConfig
from .emitted import EmittedKernel
from .gluon_sm90 import emit as _gluon_sm90
from .triton import emit as _triton


@dataclass(frozen=True)
class Target:
    """A GPU architecture and the limits every static check and launcher of it uses."""

    name: str  # ptxas architecture, e.g. "sm_90a"
    capability: int  # Triton's GPUTarget capability, e.g. 90
    shared_memory_bytes: int  # largest dynamic shared memory of one block
    max_registers: int  # registers one thread may hold
    sm_count: int  # SMs of the reference part (H100 / H200 SXM), where no GPU is there to ask


#: NVIDIA Hopper (H100, H200): 227 KiB of shared memory per block, 255 registers, 132 SMs.
HOPPER = Target(name="sm_90a", capability=90, shared_memory_bytes=232448, max_registers=255, sm_count=132)


@dataclass(frozen=True)
class Backend:
    name: str  # KernelConfig.backend
    emit: Callable[[KernelConfig], EmittedKernel]  # deterministic: the same config, the same source
    target: Target
    dtypes: tuple[str, ...]  # the dtypes it emits kernels for


BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend("triton", _triton.emit, HOPPER, ("fp8", "bf16")),
        Backend("gluon", _gluon_sm90.emit, HOPPER, ("fp8",)),
    )
}

if set(BACKENDS) != set(CHOICES["backend"]):  # KernelConfig validates the name; this maps it to code
    raise ImportError(f"backends {sorted(BACKENDS)} do not match KernelConfig's {sorted(CHOICES['backend'])}")


def backend_of(config: KernelConfig) -> Backend:
    """The registered backend that builds `config`'s kernel."""
    return BACKENDS[config.backend]
