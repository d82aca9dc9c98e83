"""BF16 causal forward: one line per searched `KernelConfig` field.

Fields not listed come from `generator.defaults.default_config("bf16", ...)`: dtype, head dims,
softmax="exact" (lean P writes e4m3 codes: fp8 only), p_scale_log2=0 (bf16 has the range; the
generator requires 0) and the unused lean P fields. Adding a parameter to the generator means
adding its line here (and in fp8_causal.py).
"""

from .params import BLOCK_N, TILE_PARAMS, Param, rowsum_param, scale_per_tile
from .space import SearchSpace

PARAMS = TILE_PARAMS + (
    scale_per_tile(BLOCK_N),  # Optuna "scale_per_tile": scale_block 0 / block_n
    rowsum_param(("fp32", "rounded", "mma")),
    Param("q_order", ("forward", "heavy_first")),
    Param("loads", ("tma", "pointer")),
    Param("v_layout", ("natural",)),  # bf16 wgmma reads V (keys, dim) as is: no copy
)

SPACE = SearchSpace("bf16-causal", "bf16", PARAMS)
