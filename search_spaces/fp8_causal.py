"""FP8 (e4m3) causal forward: one line per searched `KernelConfig` field.

Fields not listed (dtype, head dims) come from `kernels.defaults.default_config("fp8", ...)`.
Adding a parameter to the generator means adding its line here (and in bf16_causal.py).
"""

from .base import BLOCK_N, TILE_PARAMS, Param, SearchSpace, lean_only, rowsum_param, scale_per_tile

PARAMS = TILE_PARAMS + (
    Param("softmax", ("exact", "lean")),
    lean_only("lean_fold", ("fma", "sub_fma", "corrected")),  # only under softmax="lean"
    lean_only("lean_clamp", ("imax", "fmax")),          # only under softmax="lean"
    lean_only("lean_pack", ("prmt", "bfi")),            # only under softmax="lean"
    Param("p_scale_log2", (6, 7, 8)),
    scale_per_tile(BLOCK_N),                            # Optuna "scale_per_tile": scale_block 0 / block_n
    rowsum_param(("fp32", "rounded", "mma")),           # "fp32" under lean -> "rounded"
    Param("q_order", ("forward", "heavy_first")),
    Param("loads", ("tma", "pointer")),
    Param("v_layout", ("transposed", "natural")),
)

SPACE = SearchSpace("fp8-causal", "fp8", PARAMS)
