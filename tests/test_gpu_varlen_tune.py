"""Packed-sequence tuning on the GPU: the probe's gate and timing of flash_attn_varlen_func, and a
short study with the real runner whose entry the packed call then runs."""

from __future__ import annotations

import pytest
import torch

from zyfa_tune.generator.defaults import default_config
from zyfa_tune.kernels import dispatch
from zyfa_tune.tuning.lengths import parse_lengths
from zyfa_tune.tuning.packed import cu_seqlens, make_packed_probe, packed_args, packed_qkv
from zyfa_tune.tuning.reference import attention_reference_varlen, rel_l2
from zyfa_tune.tuning.spec import TuneSpec
from zyfa_tune.tuning.task import shape_key
from zyfa_tune.tuning.tuner import Tuner
from zyfa_tune.tuning.verify import check_config
from zyfa_tune.varlen import flash_attn_varlen_func

pytestmark = pytest.mark.gpu
LENGTHS = (1, 127, 3000, 700, 64)


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_packed_probe_gates_and_times_the_default(dtype):
    probe = make_packed_probe(dtype, 128, 128, LENGTHS, heads=8, kv_heads=2, fa3=True)
    assert probe.packed is not None and probe.packed[1] == 3000 and 0 < probe.error_ref < 0.1
    v = check_config(default_config(dtype, 128, 128), probe, reps=5)
    assert v.ok, v.reason
    assert v.median_ms > 0 and v.error_rel_l2 <= probe.error_limit


def test_study_entry_is_what_the_packed_call_runs(tmp_path):
    mix = parse_lengths(",".join(map(str, LENGTHS)))
    spec = TuneSpec(
        dtype="fp8",
        head_dim_qk=128,
        head_dim_v=128,
        lengths=mix,
        heads=8,
        kv_heads=2,
        trials=3,
        sampler="random",
        storage=str(tmp_path / "t.db"),
        study_storage=str(tmp_path / "s.journal"),
        warm_start=(),
    )
    Tuner(spec).run()
    d = dispatch.Dispatcher([spec.storage])
    key = shape_key(spec.shapes[0], "fp8", 128, 128, True)
    choice = d.choose_varlen(key, dispatch.device_key(0))
    assert choice.source == "exact"
    config, tuned = d.varlen_config_for("fp8", 128, 128, True, len(LENGTHS), 8, 2, mix.total, mix.max_len, 0)
    assert tuned and config == choice.config
    dispatch.set_databases([spec.storage])
    try:
        (q, k, v), kw = packed_args(
            "fp8", packed_qkv("gaussian", LENGTHS, heads=8, kv_heads=2, head_dim_qk=128, head_dim_v=128, seed=5)
        )
        cu = cu_seqlens(LENGTHS)
        out = flash_attn_varlen_func(q, k, v, cu, cu, mix.max_len, mix.max_len, causal=True, **kw)
        ref = attention_reference_varlen(q, k, v, cu, cu, causal=True, **kw)
        assert torch.isfinite(out).all() and rel_l2(out, ref) < 5e-2
    finally:
        dispatch.set_databases(None)
