"""Paged KV caches on the CPU: argument checks of flash_attn_with_kvcache, what reaches the launcher
(the launch replaced by a recorder), the float64 paged reference against the contiguous one, and
the paged serving variant of the Triton kernel compiled for sm_90a.

GPU runs against float64 are in tests/test_gpu_paged.py."""

from __future__ import annotations

import contextlib

import pytest
import torch

import zyfa_tune.kvcache as kvcache
from zyfa_tune import api, attention_reference, attention_reference_paged, flash_attn_with_kvcache
from zyfa_tune.generator import HOPPER, emit
from zyfa_tune.generator.build import compile_for_target
from zyfa_tune.generator.defaults import default_config
from zyfa_tune.kernels import launch
from zyfa_tune.kernels.launch import Serving
from zyfa_tune.tuning.reference import attention_reference_varlen

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
CFG = default_config("bf16", 64, 64)  # block_n 128
GLUON = default_config("fp8", 128, 128, "gluon")


def paged(b=2, sq=5, h=4, hk=2, d=64, page_size=64, pages=6, max_pages=3, lens=(70, 5), dtype=BF16):
    """q (b, sq, h, d), caches of `pages` pages, a table holding pages in reverse order, and lengths."""
    q = torch.randn(b, sq, h, d).to(dtype)
    k_cache, v_cache = (torch.randn(pages, page_size, hk, d).to(dtype) for _ in range(2))
    table = torch.arange(pages - 1, pages - 1 - b * max_pages, -1, dtype=torch.int32).view(b, max_pages) % pages
    return q, k_cache, v_cache, dict(cache_seqlens=torch.tensor(lens, dtype=torch.int32), page_table=table)


def call(q, k_cache, v_cache, kw, **more):
    return flash_attn_with_kvcache(q, k_cache, v_cache, **kw, **more)


# ---- argument checks (CPU tensors reach every one; the device is checked last) ---------------------


def test_valid_arguments_reach_the_device_check():
    with pytest.raises(ValueError, match="^q: tensor is on cpu"):
        call(*paged())


def _table(t):
    return dict(page_table=t)


@pytest.mark.parametrize(
    "change,exc,match",
    [
        (dict(page_table=torch.zeros(2, 3, dtype=torch.int64)), TypeError, "page_table: expected dtype torch.int32"),
        (dict(page_table=torch.zeros(3, 3, dtype=torch.int32)), ValueError, r"page_table: expected shape \(batch, "),
        (dict(page_table=torch.zeros(6, dtype=torch.int32)), ValueError, r"page_table: expected shape"),
        (dict(page_table=[[0, 1, 2]]), TypeError, "page_table: expected an int32 torch.Tensor"),
        (
            dict(page_table=torch.tensor([[0, 6, 1], [2, 3, 4]], dtype=torch.int32)),
            ValueError,
            r"page_table: entry \(0, 1\) = 6 is out of range for k_cache's 6 pages",
        ),
        (
            dict(page_table=torch.tensor([[0, 1, 2], [-1, 3, 4]], dtype=torch.int32)),
            ValueError,
            r"page_table: entry \(1, 0\) = -1 is out of range",
        ),
        (dict(cache_seqlens=torch.tensor([70, 5])), TypeError, "cache_seqlens: expected dtype torch.int32"),
        (dict(cache_seqlens=torch.tensor([70], dtype=torch.int32)), ValueError, r"cache_seqlens: expected shape"),
        (
            dict(cache_seqlens=torch.tensor([193, 5], dtype=torch.int32)),
            ValueError,
            r"cache_seqlens: sequence 0 holds 193 keys, more than page_table's max_pages x page_size = 3 x 64",
        ),
        (
            dict(cache_seqlens=torch.tensor([70, 4], dtype=torch.int32)),
            ValueError,
            r"cache_seqlens: sequence 1 holds 4 keys, fewer than its 5 queries",
        ),
        (dict(max_seqlen_q=5), ValueError, "max_seqlen_q: given .* without cu_seqlens_q"),
    ],
)
def test_bad_page_tables_and_cache_lengths_are_named(change, exc, match):
    q, k_cache, v_cache, kw = paged()
    with pytest.raises(exc, match=f"^{match}"):
        call(q, k_cache, v_cache, {**kw, **change})


