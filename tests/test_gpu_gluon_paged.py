"""GPU tests of the Gluon paged twin (kernels/gluon_paged.py): against float64 with pages shuffled and shared
between sequences and stale NaN slots (tests/test_gpu_paged.py's caches), cache lengths 1, odd and multiples
of the page, GQA 1/4/8, hd64 / hd128, page sizes block_n and 2 * block_n, the LSE and windows; bitwise
against the same config's varlen kernel on the contiguous (packed) K and V, whose arithmetic is the same;
the API's routing (a Gluon pick runs the twin, BF16 keeps the Triton variant) and its fast path."""

from __future__ import annotations

import pytest
import torch
from test_gpu_paged import LSE_BOUND, OUT_BOUND, _cache, _queries

from zyfa_tune import api, flash_attn_with_kvcache
from zyfa_tune.generator.defaults import default_config
from zyfa_tune.kernels import gluon_paged, gluon_varlen
from zyfa_tune.kvcache import paged_from_packed
from zyfa_tune.search_spaces.seeds import gluon_lean_max_config, gluon_natural_config
from zyfa_tune.tuning.reference import attention_reference_paged, rel_l2

pytestmark = pytest.mark.gpu


def _natural(d: int, route: str = "k_perm"):
    """The default's natural-V version the API runs (`k_perm`: V^T's key relabelling made on K), or the natural
    seed (`key_order`: V^T in key order, no relabelling; its varlen kernel runs the same arithmetic)."""
    if route == "key_order":
        return gluon_natural_config("fp8", d, d)
    config = gluon_paged.natural_config(default_config("fp8", d, d, "gluon"))
    assert config.k_perm
    return config


def _run(config, q, cache, causal=True, window=None, lse=False, cu_q=None, max_q=None):
    """The twin through gluon_paged.bind: (out, lse or None) as the API shapes them."""
    k_cache, v_cache, table, lens, ds = cache
    out = torch.empty(*q.shape[:-1], v_cache.shape[-1], dtype=torch.bfloat16, device="cuda")
    lse_t = None
    if lse:
        shape = (q.shape[-2], q.shape[0]) if cu_q is not None else (q.shape[0], q.shape[2], q.shape[1])
        lse_t = torch.empty(shape, dtype=torch.float32, device="cuda")
    descales = tuple(ds[n] for n in ("q_descale", "k_descale", "v_descale"))
    max_q = max_q if cu_q is not None else q.shape[1]
    gluon_paged.bind(
        config, q, k_cache, v_cache, out, q.shape[-1] ** -0.5, causal, descales, (cu_q, table, lens), max_q, lse_t,
        window,
    )  # fmt: skip
    return out, lse_t


def _against_float64(config, q, cache, causal=True, window=(-1, -1), cu_q=None, max_q=None):
    k_cache, v_cache, table, lens, ds = cache
    bounds = api.window_bounds(window, causal, table.shape[1] * k_cache.shape[1], max_q or q.shape[1])
    out, lse = _run(config, q, cache, causal, bounds, True, cu_q, max_q)
    ref, ref_lse = attention_reference_paged(
        q, k_cache, v_cache, table, lens, cu_seqlens_q=cu_q, causal=causal, window_size=window, return_lse=True, **ds
    )
    assert torch.isfinite(out).all(), "a stale (NaN) cache slot reached the output"
    assert rel_l2(out, ref) < OUT_BOUND["fp8"], f"rel L2 {rel_l2(out, ref):.3e}"
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen)
    err = (lse[seen].double() - ref_lse[seen]).abs().max().item()
    assert err < LSE_BOUND["fp8"], f"LSE max abs err {err:.3e}"


