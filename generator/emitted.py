"""What every backend's emitter returns: the config, the module source and its hash."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from .config import KernelConfig
from .ptx_pass import QK_ASYNC_SUFFIX

#: The kernel function of every emitted module, whatever the backend (a qk_async kernel adds
#: generator/ptx_pass.py's suffix: kernel_name_of).
KERNEL_NAME = "zyfa_attn_fwd"


@dataclass(frozen=True)
class EmittedKernel:
    config: KernelConfig
    source: str
    source_hash: str
    kernel_name: str = KERNEL_NAME


def emitted(config: KernelConfig, source: str, kernel_name: str = KERNEL_NAME) -> EmittedKernel:
    """Wrap a module source; its hash (first 16 hex digits of SHA-256) names the kernel everywhere
    (cache file, database variant, Triton's own cache). `kernel_name`: the kernel function's name, which
    asks generator/ptx_pass.py for its pass where it ends so (`kernel_name_of`)."""
    return EmittedKernel(
        config=config,
        source=source,
        source_hash=hashlib.sha256(source.encode()).hexdigest()[:16],
        kernel_name=kernel_name,
    )


def kernel_name_of(config: KernelConfig) -> str:
    """The kernel function's name: KERNEL_NAME, with generator/ptx_pass.py's suffix for a `qk_async` config
    (the name is what the pass inside Triton's compile sees)."""
    return KERNEL_NAME + (QK_ASYNC_SUFFIX if config.qk_async else "")
