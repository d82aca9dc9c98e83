"""GPU tests: packed sequences, sliding windows and LSE against float64, the per-layout fast path,
value checks of CUDA cumulative lengths, and CUDA-graph capture of a packed call."""

from __future__ import annotations

import pytest
import torch

from zyfa_tune import api, flash_attn_func, flash_attn_varlen_func
from zyfa_tune.generator.defaults import default_config
from zyfa_tune.kernels.launch import ServingLaunch
from zyfa_tune.search_spaces.seeds import gluon_lean_max_config
from zyfa_tune.tuning.reference import attention_reference, attention_reference_varlen, rel_l2

pytestmark = pytest.mark.gpu

FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16
#: rel. L2 bounds of the output vs float64 on the same inputs (the FP8 one a lean softmax's, which a
#: tuned entry may be), and abs. bounds of the natural-log LSE (a lean softmax's P codes overestimate
#: 2^x by up to 6 %, so its row sums by as much)
OUT_BOUND = {"fp8": 0.05, "bf16": 0.01}
LSE_BOUND = {"fp8": 0.1, "bf16": 0.01}
#: FP8 LSE of an exact softmax (float32 scores and row sums): the scores' own error bounds it. FP8 wgmma adds
#: its products at less than float32's precision, so scores of |s| ~ 10 (descales near 2) err by ~1e-3 and an
#: LSE ruled by one key by as much: the Gluon and Triton kernels both measured 3.4e-3 on an H100 here
EXACT_LSE_BOUND = 5e-3
#: lengths 0 and 1, odd ones, block edges and a few thousand
LENGTHS = [0, 1, 2, 63, 64, 65, 127, 129, 333, 1000, 2047, 3001]


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


def _lengths(n: int, seed: int, same: bool = False) -> tuple[list[int], list[int]]:
    """n sequences drawn from LENGTHS (queries) and, unless `same`, keys of other lengths."""
    g = torch.Generator().manual_seed(seed)
    pick = lambda: [LENGTHS[int(i)] for i in torch.randint(len(LENGTHS), (n,), generator=g)]  # noqa: E731
    lq = pick()
    return lq, (list(lq) if same else pick())