def test_only_the_pages_in_use_are_checked():
    q, k_cache, v_cache, kw = paged()
    kw["page_table"][1, 1:] = 99  # sequence 1's 5 keys use one page: the rest of its row is never read
    with pytest.raises(ValueError, match="^q: tensor is on cpu"):
        call(q, k_cache, v_cache, kw)


def test_caches_are_checked_against_q_and_each_other():
    q, k_cache, v_cache, kw = paged()
    with pytest.raises(ValueError, match=r"^v_cache: shape \(5, 64, 2, 64\) must match k_cache's"):
        call(q, k_cache, v_cache[1:], kw)
    with pytest.raises(TypeError, match=r"^k_cache: dtype torch.float8_e4m3fn differs from q's torch.bfloat16"):
        call(q, k_cache.to(FP8), v_cache, kw)
    with pytest.raises(ValueError, match=r"^k_cache: expected 4 dims \(num_pages, page_size, kv_heads, head_dim\)"):
        call(q, k_cache[0], v_cache, kw)
    with pytest.raises(ValueError, match="^k_cache: kv_heads=3 must divide q's heads=4"):
        call(q, torch.randn(6, 64, 3, 64).to(BF16), torch.randn(6, 64, 3, 64).to(BF16), kw)
    with pytest.raises(ValueError, match=r"^v_cache: the last dim must be contiguous"):
        call(q, k_cache, v_cache.transpose(1, 3).contiguous().transpose(1, 3), kw)


def test_page_sizes_hold_whole_key_blocks():
    q, _, _, kw = paged()
    small = torch.randn(20, 16, 2, 64).to(BF16)
    with pytest.raises(ValueError, match="^k_cache: page_size 16 must be a multiple of 32"):
        call(q, small, small, kw)
    q, k_cache, v_cache, kw = paged()  # 64-key pages
    with pytest.raises(ValueError, match="^config: block_n=128 does not divide k_cache's page_size 64"):
        call(q, k_cache, v_cache, kw, config=CFG)


def test_appending_keys_and_gluon_configs_the_twin_cannot_run_are_refused():
    q, k_cache, v_cache, kw = paged()
    with pytest.raises(ValueError, match="^k: appending new keys and values is not supported"):
        flash_attn_with_kvcache(q, k_cache, v_cache, k_cache[:2], **kw)
    q8, k8, v8, kw = paged(d=128, dtype=FP8)
    with pytest.raises(ValueError, match="^config: block_n=128 does not divide k_cache's page_size 64"):
        call(q8, k8, v8, kw, config=GLUON)  # (its natural-V version, on the Gluon paged twin)
    q8, k8, v8, kw = paged(d=128, dtype=FP8, page_size=128)
    apart = torch.zeros(6, 2, 128, 2, 128, dtype=FP8)[:, 0]
    with pytest.raises(ValueError, match="^config: backend='gluon' reads pages by TMA"):
        call(q8, apart, v8, kw, config=GLUON)
    with pytest.raises(ValueError, match="^config: head dims 192/128 are read in several chunks"):
        q9 = torch.zeros(2, 5, 4, 192, dtype=FP8)
        call(q9, torch.zeros(6, 128, 2, 192, dtype=FP8), v8, kw, config=default_config("fp8", 192, 128, "gluon"))
    with pytest.raises(ValueError, match=r"^k_descale: expected shape \(batch, kv_heads\) = \(2, 2\)"):
        call(q8, k8, v8, kw, k_descale=torch.ones(3, 2))


