"""GPU tests of the bf16-in calls' serving options: `attention` with window_size and return_lse, and
`attention_varlen` over random packings, against float64 on the unquantised inputs, and a packed call
captured in a CUDA graph.

Bounds: the inputs' rounding to e4m3 is part of these calls' error; by the triangle inequality it is at
most the error of float64 attention on the plainly quantised inputs plus the FP8 kernel's own (the
kernel bound of tests/test_gpu_varlen.py: a tuned entry may run a lean softmax)."""

from __future__ import annotations

import pytest
import torch

from zyfa_tune import api
from zyfa_tune.attention import attention, attention_varlen, explain_attention
from zyfa_tune.kernels.launch import ServingLaunch
from zyfa_tune.quantize import quantize_fp8, quantize_fp8_varlen
from zyfa_tune.tuning.reference import attention_reference, attention_reference_varlen, rel_l2
from zyfa_tune.varlen import flash_attn_varlen_func

pytestmark = pytest.mark.gpu

#: the FP8 kernel's rel. L2 bound of the output and abs. bound of the natural-log LSE against float64
#: on the same codes (tests/test_gpu_varlen.py's)
KERNEL_BOUND = 0.05
LSE_BOUND = 0.1
LENGTHS = [0, 1, 2, 17, 63, 64, 65, 129, 333, 1000, 2047]


def _dense(b, sq, sk, h, hk, d, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(b, s, n, d, device="cuda", generator=g).to(dtype) for s, n in ((sq, h), (sk, hk), (sk, hk))]


def _check(out, lse, ref, ref_lse, quantised, quantised_lse) -> None:
    """out and lse against float64 on the unquantised inputs, within the rounding's own error (float64
    on the quantised inputs) plus the kernel's bound; rows that see no key: zeros and -inf."""
    rounding = rel_l2(quantised, ref)
    assert torch.isfinite(out).all()
    assert rel_l2(out, ref) < rounding + KERNEL_BOUND, f"rel L2 {rel_l2(out, ref):.3e}, rounding {rounding:.3e}"
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen) and (lse[~seen] == float("-inf")).all()
    if seen.any():
        rounding = (quantised_lse[seen] - ref_lse[seen]).abs().max().item()
        err = (lse[seen].double() - ref_lse[seen]).abs().max().item()
        assert err < rounding + LSE_BOUND, f"LSE max abs err {err:.3e}, rounding {rounding:.3e}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "sq, sk, causal, window",
    [
        (1000, 1000, True, (-1, -1)),  # the LSE alone
        (1000, 1000, True, (64, 0)),  # a sliding window
        (777, 777, False, (100, 31)),  # both sides bounded
        (300, 1000, True, (128, -1)),  # fewer queries than keys: bottom-right aligned
        (1000, 1000, False, (-1, -1)),
    ],
)
def test_attention_with_window_and_lse_against_float64(dtype, sq, sk, causal, window):
    q, k, v = _dense(2, sq, sk, 8, 2, 128, dtype, seed=sq + sk)
    out, lse = attention(q, k, v, causal=causal, window_size=window, return_lse=True)
    assert out.dtype == dtype and out.shape == (2, sq, 8, 128) and lse.shape == (2, 8, sq)
    assert lse.dtype == torch.float32
    ref, ref_lse = attention_reference(q, k, v, causal=causal, window_size=window, return_lse=True)
    q8, k8, v8, qd, kd, vd = quantize_fp8(q, k, v)
    kw = dict(q_descale=qd, k_descale=kd, v_descale=vd, causal=causal, window_size=window, return_lse=True)
    quantised, quantised_lse = attention_reference(q8, k8, v8, **kw)
    _check(out, lse, ref, ref_lse, quantised, quantised_lse)
    alone = attention(q, k, v, causal=causal, window_size=window)  # no LSE: the same output
    assert alone.shape == out.shape and rel_l2(alone, ref) < rel_l2(quantised, ref) + KERNEL_BOUND


@pytest.mark.parametrize("causal", [True, False])
def test_an_lse_alone_runs_the_entry_s_own_kernel(monkeypatch, causal):
    """return_lse keeps the kernel the plain call runs (its Gluon LSE twin where that kernel is Gluon: no
    Triton fallback) and matches float64; its output is the plain call's, bitwise."""
    monkeypatch.setattr(api, "_plans", {})
    q, k, v = _dense(2, 1000, 1000, 8, 2, 128, torch.bfloat16, seed=9)
    chosen, plain = (explain_attention(q, k, v, causal=causal, return_lse=lse) for lse in (True, False))
    assert chosen.kernel.config == plain.kernel.config
    out, lse = attention(q, k, v, causal=causal, return_lse=True)
    if chosen.kernel.config.backend == "gluon":
        assert any(isinstance(p.launch, ServingLaunch) and p.launch.lse_only for p in api._plans.values())
    ref, ref_lse = attention_reference(q, k, v, causal=causal, return_lse=True)
    q8, k8, v8, qd, kd, vd = quantize_fp8(q, k, v)
    kw = dict(q_descale=qd, k_descale=kd, v_descale=vd, causal=causal, return_lse=True)
    _check(out, lse, ref, ref_lse, *attention_reference(q8, k8, v8, **kw))
    if chosen.recipe == plain.recipe:  # (an LSE turns K smoothing off)
        assert torch.equal(out, attention(q, k, v, causal=causal))


