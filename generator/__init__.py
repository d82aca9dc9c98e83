"""Kernel generator: validated `KernelConfig` -> kernel source (Triton backend)."""

from .config import CHOICES, GENERATOR_VERSION, HEAD_DIMS, ConfigError, KernelConfig
from .emit_triton import EmittedKernel, emit, head_chunks

__all__ = ["CHOICES", "GENERATOR_VERSION", "HEAD_DIMS", "ConfigError", "KernelConfig",
           "EmittedKernel", "emit", "head_chunks"]