def test_packed_queries_are_checked_as_the_varlen_call_s():
    q, k_cache, v_cache, kw = paged()
    packed = q.flatten(0, 1)[:7]
    cu = torch.tensor([0, 5, 7], dtype=torch.int32)
    with pytest.raises(ValueError, match="^q: tensor is on cpu"):
        call(packed, k_cache, v_cache, kw, cu_seqlens_q=cu, max_seqlen_q=5)
    with pytest.raises(TypeError, match="^max_seqlen_q: expected an int >= 0, got None"):
        call(packed, k_cache, v_cache, kw, cu_seqlens_q=cu)
    with pytest.raises(ValueError, match="^cu_seqlens_q: ends at 6, but q holds 7 tokens"):
        call(packed, k_cache, v_cache, kw, cu_seqlens_q=torch.tensor([0, 5, 6], dtype=torch.int32), max_seqlen_q=5)
    kw["cache_seqlens"][1] = 1
    with pytest.raises(ValueError, match="^cache_seqlens: sequence 1 holds 1 keys, fewer than its 2 queries"):
        call(packed, k_cache, v_cache, kw, cu_seqlens_q=cu, max_seqlen_q=5)


# ---- what reaches the launcher ------------------------------------------------------------------


class Recorder:
    """Stands in for `launch.bind` and the BoundLaunch it returns, recording both."""

    def __init__(self):
        self.checked: list[dict] = []
        self.fast: list[tuple] = []

    def bind(self, config, q, k, v, out, scale, causal, qd, kd, vd, serving=None):
        self.checked.append(dict(config=config, q=q, k=k, out=out, causal=causal, serving=serving))
        return self.launch

    def launch(self, q, k, v, out, qd, kd, vd, extra=()):
        self.fast.append((q, k, v, out, extra))
        return out


class Fixed:
    def __init__(self, config):
        self.config = config

    def config_for(self, *args):
        return self.config