def _packed(lq, lk, h, hk, d, dtype: str, seed: int):
    """q, k, v on the GPU (fp8 codes of N(0, 1) values with descales in [0.5, 1.5], or bf16)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    tdt = FP8 if dtype == "fp8" else BF16
    q, k, v = (
        torch.randn(n, heads, d, device="cuda", generator=g).to(tdt)
        for n, heads in ((sum(lq), h), (sum(lk), hk), (sum(lk), hk))
    )
    kw = {}
    if dtype == "fp8":
        kw = {
            n: torch.rand(len(lq), hk, device="cuda", generator=g) + 0.5
            for n in ("q_descale", "k_descale", "v_descale")
        }
    return (q, k, v, _cu(lq), _cu(lk), max(lq, default=0), max(lk, default=0)), kw


def _check(args, kw, dtype, causal=True, window=(-1, -1), config=None):
    out, lse = flash_attn_varlen_func(*args, causal=causal, window_size=window, return_lse=True, config=config, **kw)
    q, k, v, cq, ck = args[:5]
    ref, ref_lse = attention_reference_varlen(q, k, v, cq, ck, causal=causal, window_size=window, return_lse=True, **kw)
    assert out.shape == (q.shape[0], q.shape[1], v.shape[2]) and out.dtype == BF16
    assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32
    assert torch.isfinite(out).all()
    assert rel_l2(out, ref) < OUT_BOUND[dtype], f"rel L2 {rel_l2(out, ref):.3e}"
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen), "LSE is -inf exactly where a row sees no key"
    assert (lse[~seen] == float("-inf")).all()
    assert (out.transpose(0, 1)[~seen] == 0).all(), "rows that see no key are zeros"
    if seen.any():
        err = (lse[seen].double() - ref_lse[seen]).abs().max().item()
        assert err < LSE_BOUND[dtype], f"LSE max abs err {err:.3e}"
    return out, lse


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
@pytest.mark.parametrize("h,hk", [(8, 8), (8, 2), (8, 1)])  # GQA 1, 4, 8
@pytest.mark.parametrize("causal", [True, False])
def test_random_packings_match_float64(dtype, h, hk, causal):
    for seed in range(2):
        lq, lk = _lengths(6, seed=seed, same=seed == 0)
        args, kw = _packed(lq, lk, h, hk, 128, dtype, seed)
        _check(args, kw, dtype, causal)


@pytest.mark.parametrize("d", [64, 96, 256])
def test_other_head_dims(d):
    for dtype in ("fp8", "bf16"):
        args, kw = _packed([5, 0, 700, 1], [5, 3, 700, 129], 4, 2, d, dtype, seed=d)
        _check(args, kw, dtype)


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
@pytest.mark.parametrize(
    "causal,window",
    [
        (True, (0, 0)),
        (True, (1, -1)),
        (True, (63, 0)),
        (True, (64, 0)),
        (True, (127, 0)),
        (True, (128, 0)),
        (True, (300, 0)),
        (False, (5, 9)),
        (False, (-1, 3)),
        (False, (100, -1)),
        (False, (0, 0)),
    ],
)
def test_window_edges(dtype, causal, window):
    lq, lk = _lengths(5, seed=7)
    args, kw = _packed(lq, lk, 4, 2, 128, dtype, seed=3)
    _check(args, kw, dtype, causal, window)


def test_lean_fp8_config_and_a_forced_triton_config():
    args, kw = _packed([1000, 3, 0, 513], [1200, 3, 7, 513], 8, 2, 128, "fp8", seed=11)
    lean = default_config("fp8", 128, 128).replace(softmax="lean", rowsum="rounded")
    _check(args, kw, "fp8", config=lean.replace(v_layout="natural"))
    _check(args, kw, "fp8", config=default_config("fp8", 128, 128))  # runs as its natural-V twin


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (-1, -1)), (True, (100, 0)), (False, (37, 5))])
def test_dense_window_and_lse(dtype, causal, window):
    b, sq, sk, h, hk, d = 2, 1000, 1100, 8, 2, 128
    g = torch.Generator(device="cuda").manual_seed(5)
    tdt = FP8 if dtype == "fp8" else BF16
    q = torch.randn(b, sq, h, d, device="cuda", generator=g).to(tdt)
    k, v = (torch.randn(b, sk, hk, d, device="cuda", generator=g).to(tdt) for _ in range(2))
    out, lse = flash_attn_func(q, k, v, causal=causal, window_size=window, return_lse=True)
    ref, ref_lse = attention_reference(q, k, v, causal=causal, window_size=window, return_lse=True)
    assert lse.shape == (b, h, sq) and rel_l2(out, ref) < OUT_BOUND[dtype]
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen)
    assert (lse[seen].double() - ref_lse[seen]).abs().max().item() < LSE_BOUND[dtype]
    plain = flash_attn_func(q, k, v, causal=causal)  # the plain kernel, where the window bounds nothing
    if window == (-1, -1):
        assert rel_l2(plain, out) < OUT_BOUND[dtype]


#: Gluon configs whose LSE twin the dense call runs: an exact softmax (float32 row sums), lean P (its row
#: maximum as reference, sums from the codes, f16 scores), row sums from the MMA on rounded P
GLUON_LSE = {
    "exact": default_config("fp8", 128, 128, "gluon"),
    "lean": gluon_lean_max_config("fp8", 128, 128),
    "rowsum-mma": default_config("fp8", 128, 128, "gluon").replace(rowsum="mma", skip_rescale=True),
}


@pytest.mark.parametrize("name", list(GLUON_LSE))
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("sq,sk,h,hk", [(1000, 1000, 8, 2), (333, 1001, 8, 8), (1001, 257, 8, 1), (1, 77, 4, 4)])
def test_gluon_lse_twin_against_float64(monkeypatch, name, causal, sq, sk, h, hk):
    """The Gluon config's LSE twin runs (no Triton fallback): odd lengths, fewer keys than queries (causal:
    rows that see no key get -inf and zeros), GQA; the output equals the kernel's own bitwise."""
    config = GLUON_LSE[name]
    monkeypatch.setattr(api, "_plans", {})
    g = torch.Generator(device="cuda").manual_seed(sq + sk)
    q = torch.randn(2, sq, h, 128, device="cuda", generator=g).to(FP8)
    k, v = (torch.randn(2, sk, hk, 128, device="cuda", generator=g).to(FP8) for _ in range(2))
    kw = {n: torch.rand(2, hk, device="cuda", generator=g) + 0.5 for n in ("q_descale", "k_descale", "v_descale")}
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True, config=config, **kw)
    (plan,) = api._plans.values()
    assert isinstance(plan.launch, ServingLaunch) and plan.launch.lse_only
    ref, ref_lse = attention_reference(q, k, v, causal=causal, return_lse=True, **kw)
    assert lse.shape == (2, h, sq) and lse.dtype == torch.float32 and rel_l2(out, ref) < OUT_BOUND["fp8"]
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen) and (lse[~seen] == float("-inf")).all()
    assert (out.transpose(1, 2)[~seen] == 0).all(), "rows that see no key are zeros"
    exact = config.softmax == "exact" and config.rowsum == "fp32"  # (float32 scores and sums only)
    err = (lse[seen].double() - ref_lse[seen]).abs().max().item()
    assert err < (EXACT_LSE_BOUND if exact else LSE_BOUND["fp8"]), f"LSE max abs err {err:.3e}"
    assert torch.equal(out, flash_attn_func(q, k, v, causal=causal, config=config, **kw))
    again, lse2 = flash_attn_func(q, k, v, causal=causal, return_lse=True, config=config, **kw)  # the fast path
    assert torch.equal(again, out) and torch.equal(lse2, lse) and lse2.data_ptr() != lse.data_ptr()


