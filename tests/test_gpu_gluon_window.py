"""GPU tests of the Gluon kernels' window twin against float64: dense and packed calls with forced Gluon
configs (exact, lean P, row sums by MMA, the plain schedule), windows at and across block edges, causal
and not, fewer or more keys than queries (bottom-right aligned), GQA, odd lengths and lengths 0 / 1; the
window twin runs (no Triton fallback) and its output equals the window+LSE twin's bitwise."""

from __future__ import annotations

import pytest
import torch
from test_gpu_varlen import EXACT_LSE_BOUND, LSE_BOUND, OUT_BOUND, _check, _packed

from zyfa_tune import api, flash_attn_func
from zyfa_tune.generator.defaults import default_config
from zyfa_tune.kernels.launch import ServingLaunch
from zyfa_tune.search_spaces.seeds import gluon_lean_max_config
from zyfa_tune.tuning.reference import attention_reference, rel_l2

pytestmark = pytest.mark.gpu

FP8 = torch.float8_e4m3fn
GLUON = default_config("fp8", 128, 128, "gluon")
CONFIGS = {
    "exact": GLUON,
    "lean": gluon_lean_max_config("fp8", 128, 128),
    "rowsum-mma": GLUON.replace(rowsum="mma", skip_rescale=True),
    "plain": GLUON.replace(overlap=False, ping_pong=False),
}
#: (causal, window): the diagonal alone, one key back, around one and two 128-key blocks, past the
#: sequence; non-causal with an unbounded left side and with both sides bounded
WINDOWS = [
    (True, (0, 0)),
    (True, (1, 0)),
    (True, (127, 0)),
    (True, (128, 0)),
    (True, (255, 0)),
    (True, (1000, 0)),
    (False, (-1, 3)),
    (False, (5, 7)),
    (False, (300, 0)),
]


def _dense(sq, sk, h, hk, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(2, sq, h, 128, device="cuda", generator=g).to(FP8)
    k, v = (torch.randn(2, sk, hk, 128, device="cuda", generator=g).to(FP8) for _ in range(2))
    kw = {n: torch.rand(2, hk, device="cuda", generator=g) + 0.5 for n in ("q_descale", "k_descale", "v_descale")}
    return q, k, v, kw


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("causal,window", WINDOWS)
@pytest.mark.parametrize("sq,sk,h,hk", [(1000, 1000, 8, 2), (333, 1001, 8, 8), (1001, 257, 8, 1), (1, 77, 4, 4)])
def test_dense_gluon_window_against_float64(monkeypatch, name, causal, window, sq, sk, h, hk):
    config = CONFIGS[name]
    monkeypatch.setattr(api, "_plans", {})
    q, k, v, kw = _dense(sq, sk, h, hk, seed=sq + sk + window[0])
    opts = dict(causal=causal, window_size=window, config=config, **kw)
    out, lse = flash_attn_func(q, k, v, return_lse=True, **opts)
    (plan,) = api._plans.values()
    assert isinstance(plan.launch, ServingLaunch) and plan.launch.lse_only  # the Gluon twin, not Triton
    ref, ref_lse = attention_reference(q, k, v, causal=causal, window_size=window, return_lse=True, **kw)
    assert rel_l2(out, ref) < OUT_BOUND["fp8"], f"rel L2 {rel_l2(out, ref):.3e}"
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen) and (lse[~seen] == float("-inf")).all()
    assert (out.transpose(1, 2)[~seen] == 0).all(), "rows that see no key are zeros"
    if seen.any():
        exact = config.softmax == "exact" and config.rowsum == "fp32"
        err = (lse[seen].double() - ref_lse[seen]).abs().max().item()
        assert err < (EXACT_LSE_BOUND if exact else LSE_BOUND["fp8"]), f"LSE max abs err {err:.3e}"
    assert torch.equal(flash_attn_func(q, k, v, **opts), out)  # the window twin without the LSE
    again, lse2 = flash_attn_func(q, k, v, return_lse=True, **opts)  # the fast path
    assert torch.equal(again, out) and torch.equal(lse2, lse)


@pytest.mark.parametrize("name", ["exact", "lean"])
@pytest.mark.parametrize("causal,window", WINDOWS)
@pytest.mark.parametrize("h,hk", [(8, 2), (4, 4)])
def test_packed_gluon_window_against_float64(name, causal, window, h, hk):
    config = CONFIGS[name]
    if config.softmax == "exact":  # natural V (lean P's carry reads V^T's permuted keys: a V^T copy)
        config = config.replace(v_layout="natural", v_permute=False)
    args, kw = _packed([0, 1, 5, 129, 1000, 333, 2], [3, 1, 0, 129, 1200, 257, 2], h, hk, 128, "fp8", seed=17)
    _check(args, kw, "fp8", causal, window, config=config)
    args, kw = _packed([64, 65, 127, 1], [64, 65, 127, 1], h, hk, 128, "fp8", seed=18)
    _check(args, kw, "fp8", causal, window, config=CONFIGS[name])  # (V^T copied per sequence)


@pytest.mark.parametrize("d,dv", [(64, 64), (256, 256), (192, 128)])
def test_other_head_dims(d, dv):
    config = default_config("fp8", d, dv, "gluon")
    g = torch.Generator(device="cuda").manual_seed(d)
    q = torch.randn(2, 700, 4, d, device="cuda", generator=g).to(FP8)
    k = torch.randn(2, 900, 2, d, device="cuda", generator=g).to(FP8)
    v = torch.randn(2, 900, 2, dv, device="cuda", generator=g).to(FP8)
    for causal, window in ((True, (129, 0)), (False, (40, 70))):
        out, lse = flash_attn_func(q, k, v, causal=causal, window_size=window, return_lse=True, config=config)
        ref, ref_lse = attention_reference(q, k, v, causal=causal, window_size=window, return_lse=True)
        assert rel_l2(out, ref) < OUT_BOUND["fp8"]
        seen = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), seen)
        assert (lse[seen].double() - ref_lse[seen]).abs().max().item() < LSE_BOUND["fp8"]
