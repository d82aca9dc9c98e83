"""Safe default configs: what runs when no tuned entry matches (and the tuner's baseline).

Chosen from sweeps on the H200 (docs/PERF.md, 2026-11-30): TMA loads everywhere; for FP8 a
(dim, keys) copy of V so that the P@V wgmma reads V K-major, and 64-row programs of one warpgroup
(two or three programs share an SM, which overlaps one's softmax with another's MMAs).
"""

from __future__ import annotations

from zyfa_tune.generator import KernelConfig


def default_config(dtype: str, head_dim_qk: int, head_dim_v: int) -> KernelConfig:
    """A config that compiles without spills and fits shared memory for this head-dim pair.
    KernelConfig's own defaults are the FP8 head-dim-128 default."""
    big = max(head_dim_qk, head_dim_v) > 128
    dims = dict(head_dim_qk=head_dim_qk, head_dim_v=head_dim_v, block_n=64 if big else 128)
    if dtype == "fp8":  # query blocks in launch order: every fp8 study so far preferred it (1.02-1.23x)
        return KernelConfig(dtype="fp8", q_order="forward", **dims)
    return KernelConfig(dtype="bf16", block_m=128, num_warps=8, num_stages=2, p_scale_log2=0,
                        v_layout="natural", **dims)
