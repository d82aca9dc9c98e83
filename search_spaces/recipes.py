"""The quantisation recipe as search parameters: studies of the bf16 API (`zyfa_tune.attention`, bf16
inputs quantised with a recipe, then an FP8 kernel, timed together) search the recipe beside the
kernel, one `Param` per `generator.recipe.Recipe` field, under an Optuna name of its own
("recipe_<field>": the recipe's v_layout is not the kernel's). FP8-API studies time the kernel alone
on plainly quantised codes: they have no recipe parameters.

No static rule is needed: every recipe runs with every FP8 kernel (a natural-V kernel given K-major
V codes runs as its transposed twin, `kernels.launch.for_v_layout`, which is what the call times).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from zyfa_tune.generator import ConfigError
from zyfa_tune.generator.recipe import RECIPE_CHOICES, Recipe

from .params import Param

if TYPE_CHECKING:
    import optuna

    from zyfa_tune.generator import KernelConfig

#: One searched parameter per recipe field, plain recipe values first.
RECIPE_PARAMS: tuple[Param, ...] = tuple(
    Param(name, choices, label=f"recipe_{name}") for name, choices in RECIPE_CHOICES.items()
)
#: K-major V (the quantiser writes it keys-fastest: no V^T pass in the call) and the same with balanced
#: V rounding, whose cancelling errors lower the whole call's error below plain quantisation's (about
#: 4% at hd128 on Gaussian inputs), which is what lets lean P's kernels pass a gate at FA3's error
K_MAJOR = Recipe(v_layout="k_major")
BALANCED = Recipe(v_layout="k_major", v_rounding="balanced")


def seed_points(seeds: Sequence[KernelConfig]) -> list[tuple[KernelConfig, Recipe]]:
    """The (kernel, recipe) pairs a bf16-API study measures first, most promising first: lean P with
    balanced V, every exact kernel with K-major V, then the exact kernels with balanced V (the fastest
    exact kernels sit a hair over FA3's whole-call error with nearest rounding), then lean with
    K-major V. Each seed appears with two recipes; Optuna searches the rest of the recipe space."""
    lean = [c for c in seeds if c.softmax == "lean"]
    exact = [c for c in seeds if c.softmax != "lean"]
    return (
        [(c, BALANCED) for c in lean]
        + [(c, K_MAJOR) for c in exact]
        + [(c, BALANCED) for c in exact]
        + [(c, K_MAJOR) for c in lean]
    )


def suggest_recipe(trial: "optuna.Trial") -> Recipe:
    """Suggest every recipe parameter on `trial` (all of them, every time: a static space)."""
    return recipe_from_options({p.key: trial.suggest_categorical(p.key, list(p.choices)) for p in RECIPE_PARAMS})


def recipe_from_options(options: Mapping[str, Any]) -> Recipe:
    """The recipe of Optuna parameters (ConfigError naming the parameter when one is missing or odd)."""
    values = {}
    for p in RECIPE_PARAMS:
        if p.key not in options:
            raise ConfigError(f"{p.key}: missing")
        values[p.name] = options[p.key]
    return Recipe(**values)


def recipe_options(recipe: Recipe) -> dict[str, Any]:
    """The Optuna parameters that reproduce `recipe` (for study.enqueue_trial)."""
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe: expected a Recipe, got {type(recipe).__name__}")
    return {p.key: getattr(recipe, p.name) for p in RECIPE_PARAMS}


def recipe_neighbours(recipe: Recipe) -> list[Recipe]:
    """The recipes one field away from `recipe`, in parameter order (the tuner's local moves)."""
    return [
        Recipe(**{**recipe.quantize_kwargs(), p.name: value})
        for p in RECIPE_PARAMS
        for value in p.choices
        if value != getattr(recipe, p.name)
    ]
