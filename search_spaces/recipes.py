"""The quantisation recipe as search parameters: studies of the bf16 API (`zyfa_tune.attention`, bf16
inputs quantised with a recipe, then an FP8 kernel, timed together) search the recipe beside the
kernel, one `Param` per `generator.recipe.Recipe` field, under an Optuna name of its own
("recipe_<field>": the recipe's v_layout is not the kernel's). FP8-API studies time the kernel alone
on plainly quantised codes: they have no recipe parameters.

No static rule is needed: every recipe runs with every FP8 kernel (a natural-V kernel given K-major
V codes runs as its transposed twin, `kernels.launch.for_v_layout`, which is what the call times).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from zyfa_tune.generator import ConfigError
from zyfa_tune.generator.recipe import PLAIN, RECIPE_CHOICES, Recipe

from .params import Param

if TYPE_CHECKING:
    import optuna

#: One searched parameter per recipe field, plain recipe values first.
RECIPE_PARAMS: tuple[Param, ...] = tuple(
    Param(name, choices, label=f"recipe_{name}") for name, choices in RECIPE_CHOICES.items()
)
#: Recipes worth measuring first with each seed kernel: plain (the FP8 API's, hence the reference
#: point) and K-major V codes (the quantiser writes V as the FP8 kernels read it: no V^T copy).
SEED_RECIPES = (PLAIN, Recipe(v_layout="k_major"))


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