@pytest.fixture
def rec(monkeypatch):
    r = Recorder()
    monkeypatch.setattr(api, "_on_cuda", lambda name, t: None)  # CPU tensors stand in for CUDA ones
    monkeypatch.setattr(kvcache, "bind", r.bind)
    monkeypatch.setattr(api.torch.cuda, "current_device", lambda: None)
    monkeypatch.setattr(api.torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(api, "_plans", {})
    monkeypatch.setattr(api, "_values_checked", set())
    return r


def test_the_launch_gets_the_caches_and_a_config_whose_blocks_fit_a_page(rec, monkeypatch):
    fp8 = default_config("fp8", 128, 128)  # a V^T reader on 128-key blocks
    assert fp8.v_layout == "transposed" and fp8.block_n == 128
    monkeypatch.setattr(api.dispatch, "dispatcher", lambda: Fixed(fp8))
    q, k_cache, v_cache, kw = paged(d=128, dtype=FP8)  # 64-key pages
    out, lse = call(q, k_cache, v_cache, kw, return_lse=True, window_size=(100, 0))
    (first,) = rec.checked
    s = first["serving"]
    assert first["config"] == fp8.replace(v_layout="natural", block_n=64)
    assert first["q"] is q and first["k"] is k_cache and first["out"] is out and first["causal"] is False
    assert s.page_table is kw["page_table"] and s.cache_seqlens is kw["cache_seqlens"] and s.cu_seqlens_q is None
    assert s.window == (100, 0) and s.lse is lse and lse.shape == (2, 4, 5) and out.shape == (2, 5, 4, 128)


def test_second_call_takes_the_fast_path_with_the_new_table_and_lengths(rec):
    q, k_cache, v_cache, kw = paged(page_size=128)
    call(q, k_cache, v_cache, kw, config=CFG)
    kw2 = dict(cache_seqlens=torch.tensor([9, 200], dtype=torch.int32), page_table=kw["page_table"].flip(0).clone())
    out = call(q, k_cache, v_cache, kw2, config=CFG)
    assert len(rec.checked) == 1 and len(rec.fast) == 1
    fq, fk, fv, fout, extra = rec.fast[0]
    assert fq is q and fk is k_cache and fout is out
    assert extra == (None, None, None, kw2["page_table"], kw2["cache_seqlens"])


def test_packed_queries_reach_the_kernel_as_one_batch_entry(rec):
    q, k_cache, v_cache, kw = paged(page_size=128)
    packed, cu = q.flatten(0, 1)[:7], torch.tensor([0, 5, 7], dtype=torch.int32)
    out, lse = call(packed, k_cache, v_cache, kw, cu_seqlens_q=cu, max_seqlen_q=5, config=CFG, return_lse=True)
    s = rec.checked[0]["serving"]
    assert rec.checked[0]["q"].shape == (1, 7, 4, 64) and s.cu_seqlens_q is cu and s.max_seqlen_q == 5
    assert out.shape == (7, 4, 64) and lse.shape == (4, 7)


def test_pages_apart_in_memory_are_read_with_pointer_loads(rec, monkeypatch):
    monkeypatch.setattr(api.dispatch, "dispatcher", lambda: Fixed(CFG))
    q, _, _, kw = paged(page_size=128)
    kv = torch.randn(6, 2, 128, 2, 64).to(BF16)  # K and V interleaved per page
    call(q, kv[:, 0], kv[:, 1], kw)
    chosen = rec.checked[0]["config"]
    assert chosen.loads == "pointer" and chosen.block_n == 32 and chosen.v_layout == "natural"
    call(q, *paged(page_size=128)[1:3], kw)
    assert rec.checked[1]["config"] == CFG  # dense pages: the TMA config as chosen


@pytest.mark.parametrize("dqk, dv", [(80, 80), (96, 96), (112, 112), (192, 128), (160, 160)])
def test_head_dims_of_several_chunks_read_pages_by_pointer(dqk, dv):
    """TMA reads pages only where Q/K and V are one head-dim chunk each (`pages_by_tma`); other
    head dims' paged configs load by pointer, whatever the dispatcher chose."""
    for dtype in ("fp8", "bf16"):
        picked = default_config(dtype, dqk, dv)
        assert picked.loads == "tma" and not launch.pages_by_tma(picked)
        chosen = kvcache.paged_config(api.serving_config(picked), 128)
        assert chosen.loads == "pointer" and chosen.v_layout == "natural" and 128 % chosen.block_n == 0
    for d in (64, 128, 256):
        chosen = kvcache.paged_config(default_config("bf16", d, d), 128)
        assert launch.pages_by_tma(chosen) and chosen.loads == "tma"


def test_prepare_places_the_page_table_and_refuses_what_the_kernel_cannot_read():
    cfg = default_config("bf16", 64, 64).replace(block_n=64)
    q, k_cache, v_cache, kw = paged()
    out = torch.empty(2, 5, 4, 64, dtype=BF16)
    s = Serving(page_table=kw["page_table"], cache_seqlens=kw["cache_seqlens"])
    grid, args, options = launch.prepare(cfg, q, k_cache, v_cache, out, 0.1, True, serving=s)
    n_desc = 3
    assert grid == (1 * 2 * 4,)  # ceil(5 / 128) query blocks x 2 sequences x 4 heads
    assert args[n_desc + 7] is kw["page_table"] and args[n_desc + 8] is kw["cache_seqlens"]
    assert args[-1] == kw["page_table"].stride(0) and options["PAGED"] is True and options["VARLEN"] is False
    with pytest.raises(ValueError, match="^k_cache: page_size 64 is not a multiple of config's block_n 128"):
        launch.prepare(CFG, q, k_cache, v_cache, out, 0.1, True, serving=s)
    with pytest.raises(ValueError, match="^config: a paged KV cache is read with v_layout='natural'"):
        launch.prepare(cfg.replace(dtype="fp8", v_layout="transposed"), q, k_cache, v_cache, out, 0.1, True, serving=s)
    q80, k80, v80 = (torch.zeros(*t.shape[:-1], 80, dtype=BF16) for t in (q, k_cache, v_cache))
    tma80 = default_config("bf16", 80, 80).replace(block_n=64, v_layout="natural")
    with pytest.raises(ValueError, match="^config: a paged KV cache at head dims 80/80 is read with loads='pointer'"):
        launch.prepare(tma80, q80, k80, v80, torch.empty_like(q80), 0.1, True, serving=s)


def test_paged_from_packed_holds_the_packed_keys_on_shuffled_pages():
    """The cache a benchmark builds from packed K/V: every sequence on its own pages, shuffled, so that the
    paged reference equals the packed one; e4m3 caches too (copied as bytes)."""
    lens = [5, 64, 1, 130]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(sum(lens), 4, 64, generator=g).to(BF16)
    k = torch.randn(sum(lens), 2, 64, generator=g).to(BF16)
    v = torch.randn(sum(lens), 2, 32, generator=g).to(BF16)
    k_cache, v_cache, table, cache_lens = kvcache.paged_from_packed(k, v, lens, 32, g)
    assert k_cache.shape == (9, 32, 2, 64) and v_cache.shape == (9, 32, 2, 32)  # 1 + 2 + 1 + 5 pages
    assert table.dtype == cache_lens.dtype == torch.int32 and cache_lens.tolist() == lens
    used = [p for b, n in enumerate(lens) for p in table[b, : -(-n // 32)].tolist()]
    assert sorted(used) == list(range(9)) and used != sorted(used)  # each page once, not in order
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    got = attention_reference_paged(q, k_cache, v_cache, table, cache_lens, cu_seqlens_q=cu)
    assert torch.equal(got, attention_reference_varlen(q, k, v, cu, cu))
    k8, v8 = k.to(FP8), v.to(FP8)
    k8_cache, _, in_order, _ = kvcache.paged_from_packed(k8, v8, lens, 64)
    assert k8_cache.dtype == FP8 and in_order[3].tolist() == [3, 4, 5]
    assert torch.equal(k8_cache.flatten(0, 1)[3 * 64 : 3 * 64 + 130].view(torch.uint8), k8[70:].view(torch.uint8))
    empty = kvcache.paged_from_packed(k[:0], v[:0], [0, 0], 32)  # one zero page, no sequence on it
    assert empty[0].shape == (1, 32, 2, 64) and empty[3].tolist() == [0, 0]
    with pytest.raises(ValueError, match="^page_size: expected a positive multiple of 32, got 48"):
        kvcache.paged_from_packed(k, v, lens, 48)
    with pytest.raises(ValueError, match="^lengths: sum to 199"):
        kvcache.paged_from_packed(k, v, [5, 64, 130], 32)


# ---- the float64 paged reference ------------------------------------------------------------------


def _contiguous(k_cache, v_cache, table, lens, b):
    """Sequence b's keys and values as (1, lens[b], kv_heads, dim), read page by page."""
    ps = k_cache.shape[1]
    rows = [p * ps + i for p in table[b].tolist() for i in range(ps)][: int(lens[b])]
    return k_cache.flatten(0, 1)[rows][None], v_cache.flatten(0, 1)[rows][None]


def test_pages_in_order_equal_the_contiguous_reference():
    b, sk, sq, hk, d, ps = 2, 256, 40, 2, 32, 64
    k, v = torch.randn(b, sk, hk, d), torch.randn(b, sk, hk, d)
    q = torch.randn(b, sq, 4, d)
    table = torch.arange(b * sk // ps, dtype=torch.int32).view(b, -1)
    lens = torch.full((b,), sk, dtype=torch.int32)
    got, lse = attention_reference_paged(q, k.view(-1, ps, hk, d), v.view(-1, ps, hk, d), table, lens, return_lse=True)
    want, want_lse = attention_reference(q, k, v, return_lse=True)
    assert torch.equal(got, want) and torch.equal(lse, want_lse)


def test_pages_out_of_order_and_shared_between_sequences():
    ps, hk, d = 32, 2, 16
    k_cache, v_cache = torch.randn(9, ps, hk, d), torch.randn(9, ps, hk, d)
    table = torch.tensor([[7, 2, 5, 0], [7, 2, 8, 8], [4, 1, 3, 6]], dtype=torch.int32)  # a shared prefix
    lens = torch.tensor([100, 70, 128], dtype=torch.int32)
    q = torch.randn(3, 6, 4, d)
    qd, kd, vd = (torch.rand(3, hk) + 0.5 for _ in range(3))
    opts = dict(causal=True, window_size=(50, 0), return_lse=True)
    got, lse = attention_reference_paged(
        q, k_cache, v_cache, table, lens, q_descale=qd, k_descale=kd, v_descale=vd, **opts
    )
    for b in range(3):
        k, v = _contiguous(k_cache, v_cache, table, lens, b)
        ds = dict(q_descale=qd[b : b + 1], k_descale=kd[b : b + 1], v_descale=vd[b : b + 1])
        want, want_lse = attention_reference(q[b : b + 1], k, v, **ds, **opts)
        assert torch.allclose(got[b : b + 1], want, rtol=0, atol=1e-12)
        assert torch.allclose(lse[b : b + 1], want_lse, rtol=0, atol=1e-12)
    assert not torch.allclose(got[0, :, :, :], got[1, :, :, :])  # the shared prefix, different keys after it


def test_packed_queries_in_the_paged_reference():
    ps, hk, d = 32, 1, 16
    k_cache, v_cache = torch.randn(4, ps, hk, d), torch.randn(4, ps, hk, d)
    table = torch.tensor([[3, 1], [0, 2]], dtype=torch.int32)
    lens = torch.tensor([40, 9], dtype=torch.int32)
    q, cu = torch.randn(12, 2, d), torch.tensor([0, 3, 12], dtype=torch.int32)
    got = attention_reference_paged(q, k_cache, v_cache, table, lens, cu_seqlens_q=cu)
    keys = [_contiguous(k_cache, v_cache, table, lens, b) for b in range(2)]
    k, v = torch.cat([kv[0][0] for kv in keys]), torch.cat([kv[1][0] for kv in keys])
    want = attention_reference_varlen(q, k, v, cu, torch.tensor([0, 40, 49], dtype=torch.int32))
    assert torch.equal(got, want)


# ---- the paged serving variant compiles ------------------------------------------------------------

PAGED = {"PAGED": True}
ALL = {"PAGED": True, "WINDOW": True, "RETURN_LSE": True}


@pytest.mark.parametrize(
    "name,cfg,flags",
    [
        ("fp8-128", kvcache.paged_config(default_config("fp8", 128, 128), 128), PAGED),
        ("fp8-128-all", kvcache.paged_config(default_config("fp8", 128, 128), 64), ALL),
        ("fp8-128-packed", kvcache.paged_config(default_config("fp8", 128, 128), 256), {**PAGED, "VARLEN": True}),
        ("fp8-256", kvcache.paged_config(default_config("fp8", 256, 256), 64), ALL),
        ("fp8-40-pointer", kvcache.paged_config(api.serving_config(default_config("fp8", 40, 40)), 64), ALL),
        ("bf16-128", kvcache.paged_config(default_config("bf16", 128, 128), 128), ALL),
    ],
)
def test_paged_variant_compiles_clean_for_sm90a(name, cfg, flags):
    """No spills, within shared memory, and the dtype's MMA (QGMMA for FP8, HGMMA for bf16)."""
    assert cfg.v_layout == "natural"
    art = compile_for_target(emit(cfg, serving=True), causal=not flags.get("WINDOW"), serving=flags)
    assert art.spill_bytes == 0, f"{name}: {art.spill_bytes} bytes spilled"
    assert art.shared_bytes <= HOPPER.shared_memory_bytes
    fp8 = cfg.dtype == "fp8"
    assert art.count("QGMMA" if fp8 else "HGMMA") > 0 and art.count("HGMMA" if fp8 else "QGMMA") == 0
