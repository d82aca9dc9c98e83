"""GPU tests of tuning for the bf16 API: the recipe probe's reference error and gate, the worker timing
quantiser and kernel together, and `attention()` running a tuned bf16-API entry's recipe and kernel."""

from __future__ import annotations

import pytest
import torch

from zyfa_tune.attention import attention, run_recipe
from zyfa_tune.db import ProblemKey, TrialResult, current_fingerprint, open_store
from zyfa_tune.generator import emit
from zyfa_tune.generator.defaults import default_config
from zyfa_tune.generator.recipe import PLAIN, Recipe
from zyfa_tune.kernels import dispatch
from zyfa_tune.tuning.reference import attention_reference, rel_l2
from zyfa_tune.tuning.verify import _call, check_config, make_probe, make_recipe_probe
from zyfa_tune.tuning.worker import Shape, Task, Worker

pytestmark = pytest.mark.gpu

FANCY = Recipe(hadamard=True, v_rounding="balanced", v_layout="k_major")
SHAPE = dict(batch=1, heads=8, kv_heads=8, seqlen=2048)


def _fa3():
    try:
        from fa3_fwd_interface import flash_attn_func
    except ImportError:
        return None
    return flash_attn_func


@pytest.mark.parametrize("recipe", [PLAIN, FANCY], ids=["plain", "fancy"])
def test_recipe_probe_gates_the_whole_call_against_the_reference(recipe):
    cfg = default_config("fp8", 128, 128)
    probe = make_recipe_probe(128, 128, recipe, gate=1.25, **SHAPE)
    q, k, v = probe.args
    assert q.dtype == torch.bfloat16 and probe.error_ref > 0 and probe.error_limit == 1.25 * probe.error_ref
    assert torch.equal(probe.reference, attention_reference(q, k, v, causal=True))  # unquantised inputs
    verdict = check_config(cfg, probe, reps=5)
    assert verdict.ok, verdict.reason
    assert verdict.error_rel_l2 == pytest.approx(
        rel_l2(run_recipe(q, k, v, True, 128**-0.5, recipe, cfg), probe.reference), rel=1e-6
    )
    if recipe.v_layout == "k_major":  # the kernel runs as V's layout reads it
        assert probe.runs(cfg.replace(v_layout="natural")).v_layout == "transposed"
    if _fa3() is None:  # the reference is the exact default kernel on plain codes
        plain = make_recipe_probe(128, 128, PLAIN, **SHAPE)
        assert rel_l2(_call(cfg, plain)(), plain.reference) == pytest.approx(probe.error_ref, rel=1e-6)


def test_fp8_probe_records_the_reference_error():
    probe = make_probe("fp8", 128, 128, gate=1.25, fa3=True, **SHAPE)
    fa3 = _fa3()
    if fa3 is None:
        base = make_probe("fp8", 128, 128, gate=1.25, **SHAPE)
        assert probe.error_ref == pytest.approx(base.error_ref) and probe.error_limit == base.error_limit
    else:
        out = fa3(*probe.args, causal=True, **probe.kwargs)
        assert probe.error_ref == pytest.approx(rel_l2(out[0] if isinstance(out, tuple) else out, probe.reference))


def test_worker_times_quantiser_and_kernel_and_records_the_recipe():
    cfg = default_config("fp8", 128, 128)
    shape = Shape(SHAPE["batch"], SHAPE["heads"], SHAPE["kv_heads"], SHAPE["seqlen"])
    with Worker(gpu=0, runner="gpu", timeout_s=300) as w:
        (kernel,) = w.run(Task(cfg.to_json(), (shape,), reps=5))
        (whole,) = w.run(Task(cfg.to_json(), (shape,), reps=5, api="bf16", recipe=FANCY))
    assert kernel.status == "ok" and kernel.error_ref and kernel.recipe is None
    assert whole.status == "ok", whole.message
    assert whole.recipe == FANCY.to_json() and whole.error_ref and whole.median_ms > 0
    assert whole.error_rel_l2 / whole.error_ref <= 1.25


def test_attention_runs_a_tuned_bf16_entry(tmp_path):
    cfg = default_config("fp8", 128, 128).replace(num_stages=2)
    key = ProblemKey.from_shape(
        dtype="fp8", head_dim_qk=128, head_dim_v=128, causal=True, batch=1, heads=8, kv_heads=8, seqlen=2048, api="bf16"
    )
    with open_store(tmp_path / "t.db") as s:
        s.record_trial(
            current_fingerprint(0),
            key,
            cfg,
            TrialResult("ok", median_ms=1.0, error_rel_l2=0.018, error_ref=0.02, recipe=FANCY),
            source_hash=emit(cfg).source_hash,
        )
    dispatch.set_databases([tmp_path / "t.db"])
    try:
        g = torch.Generator(device="cuda").manual_seed(3)
        q, k, v = (torch.randn(1, 2048, 8, 128, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
        chosen = dispatch.dispatcher().attention_choice(128, 128, True, 1, 8, 8, 2048, 0, 1.0)
        assert chosen == (FANCY, cfg)
        assert torch.equal(attention(q, k, v), run_recipe(q, k, v, True, 128**-0.5, FANCY, cfg))
        # the same entry is over a tighter budget: the plain recipe and the FP8 API's kernel run
        assert dispatch.dispatcher().choose_recipe(key, dispatch.device_key(0), 0.5).recipe == PLAIN
        assert torch.equal(attention(q, k, v, error_budget=0.5), run_recipe(q, k, v, True, 128**-0.5, PLAIN, None))
    finally:
        dispatch.set_databases(None)
