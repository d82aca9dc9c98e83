"""Runtime kernel choice. For now every shape gets the safe default config of its head dims;
the tuned-database lookup (issue 3) plugs in here."""

from __future__ import annotations

import functools

from zyfa_tune.generator import KernelConfig

from .defaults import default_config


@functools.lru_cache(maxsize=None)
def select_config(dtype: str, head_dim_qk: int, head_dim_v: int) -> KernelConfig:
    return default_config(dtype, head_dim_qk, head_dim_v)