def test_fast_path_equals_the_checked_path_bitwise(monkeypatch):
    monkeypatch.setattr(api, "_plans", {})
    monkeypatch.setattr(api, "_values_checked", set())
    lq, lk = _lengths(8, seed=21)
    args, kw = _packed(lq, lk, 8, 2, 128, "fp8", seed=21)
    first = flash_attn_varlen_func(*args, return_lse=True, window_size=(200, 0), **kw)
    assert len(api._plans) == 1
    copies = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    second = flash_attn_varlen_func(
        *copies, return_lse=True, window_size=(200, 0), **{n: d.clone() for n, d in kw.items()}
    )
    assert len(api._plans) == 1
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    assert second[0].data_ptr() != first[0].data_ptr()


def test_cuda_lengths_are_read_on_the_first_call_and_with_validate(monkeypatch):
    monkeypatch.setattr(api, "_plans", {})
    monkeypatch.setattr(api, "_values_checked", set())
    args, _ = _packed([5, 3, 8], [5, 3, 8], 4, 2, 64, "bf16", seed=2)
    bad = list(args)
    bad[3] = torch.tensor([0, 5, 3, 16], dtype=torch.int32, device="cuda")  # sequence 1 has length -2
    with pytest.raises(ValueError, match=r"^cu_seqlens_q: decreases at index 2 \(5 then 3\)"):
        flash_attn_varlen_func(*bad)  # the layout's first call reads the values
    flash_attn_varlen_func(*args)
    flash_attn_varlen_func(*bad)  # a checked layout: used as given (a negative length runs no program)
    with pytest.raises(ValueError, match="^cu_seqlens_q: decreases"):
        flash_attn_varlen_func(*bad, validate=True)


def test_cuda_graph_capture_of_a_packed_call(monkeypatch):
    monkeypatch.setattr(api, "_plans", {})
    lq, lk = _lengths(6, seed=31)
    args, kw = _packed(lq, lk, 8, 2, 128, "fp8", seed=31)
    static = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    static_kw = {n: d.clone() for n, d in kw.items()}
    flash_attn_varlen_func(*static, return_lse=True, **static_kw)  # the checked call: plan, compile, values
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = flash_attn_varlen_func(*static, return_lse=True, **static_kw)
    new, new_kw = _packed(lq, lk, 8, 2, 128, "fp8", seed=32)
    for s, n in zip(static[:3], new[:3]):
        s.copy_(n)
    for name, d in new_kw.items():
        static_kw[name].copy_(d)
    graph.replay()
    torch.cuda.synchronize()
    want, want_lse = flash_attn_varlen_func(*new, return_lse=True, **new_kw)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


def test_no_queries_and_no_keys():
    args, _ = _packed([0, 0], [4, 0], 4, 2, 64, "bf16", seed=3)
    out, lse = flash_attn_varlen_func(*args, return_lse=True)
    assert out.shape == (0, 4, 64) and lse.shape == (4, 0)
    args, _ = _packed([3, 2], [0, 0], 4, 2, 64, "bf16", seed=4)
    out, lse = flash_attn_varlen_func(*args, return_lse=True)
    assert (out == 0).all() and (lse == float("-inf")).all()
