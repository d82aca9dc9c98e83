"""What every backend's emitter returns: the config, the module source and its hash."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from .config import KernelConfig

#: The kernel function of every emitted module, whatever the backend.
KERNEL_NAME = "zyfa_attn_fwd"


@dataclass(frozen=True)
class EmittedKernel:
    config: KernelConfig
    source: str
    source_hash: str
    kernel_name: str = KERNEL_NAME


def emitted(config: KernelConfig, source: str) -> EmittedKernel:
    """Wrap a module source; its hash (first 16 hex digits of SHA-256) names the kernel everywhere
    (cache file, database variant, Triton's own cache)."""
    return EmittedKernel(config=config, source=source, source_hash=hashlib.sha256(source.encode()).hexdigest()[:16])