@pytest.mark.parametrize("causal,window", [(True, (64, 0)), (True, (1, 0)), (False, (5, 7)), (False, (-1, 3))])
def test_a_window_runs_the_entry_s_own_kernel(monkeypatch, causal, window):
    """A window keeps the kernel the plain call runs (its Gluon window twin where that kernel is Gluon: no
    Triton fallback) and matches float64."""
    monkeypatch.setattr(api, "_plans", {})
    q, k, v = _dense(2, 1000, 1100, 8, 2, 128, torch.bfloat16, seed=11)
    chosen, plain = (explain_attention(q, k, v, causal=causal, window_size=w) for w in (window, (-1, -1)))
    if plain.kernel.config.backend == "gluon":
        assert chosen.kernel.config == plain.kernel.config
    out, lse = attention(q, k, v, causal=causal, window_size=window, return_lse=True)
    if chosen.kernel.config.backend == "gluon":
        assert any(isinstance(p.launch, ServingLaunch) and p.launch.lse_only for p in api._plans.values())
    ref, ref_lse = attention_reference(q, k, v, causal=causal, window_size=window, return_lse=True)
    q8, k8, v8, qd, kd, vd = quantize_fp8(q, k, v)
    kw = dict(q_descale=qd, k_descale=kd, v_descale=vd, causal=causal, window_size=window, return_lse=True)
    _check(out, lse, ref, ref_lse, *attention_reference(q8, k8, v8, **kw))


def _random_packing(n, h, hk, dqk, dv, dtype, seed, same=False):
    g = torch.Generator().manual_seed(seed)
    pick = lambda: [LENGTHS[int(i)] for i in torch.randint(len(LENGTHS), (n,), generator=g)]  # noqa: E731
    lq = pick()
    lk = list(lq) if same else pick()
    gc = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (
        torch.randn(sum(ls), heads, d, device="cuda", generator=gc).to(dtype)
        for ls, heads, d in ((lq, h, dqk), (lk, hk, dqk), (lk, hk, dv))
    )
    cu = [torch.tensor([0, *torch.tensor(ls).cumsum(0).tolist()], dtype=torch.int32, device="cuda") for ls in (lq, lk)]
    return (q, k, v, cu[0], cu[1], max(lq), max(lk))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("h, hk, dqk, dv", [(8, 8, 128, 128), (8, 2, 128, 128), (8, 1, 64, 64), (4, 2, 192, 128)])
@pytest.mark.parametrize("causal, window", [(True, (-1, -1)), (False, (-1, -1)), (True, (100, 0)), (False, (50, 20))])
def test_attention_varlen_against_float64(dtype, h, hk, dqk, dv, causal, window):
    for seed in range(2):
        args = _random_packing(6, h, hk, dqk, dv, dtype, seed, same=seed == 0)
        q, k, v, cq, ck = args[:5]
        out, lse = attention_varlen(*args, causal=causal, window_size=window, return_lse=True)
        assert out.dtype == dtype and out.shape == (q.shape[0], h, dv) and lse.shape == (h, q.shape[0])
        opts = dict(causal=causal, window_size=window, return_lse=True)
        ref, ref_lse = attention_reference_varlen(q, k, v, cq, ck, **opts)
        q8, k8, v8, qd, kd, vd = quantize_fp8_varlen(q, k, v, cq, ck)
        descales = dict(q_descale=qd, k_descale=kd, v_descale=vd)
        quantised, quantised_lse = attention_reference_varlen(q8, k8, v8, cq, ck, **descales, **opts)
        _check(out, lse, ref, ref_lse, quantised, quantised_lse)
        # the call is exactly the packed quantiser, then the FP8 varlen kernels on its codes
        want = flash_attn_varlen_func(q8, k8, v8, *args[3:], None, causal, qd, kd, vd, window, True)
        assert torch.equal(out, want[0].to(dtype)) and torch.equal(lse, want[1])


def test_attention_varlen_is_captured_in_a_cuda_graph():
    """After one eager call of the layout, a packed call captures (no host synchronisation) and its
    replays follow new values written into the captured inputs."""
    args = _random_packing(8, 8, 2, 128, 128, torch.bfloat16, seed=5, same=True)
    attention_varlen(*args)  # the eager call that checks the lengths and makes the plans
    static = [t.clone() for t in args[:3]]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attention_varlen(*static, *args[3:])
    for seed in (6, 7):
        g = torch.Generator(device="cuda").manual_seed(seed)
        for t in static:
            t.copy_(torch.randn(t.shape, device="cuda", generator=g))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, attention_varlen(*static, *args[3:]))
