"""Safe default configs: what runs when no tuned entry matches (and the tuner's baseline).

Chosen from sweeps on the H200 (docs/PERF.md, 2026-11-30): TMA loads everywhere; for FP8 a
(dim, keys) copy of V so that the P@V wgmma reads V K-major, and 64-row programs of one warpgroup
(two or three programs share an SM, which overlaps one's softmax with another's MMAs).
"""

from __future__ import annotations

from zyfa_tune.generator import KernelConfig


def default_config(dtype: str, head_dim_qk: int, head_dim_v: int) -> KernelConfig:
    """A config that compiles without spills and fits shared memory for this head-dim pair."""
    big = max(head_dim_qk, head_dim_v) > 128
    if dtype == "fp8":
        return KernelConfig(dtype="fp8", head_dim_qk=head_dim_qk, head_dim_v=head_dim_v,
                            block_m=64, block_n=64 if big else 128, num_warps=4, num_stages=3,
                            softmax="exact", p_scale_log2=8, rowsum="fp32", q_order="heavy_first",
                            loads="tma", v_layout="transposed")
    return KernelConfig(dtype="bf16", head_dim_qk=head_dim_qk, head_dim_v=head_dim_v,
                        block_m=128, block_n=64 if big else 128, num_warps=8, num_stages=2,
                        softmax="exact", p_scale_log2=0, rowsum="fp32", q_order="heavy_first",
                        loads="tma", v_layout="natural")