@pytest.mark.parametrize("route", ["k_perm", "key_order"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("pages_per_block", [1, 2])
@pytest.mark.parametrize("h,hk", [(8, 8), (8, 2), (8, 1)])  # GQA 1, 4, 8
def test_the_twin_matches_float64(route, d, pages_per_block, h, hk):
    config = _natural(d, route)
    page_size = config.block_n * pages_per_block
    lens = [1001, 2 * page_size, 1, 129, 130 + page_size]  # (odd, a page's multiple, 1)
    cache = _cache(lens, page_size, hk, d, "fp8", seed=page_size + h + hk + d, shared=1)  # (0 and 1 share a page)
    q = _queries((len(lens), 1, h, d), "fp8", seed=hk)
    _against_float64(config, q, cache)
    lq = [129, 64, 1, 1, 130]
    q = _queries((sum(lq), h, d), "fp8", seed=hk + 1)
    cu = torch.tensor([0, *torch.tensor(lq).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    _against_float64(config, q, cache, cu_q=cu, max_q=max(lq))


@pytest.mark.parametrize("name", ["default", "lean"])
@pytest.mark.parametrize("causal,window", [(True, (127, 0)), (True, (300, 0)), (False, (-1, -1)), (False, (50, 7))])
def test_the_twin_takes_windows_and_non_causal_calls(name, causal, window):
    config = _natural(128) if name == "default" else gluon_paged.natural_config(gluon_lean_max_config("fp8", 128, 128))
    cache = _cache([300, 77, 1500], 128, 2, 128, "fp8", seed=9)
    _against_float64(config, _queries((3, 77, 8, 128), "fp8", seed=10), cache, causal, window)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("pages_per_block", [1, 2])
@pytest.mark.parametrize("lse", [False, True])
def test_the_twin_equals_the_varlen_kernel_on_contiguous_keys_bitwise(d, pages_per_block, lse):
    """Same tiles, same blocks, same order: the pages change only where K and V rows are read (and the stale
    slots past a sequence's end, masked there and zero here, add exactly nothing either way). The key-order
    config: a varlen kernel takes no k_perm."""
    config = _natural(d, "key_order")
    page_size = config.block_n * pages_per_block
    lk, lq = [1, 200, 2 * page_size, 777], [1, 129, 5, 300]
    g = torch.Generator(device="cuda").manual_seed(d + page_size)
    k, v = (torch.randn(sum(lk), 2, d, device="cuda", generator=g).to(torch.float8_e4m3fn) for _ in range(2))
    q = torch.randn(sum(lq), 8, d, device="cuda", generator=g).to(torch.float8_e4m3fn)
    ds = tuple(torch.rand(4, 2, device="cuda", generator=g) + 0.5 for _ in range(3))
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(x).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
                  for x in (lq, lk))  # fmt: skip
    out = torch.empty(sum(lq), 8, d, dtype=torch.bfloat16, device="cuda")
    want_lse = torch.empty(8, sum(lq), device="cuda") if lse else None
    scale = d**-0.5
    gluon_varlen.bind(config, q, k, v, out, scale, True, ds, (cu_q, cu_k), (max(lq), max(lk)), want_lse)
    k_cache, v_cache, table, lens = paged_from_packed(k, v, lk, page_size, torch.Generator().manual_seed(1))
    cache = (k_cache, v_cache, table, lens, dict(zip(("q_descale", "k_descale", "v_descale"), ds)))
    got, got_lse = _run(config, q, cache, lse=lse, cu_q=cu_q, max_q=max(lq))
    assert torch.equal(got, out)
    assert not lse or torch.equal(got_lse, want_lse)


def test_the_api_runs_a_gluon_pick_on_the_twin_and_bf16_on_triton(monkeypatch):
    monkeypatch.setattr(api, "_plans", {})
    ran = []
    bind = gluon_paged.bind
    monkeypatch.setattr(gluon_paged, "bind", lambda c, *a: ran.append(c) or bind(c, *a))
    pick = default_config("fp8", 128, 128, "gluon")
    picks = {"fp8": pick, "bf16": default_config("bf16", 128, 128)}
    fake = type("Dispatcher", (), {"config_for": lambda self, dtype, *a: picks[dtype]})()
    monkeypatch.setattr("zyfa_tune.kernels.dispatch.dispatcher", lambda: fake)
    lens = [700, 300, 1300]
    k_cache, v_cache, table, lens_t, ds = _cache(lens, 128, 2, 128, "fp8", seed=21, shared=2)
    q = _queries((3, 300, 8, 128), "fp8", seed=22)
    kw = dict(cache_seqlens=lens_t, page_table=table, return_lse=True, **ds)
    first = flash_attn_with_kvcache(q, k_cache, v_cache, **kw)
    assert [c.v_layout for c in ran] == ["natural"]
    second = flash_attn_with_kvcache(q, k_cache, v_cache, **kw)  # (the fast path)
    assert len(ran) == 1 and torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    ref, ref_lse = attention_reference_paged(q, k_cache, v_cache, table, lens_t, return_lse=True, **ds)
    assert rel_l2(first[0], ref) < OUT_BOUND["fp8"]
    k_cache, v_cache, table, lens_t, _ = _cache(lens, 128, 2, 128, "bf16", seed=23)
    flash_attn_with_kvcache(_queries((3, 300, 8, 128), "bf16", seed=24), k_cache, v_cache, cache_seqlens=lens_t,
                            page_table=table)  # fmt: skip
    assert len(ran) == 1  # (BF16 caches: the Triton serving variant)


def test_a_forced_gluon_config_runs_its_natural_version_on_the_twin(monkeypatch):
    ran = []
    bind = gluon_paged.bind
    monkeypatch.setattr(gluon_paged, "bind", lambda c, *a: ran.append(c) or bind(c, *a))
    k_cache, v_cache, table, lens_t, ds = _cache([900, 300], 128, 2, 128, "fp8", seed=4)
    q = _queries((2, 300, 8, 128), "fp8", seed=3)
    lean = gluon_lean_max_config("fp8", 128, 128)  # (its natural version: lean P on K relabelled, 128 keys)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens_t, page_table=table, config=lean, **ds)
    assert ran == [gluon_paged.natural_config(lean)] and ran[0].softmax == "lean" and ran[0].k_perm
    ref = attention_reference_paged(q, k_cache, v_cache, table, lens_t, **ds)
    assert rel_l2(out, ref) < OUT_BOUND["fp8"]
