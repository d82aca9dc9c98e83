"""GPU tests: flash_attn_with_kvcache over paged caches against float64 (pages out of order and
shared between sequences, stale NaN slots, page sizes 64 to 256, GQA 1/4/8, windows, LSE, packed
queries, pages apart in memory), the per-layout fast path, value checks of CUDA page tables, and
CUDA-graph capture."""

from __future__ import annotations

import pytest
import torch

from zyfa_tune import api, flash_attn_with_kvcache
from zyfa_tune.generator.defaults import default_config
from zyfa_tune.kvcache import paged_config
from zyfa_tune.tuning.reference import attention_reference_paged, rel_l2

pytestmark = pytest.mark.gpu

FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16
#: as tests/test_gpu_varlen.py: rel. L2 bounds of the output and abs. bounds of the LSE vs float64
OUT_BOUND = {"fp8": 0.05, "bf16": 0.01}
LSE_BOUND = {"fp8": 0.1, "bf16": 0.01}


def _cache(lens, page_size, hk, d, dtype: str, seed: int, shared: int = 0, interleaved: bool = False):
    """Caches with each sequence's pages at random places and every slot no sequence uses set to NaN
    (a kernel that let a stale slot through would give NaN). `shared`: sequence 1 starts with
    sequence 0's first `shared` pages (a common prefix). `interleaved`: K and V of a page side by
    side in one tensor (num_pages, 2, page_size, kv_heads, dim), so pages lie apart in memory.
    Returns (k_cache, v_cache, page_table, cache_seqlens, descales)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    counts = [-(-n // page_size) for n in lens]
    own = [c - (shared if i == 1 else 0) for i, c in enumerate(counts)]
    num_pages = sum(own) + 3  # and a few no sequence uses
    order = torch.randperm(num_pages, generator=g, device="cuda").tolist()
    max_pages = max(counts, default=1) + 2
    table = torch.full((len(lens), max_pages), 10**6, dtype=torch.int32)  # entries past the pages in use: never read
    for b, c in enumerate(own):
        if c:
            table[b, :c] = torch.tensor([order.pop() for _ in range(c)], dtype=torch.int32)
    if shared:
        assert min(lens[0], lens[1]) >= shared * page_size
        table[1, shared : counts[1]] = table[1, : own[1]].clone()
        table[1, :shared] = table[0, :shared]
    tdt = FP8 if dtype == "fp8" else BF16
    kv = torch.randn(num_pages, 2, page_size, hk, d, device="cuda", generator=g)
    in_use = torch.zeros(num_pages, page_size, dtype=torch.bool, device="cuda")
    for b, n in enumerate(lens):
        rows = torch.arange(n, device="cuda")
        in_use[table[b].cuda().long()[rows // page_size], rows % page_size] = True
    kv[~in_use[:, None].expand(-1, 2, -1)] = float("nan")
    kv = kv.to(tdt)
    k_cache, v_cache = (kv[:, 0], kv[:, 1]) if interleaved else (kv[:, 0].contiguous(), kv[:, 1].contiguous())
    descales = {}
    if dtype == "fp8":
        descales = {
            n: torch.rand(len(lens), hk, device="cuda", generator=g) + 0.5
            for n in ("q_descale", "k_descale", "v_descale")
        }
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    return k_cache, v_cache, table.cuda(), lens_t, descales


def _queries(shape, dtype: str, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, device="cuda", generator=g).to(FP8 if dtype == "fp8" else BF16)


def _check(q, cache, dtype, causal=True, window=(-1, -1), config=None, **packed):
    k_cache, v_cache, table, lens, descales = cache
    kw = dict(cache_seqlens=lens, page_table=table, causal=causal, window_size=window, **descales, **packed)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, return_lse=True, config=config, **kw)
    ref, ref_lse = attention_reference_paged(
        q, k_cache, v_cache, table, lens, cu_seqlens_q=packed.get("cu_seqlens_q"), causal=causal,
        window_size=window, return_lse=True, **descales,
    )  # fmt: skip
    assert out.shape == (*q.shape[:-1], v_cache.shape[-1]) and out.dtype == BF16
    assert lse.shape == ref_lse.shape and lse.dtype == torch.float32
    assert torch.isfinite(out).all(), "a stale (NaN) cache slot reached the output"
    assert rel_l2(out, ref) < OUT_BOUND[dtype], f"rel L2 {rel_l2(out, ref):.3e}"
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen), "LSE is -inf exactly where a row sees no key"
    if seen.any():
        err = (lse[seen].double() - ref_lse[seen]).abs().max().item()
        assert err < LSE_BOUND[dtype], f"LSE max abs err {err:.3e}"
    return out, lse


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
@pytest.mark.parametrize("page_size", [64, 128, 256])
@pytest.mark.parametrize("h,hk", [(8, 8), (8, 2), (8, 1)])  # GQA 1, 4, 8
def test_random_page_tables_match_float64(dtype, page_size, h, hk):
    """A chunk of 129 new queries per sequence over cached prefixes of odd lengths, pages out of
    order, sequence 1 sharing sequence 0's first page."""
    lens = [129, 1000, 2047, 130 + page_size]
    cache = _cache(lens, page_size, hk, 128, dtype, seed=page_size + h + hk, shared=1 if page_size <= 129 else 0)
    q = _queries((len(lens), 129, h, 128), dtype, seed=hk)
    _check(q, cache, dtype)


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
@pytest.mark.parametrize(
    "causal,window",
    [
        (True, (0, 0)),
        (True, (63, 0)),
        (True, (128, 0)),
        (True, (300, 0)),
        (False, (-1, -1)),
        (False, (50, 7)),
        (False, (-1, 3)),
        (False, (100, -1)),
    ],
)
def test_windows_and_non_causal(dtype, causal, window):
    lens = [300, 77, 1500]
    cache = _cache(lens, 128, 2, 128, dtype, seed=9, shared=0)
    q = _queries((3, 77, 8, 128), dtype, seed=10)
    _check(q, cache, dtype, causal, window)


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_packed_queries(dtype):
    """Sequences with 0, 1, 129 and 64 new queries, packed as flash_attn_varlen_func's."""
    lq, lens = [0, 1, 129, 64], [64, 700, 129, 1024]
    cache = _cache(lens, 64, 2, 128, dtype, seed=12, shared=1)
    q = _queries((sum(lq), 8, 128), dtype, seed=13)
    cu = torch.tensor([0, *torch.tensor(lq).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    _check(q, cache, dtype, cu_seqlens_q=cu, max_seqlen_q=max(lq))


@pytest.mark.parametrize("d", [64, 80, 96, 112, 256])
def test_other_head_dims_and_pages_apart_in_memory(d):
    """Head dims of one chunk (64, 256) read pages by TMA, the others by pointer (`pages_by_tma`)."""
    for dtype in ("fp8", "bf16"):
        lens = [600, 200]
        q = _queries((2, 200, 4, d), dtype, seed=d)
        _check(q, _cache(lens, 128, 2, d, dtype, seed=d), dtype)
        _check(q, _cache(lens, 128, 2, d, dtype, seed=d + 1, interleaved=True), dtype)  # pointer loads


def test_forced_configs():
    """A forced config runs as given where its key block fits a page (its natural-V twin where it
    reads V^T); the lean FP8 softmax too."""
    lens = [900, 300]
    q = _queries((2, 300, 8, 128), "fp8", seed=3)
    cache = _cache(lens, 128, 2, 128, "fp8", seed=4)
    fp8 = default_config("fp8", 128, 128)
    _check(q, cache, "fp8", config=paged_config(fp8, 128))
    _check(q, cache, "fp8", config=paged_config(fp8.replace(softmax="lean", rowsum="rounded"), 64))
    with pytest.raises(ValueError, match="^config: block_n=128 does not divide k_cache's page_size 64"):
        _check(q, _cache(lens, 64, 2, 128, "fp8", seed=4), "fp8", config=fp8)


def test_fast_path_equals_the_checked_path_bitwise(monkeypatch):
    monkeypatch.setattr(api, "_plans", {})
    monkeypatch.setattr(api, "_values_checked", set())
    k_cache, v_cache, table, lens, ds = _cache([700, 300, 1300], 128, 2, 128, "fp8", seed=21, shared=2)
    q = _queries((3, 300, 8, 128), "fp8", seed=22)
    kw = dict(window_size=(200, 0), return_lse=True)
    first = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, page_table=table, **ds, **kw)
    assert len(api._plans) == 1
    copies = [t.clone() for t in (q, k_cache, v_cache, table, lens)]
    second = flash_attn_with_kvcache(
        *copies[:3], cache_seqlens=copies[4], page_table=copies[3], **{n: d.clone() for n, d in ds.items()}, **kw
    )
    assert len(api._plans) == 1
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    assert second[0].data_ptr() != first[0].data_ptr()


def test_cuda_page_tables_are_read_on_the_first_call_and_with_validate(monkeypatch):
    monkeypatch.setattr(api, "_plans", {})
    monkeypatch.setattr(api, "_values_checked", set())
    k_cache, v_cache, table, lens, _ = _cache([300, 200], 64, 2, 64, "bf16", seed=2)
    q = _queries((2, 100, 4, 64), "bf16", seed=2)
    bad = table.clone()
    bad[1, 0] = k_cache.shape[0]
    with pytest.raises(ValueError, match=r"^page_table: entry \(1, 0\) = \d+ is out of range"):
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, page_table=bad)  # the first call reads
    flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, page_table=table)
    with pytest.raises(ValueError, match=r"^page_table: entry \(1, 0\)"):
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, page_table=bad, validate=True)
    short = torch.tensor([300, 99], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="^cache_seqlens: sequence 1 holds 99 keys, fewer than its 100 queries"):
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=short, page_table=table, validate=True)


def test_cuda_graph_capture_with_new_tables_and_lengths(monkeypatch):
    monkeypatch.setattr(api, "_plans", {})
    lens = [700, 300, 1300]
    static = list(_cache(lens, 128, 2, 128, "fp8", seed=31, shared=2))
    q = _queries((3, 300, 8, 128), "fp8", seed=32)

    def run(q, cache):
        k_cache, v_cache, table, lens_t, ds = cache
        return flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=lens_t, page_table=table, return_lse=True, **ds
        )

    run(q, static)  # the checked call: plan, compile, values
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = run(q, static)
    # other pages, table and lengths, the same page counts (so the same shapes: the captured layout)
    new = _cache([768, 300, 1281], 128, 2, 128, "fp8", seed=33, shared=2)
    new_q = _queries((3, 300, 8, 128), "fp8", seed=34)
    q.copy_(new_q)
    for s, n in zip(static[:4], new[:4]):
        s.copy_(n)
    for name, d in new[4].items():
        static[4][name].copy_(d)
    graph.replay()
    torch.cuda.synchronize()
    want, want_lse = run(new_q, new)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
