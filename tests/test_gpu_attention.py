"""GPU tests: every head dim, dtype and softmax mode against float64 on fresh random inputs."""

from __future__ import annotations

import pytest
import torch

from zyfa_tune import flash_attn_func
from zyfa_tune.generator.defaults import default_config
from zyfa_tune.tuning.reference import attention_reference, rel_l2
from zyfa_tune.tuning.verify import make_inputs

pytestmark = pytest.mark.gpu

HEAD_DIMS = [(64, 64), (96, 96), (128, 128), (192, 128), (256, 256)]
#: rel. L2 bounds vs float64 on the same (quantised) inputs: fp8 exact/lean, bf16
FP8_EXACT_BOUND = 0.03
FP8_LEAN_BOUND = 0.05
BF16_BOUND = 0.01


def _inputs(b, sq, sk, h, hk, dqk, dv, dtype, seed):
    return make_inputs(dtype, dqk, dv, batch=b, heads=h, kv_heads=hk, seqlen=sq, seqlen_k=sk, seed=seed)


def _configs(dtype, dqk, dv):
    base = default_config(dtype, dqk, dv)
    if dtype == "bf16":
        return {"exact": base}
    lean = base.replace(softmax="lean", rowsum="rounded")
    return {
        "exact": base,
        "lean": lean,
        "lean-centered": lean.replace(lean_fold="centered"),
        "lean-centered-sat": lean.replace(lean_fold="centered", lean_clamp="sat"),
    }


def _check(b, sq, sk, h, hk, dqk, dv, dtype, causal=True, seed=0):
    args, kw = _inputs(b, sq, sk, h, hk, dqk, dv, dtype, seed)
    ref = attention_reference(*args, causal=causal, **kw)
    errs = {}
    for mode, cfg in _configs(dtype, dqk, dv).items():
        out = flash_attn_func(*args, causal=causal, config=cfg, **kw)
        assert out.dtype == torch.bfloat16 and out.shape == (b, sq, h, dv)
        assert torch.isfinite(out).all(), f"{mode}: non-finite output"
        errs[mode] = rel_l2(out, ref)
        bound = BF16_BOUND if dtype == "bf16" else FP8_EXACT_BOUND if mode == "exact" else FP8_LEAN_BOUND
        assert errs[mode] < bound, f"{mode} {dtype} {dqk}/{dv} S={sq}: rel L2 {errs[mode]:.3e} >= {bound}"
    return errs, args, kw, ref


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
@pytest.mark.parametrize("dqk,dv", HEAD_DIMS)
@pytest.mark.parametrize("seqlen", [1, 17, 1000, 4096])
def test_head_dims_and_seqlens(dqk, dv, dtype, seqlen):
    _check(2, seqlen, seqlen, 4, 2, dqk, dv, dtype)


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_long_sequence(dtype):
    _check(1, 16384, 16384, 2, 1, 128, 128, dtype)


@pytest.mark.parametrize("h,hk", [(8, 1), (8, 2), (6, 6)])
def test_gqa_mqa(h, hk):
    _check(1, 777, 777, h, hk, 128, 128, "fp8")


@pytest.mark.parametrize("sq,sk", [(100, 300), (300, 100), (1, 5000)])
def test_unequal_seqlens_and_non_causal(sq, sk):
    _check(1, sq, sk, 2, 2, 128, 128, "fp8", causal=True)
    _check(1, sq, sk, 2, 2, 128, 128, "fp8", causal=False)


def test_every_output_element_written():
    args, kw = _inputs(1, 333, 333, 2, 2, 128, 128, "fp8", 3)
    out = flash_attn_func(*args, **kw)
    assert not torch.isnan(out).any()


def test_error_within_fa3():
    """Exact mode: rel. L2 within 1.1x FA3's on the same FP8 inputs."""
    fa3 = pytest.importorskip("fa3_fwd_interface")
    for dqk, dv in HEAD_DIMS:
        for s in (1000, 4096):
            args, kw = _inputs(1, s, s, 8, 8, dqk, dv, "fp8", 11)
            ref = attention_reference(*args, causal=True, **kw)
            ours = rel_l2(flash_attn_func(*args, causal=True, **kw), ref)
            r = fa3.flash_attn_func(*args, causal=True, **kw)
            theirs = rel_l2(r[0] if isinstance(r, tuple) else r, ref)
            print(f"{dqk}/{dv} S={s}: ours {ours:.4e} fa3 {theirs:.4e}")
            assert ours <= 1.1 * theirs, f"{dqk}/{dv} S={s}: ours {ours:.4e} > 1.1 x FA3 {theirs:.4e}"


@pytest.mark.parametrize("softmax", ["exact", "lean"])
def test_bitwise_deterministic(softmax):
    args, kw = _inputs(2, 2048, 2048, 8, 8, 128, 128, "fp8", 5)
    cfg = default_config("fp8", 128, 128)
    if softmax == "lean":
        cfg = cfg.replace(softmax="lean", rowsum="rounded")
    first = flash_attn_func(*args, config=cfg, **kw)
    for _ in range(100):
        assert torch.equal(flash_attn_func(*args, config=cfg, **kw), first)


@pytest.mark.parametrize("backend", ["triton", "gluon"])
def test_descale_values(monkeypatch, backend):
    """CUDA descales are read on a layout's first call and with validate=True (a NaN is refused there),
    never on the fast path, where they act as flash_attn_func's docstring says: a NaN q_descale leaves
    no row finite, a negative v_descale negates the output."""
    from zyfa_tune import api

    monkeypatch.setattr(api, "_plans", {})
    monkeypatch.setattr(api, "_values_checked", set())
    args, kw = _inputs(1, 256, 256, 2, 2, 128, 128, "fp8", 7)
    cfg = default_config("fp8", 128, 128, backend)
    nan = torch.full_like(kw["q_descale"], float("nan"))
    with pytest.raises(ValueError, match="^q_descale: descales must be finite and positive"):
        flash_attn_func(*args, config=cfg, **{**kw, "q_descale": nan})
    good = flash_attn_func(*args, config=cfg, **kw)  # the layout's first valid call: planned
    assert torch.isfinite(good).all() and len(api._plans) == 1
    assert not torch.isfinite(flash_attn_func(*args, config=cfg, **{**kw, "q_descale": nan})).any()
    with pytest.raises(ValueError, match="^q_descale: descales must be finite and positive"):
        flash_attn_func(*args, config=cfg, validate=True, **{**kw, "q_descale": nan})
    negated = flash_attn_func(*args, config=cfg, **{**kw, "v_descale": -kw["v_descale"]})
    assert torch.equal(negated, -good)
