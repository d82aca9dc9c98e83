"""Tuning for the bf16 API on the CPU: the study searches the quantisation recipe beside the kernel,
the simulation models quantiser and kernel together, every trial lands in the database with its
recipe, problem api "bf16" and reference error, and the dispatcher's bf16 lookup returns one."""

from __future__ import annotations

import dataclasses
import json

import optuna
import pytest
from test_tune import SHIPPED, spec

from zyfa_tune.db import ProblemKey, open_store
from zyfa_tune.generator.defaults import default_config
from zyfa_tune.generator.recipe import PLAIN, RECIPE_CHOICES, Recipe
from zyfa_tune.kernels import dispatch
from zyfa_tune.search_spaces import (
    BALANCED,
    RECIPE_PARAMS,
    recipe_from_options,
    recipe_neighbours,
    recipe_options,
    suggest_recipe,
)
from zyfa_tune.tuning.simulation import SimulationRunner, quantiser_ms, synthetic_measurement
from zyfa_tune.tuning.task import Shape, Task
from zyfa_tune.tuning.tuner import Tuner, simulation_fingerprint

SHAPE = Shape(1, 32, 32, 8192)


def test_recipe_params_cover_every_recipe_and_round_trip():
    assert [p.name for p in RECIPE_PARAMS] == list(RECIPE_CHOICES)
    assert all(p.key.startswith("recipe_") for p in RECIPE_PARAMS)  # the recipe's v_layout is not the kernel's
    fancy = Recipe(hadamard=True, v_rounding="balanced", v_layout="k_major")
    assert recipe_from_options(recipe_options(fancy)) == fancy
    assert len(recipe_neighbours(PLAIN)) == len(RECIPE_CHOICES) and PLAIN not in recipe_neighbours(PLAIN)
    study = optuna.create_study()
    study.enqueue_trial(recipe_options(fancy))
    assert suggest_recipe(study.ask()) == fancy
    with pytest.raises(ValueError, match="recipe_hadamard"):
        recipe_from_options({})


def test_task_carries_api_and_recipe():
    fancy = Recipe(smooth_k=True)
    t = Task(default_config("fp8", 128, 128).to_json(), (SHAPE,), api="bf16", recipe=fancy)
    assert t.recipe == fancy.to_json()
    assert Task("{}", (SHAPE,), api="bf16", recipe=PLAIN.to_json()).recipe is None
    with pytest.raises(ValueError, match="recipe"):
        Task("{}", (SHAPE,), recipe=fancy)  # the FP8 API has no recipe
    with pytest.raises(ValueError, match="api"):
        Task("{}", (SHAPE,), api="fp16")
    with pytest.raises(ValueError, match="recipe"):
        Task("{}", (SHAPE,), api="bf16", recipe='{"hadamard": 2}')


def test_the_model_times_quantiser_and_kernel_together():
    cfg = default_config("fp8", 128, 128)
    kernel = synthetic_measurement(cfg, SHAPE, True, 1.25)
    whole = synthetic_measurement(cfg, SHAPE, True, 1.25, PLAIN)
    assert whole["median_ms"] == pytest.approx(kernel["median_ms"] + quantiser_ms(SHAPE, 128, 128, PLAIN))
    assert kernel["error_ref"] == whole["error_ref"] > 0
    balanced = synthetic_measurement(cfg, SHAPE, True, 1.25, Recipe(v_rounding="balanced"))
    assert balanced["median_ms"] > whole["median_ms"] and balanced["error_rel_l2"] < whole["error_rel_l2"]
    natural = cfg.replace(v_layout="natural")  # K-major V codes let a natural-V kernel read V as it is
    for c in (cfg, natural):  # and save the V^T-reading kernel its copy
        assert (
            synthetic_measurement(c, SHAPE, True, 1.25, Recipe(v_layout="k_major"))["median_ms"]
            < synthetic_measurement(c, SHAPE, True, 1.25, PLAIN)["median_ms"]
        )
    tight = synthetic_measurement(cfg, SHAPE, True, 1.0, PLAIN)  # the default kernel is its own reference
    assert tight["status"] == "ok" and tight["error_rel_l2"] / tight["error_ref"] <= 1.0


def test_simulation_runner_answers_a_bf16_task():
    """A stored FP8-API measurement answers the FP8 task only: the bf16 task is modelled."""
    from zyfa_tune.generator import KernelConfig

    with open_store(SHIPPED, readonly=True) as store:
        row = next(r for r in store.trials(status="ok") if r["batch"] and r["heads"] and r["seqlen"])
    cfg, shape = (
        KernelConfig.from_json(row["config_json"]),
        Shape(row["batch"], row["heads"], row["heads"], row["seqlen"]),
    )
    runner = SimulationRunner(SHIPPED)
    fp8 = runner.answer(cfg, shape, Task(cfg.to_json(), (shape,), causal=row["causal"]))
    bf16 = runner.answer(
        cfg, shape, Task(cfg.to_json(), (shape,), causal=row["causal"], api="bf16", recipe=Recipe(hadamard=True))
    )
    assert fp8["message"].startswith(f"simulate: stored trial #{row['id']}")
    assert "synthetic" in bf16["message"] and "recipe" in bf16["message"] and bf16["error_ref"] > 0


def test_bf16_api_study_records_recipes_and_the_dispatcher_serves_one(tmp_path):
    s = spec(tmp_path, api="bf16", gate=1.0, trials=6, seqlens=(8192,))
    assert s.name == "bf16api-fp8-128x128-causal"
    study = Tuner(s).run()
    params = [t.params for t in study.trials if t.state.is_finished()]
    assert all({p.key for p in RECIPE_PARAMS} <= set(p) for p in params)
    # the seeds, lean P first (whatever the gate: the recipe can pay for its error) with balanced V
    first = study.trials[0]
    assert recipe_from_options(first.params) == BALANCED and first.user_attrs["recipe"]
    assert json.loads(first.user_attrs["config"])["softmax"] == "lean"
    with open_store(s.storage, readonly=True) as store:
        rows = store.trials()
        best = store.best_entries()
    assert rows and {r["api"] for r in rows} == {"bf16"} and all(r["error_ref"] for r in rows if r["status"] == "ok")
    assert any(r["recipe"] == BALANCED.to_json() for r in rows)  # plain is stored as None
    assert [b.key.api for b in best] == ["bf16"] and best[0].error_ratio <= 1.0
    d = dispatch.Dispatcher([s.storage])
    key = ProblemKey.from_shape(
        dtype="fp8",
        head_dim_qk=128,
        head_dim_v=128,
        causal=True,
        batch=2,
        heads=32,
        kv_heads=32,
        seqlen=8192,
        api="bf16",
    )
    device = simulation_fingerprint(s.runner).device_key()
    chosen = d.choose_recipe(key, device, 1.0)
    assert chosen.kernel is not None and chosen.kernel.source == "exact"
    assert chosen.recipe == (PLAIN if best[0].recipe is None else Recipe.from_json(best[0].recipe))
    assert chosen.kernel.config.to_json() == best[0].config_json
    assert d.choose(dataclasses.replace(key, api="fp8"), device).source == "default"  # the FP8 API: untuned


def test_bf16_api_needs_fp8_kernels(tmp_path):
    with pytest.raises(ValueError, match="api"):
        spec(tmp_path, api="bf16", dtype="bf16")
    with pytest.raises(ValueError, match="api"):
        spec(tmp_path, api="fp16")
