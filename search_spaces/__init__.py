"""Search spaces of the Optuna tuner, one module per kernel family.

    from zyfa_tune.search_spaces import get_space
    space = get_space("fp8")
    for seed in space.seeds(128, 128):
        study.enqueue_trial(space.as_optuna_params(seed))
    trial = study.ask()
    config = space.suggest(trial, 128, 128)   # None: invalid or statically infeasible, reason in
                                              # trial.user_attrs["infeasible"]

params.py holds Param and the helpers a family declares its fields with, resources.py the static
shared-memory / register / wgmma checks (both backends), space.py SearchSpace, seeds.py the named
seed configs, recipes.py the quantisation recipe's parameters (bf16-API studies only);
fp8_causal.py (Triton and Gluon) and bf16_causal.py (Triton) declare one line per searched
KernelConfig field. Seeds from tuning databases (winners) are read by the tuning layer
(zyfa_tune.tuning.warm_start) and passed in: `space.seeds(128, 128, winners=...)`.
"""

from __future__ import annotations

from .bf16_causal import SPACE as BF16_CAUSAL
from .fp8_causal import SPACE as FP8_CAUSAL
from .params import Param
from .recipes import (
    BALANCED,
    K_MAJOR,
    RECIPE_PARAMS,
    recipe_from_options,
    recipe_neighbours,
    recipe_options,
    seed_points,
    suggest_recipe,
)
from .resources import (
    SMEM_LIMIT,
    gluon_register_estimate,
    gluon_smem_estimate,
    register_estimate,
    smem_estimate,
    static_infeasibility,
)
from .space import SearchSpace

#: family name -> search space
FAMILIES: dict[str, SearchSpace] = {s.family: s for s in (FP8_CAUSAL, BF16_CAUSAL)}
_BY_DTYPE = {s.dtype: s for s in FAMILIES.values()}


def get_space(dtype: str) -> SearchSpace:
    """The search space of a dtype: "fp8" -> fp8-causal, "bf16" -> bf16-causal."""
    space = _BY_DTYPE.get(dtype) if isinstance(dtype, str) else None
    if space is None:
        raise ValueError(f"dtype: {dtype!r} has no search space; expected one of {sorted(_BY_DTYPE)}")
    return space


__all__ = [
    "Param",
    "SearchSpace",
    "FAMILIES",
    "get_space",
    "FP8_CAUSAL",
    "BF16_CAUSAL",
    "SMEM_LIMIT",
    "smem_estimate",
    "register_estimate",
    "gluon_smem_estimate",
    "gluon_register_estimate",
    "static_infeasibility",
    "RECIPE_PARAMS",
    "BALANCED",
    "K_MAJOR",
    "seed_points",
    "suggest_recipe",
    "recipe_options",
    "recipe_from_options",
    "recipe_neighbours",
]
