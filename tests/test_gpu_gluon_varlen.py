"""GPU tests: packed sequences on the Gluon backend's varlen variant against float64 (random packings with
lengths 0, 1, odd and block edges, up to 32K tokens, GQA 1/4/8, exact and lean configs, every head-dim
pair, a study seed of each schedule shape, its LSE twin), its tile table (the one-program kernel bitwise, at its size
limit, in a captured graph) and V^T copy against their references, the fast path against the checked
path, and CUDA-graph capture with the lengths changed between replays."""

from __future__ import annotations

import pytest
import torch
from test_gpu_varlen import EXACT_LSE_BOUND
from test_gpu_varlen import LSE_BOUND as LSE_BOUNDS

from zyfa_tune import api, flash_attn_varlen_func
from zyfa_tune.generator.defaults import default_config
from zyfa_tune.kernels import gluon_varlen
from zyfa_tune.search_spaces import get_space
from zyfa_tune.search_spaces.seeds import gluon_lean_max_config
from zyfa_tune.tuning.reference import attention_reference_varlen, rel_l2
from zyfa_tune.tuning.warm_start import study_seeds
from zyfa_tune.varlen import packed_twin

pytestmark = pytest.mark.gpu

FP8 = torch.float8_e4m3fn
#: rel. L2 bound of the output vs float64 on the same FP8 codes (a lean softmax's, as tests/test_gpu_varlen.py)
OUT_BOUND = 0.05
#: abs. bound of the natural-log LSE (tests/test_gpu_varlen.py's: lean P's codes overestimate 2^x by up to 6 %),
#: and of an exact softmax's with float32 row sums (its only errors are float32 scores and sums)
#: lengths 0 and 1, odd ones, block edges (64, 128, 192, 256) and a few thousand
LENGTHS = [0, 1, 2, 63, 64, 65, 127, 128, 129, 191, 257, 333, 1000, 2047, 3001]
EXACT = default_config("fp8", 128, 128, "gluon")
LEAN = gluon_lean_max_config("fp8", 128, 128)


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


def _lengths(n: int, seed: int, same: bool) -> tuple[list[int], list[int]]:
    g = torch.Generator().manual_seed(seed)
    pick = lambda: [LENGTHS[int(i)] for i in torch.randint(len(LENGTHS), (n,), generator=g)]  # noqa: E731
    lq = pick()
    return lq, (list(lq) if same else pick())


def _packed(lq, lk, h, hk, dqk, dv, seed: int):
    """FP8 codes of N(0, 1) q, k, v on the GPU and descales in [0.5, 1.5] per (sequence, kv head)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(sum(lq), h, dqk, device="cuda", generator=g).to(FP8)
    k = torch.randn(sum(lk), hk, dqk, device="cuda", generator=g).to(FP8)
    v = torch.randn(sum(lk), hk, dv, device="cuda", generator=g).to(FP8)
    kw = {n: torch.rand(len(lq), hk, device="cuda", generator=g) + 0.5 for n in ("q_descale", "k_descale", "v_descale")}
    return (q, k, v, _cu(lq), _cu(lk), max(lq, default=0), max(lk, default=0)), kw


def _check(args, kw, config, causal):
    """The Gluon varlen launch ran (a PackedLaunch plan) and matches float64; rows that see no key are zeros."""
    api._plans.clear()
    out = flash_attn_varlen_func(*args, causal=causal, config=config, **kw)
    assert any(isinstance(p.launch, gluon_varlen.PackedLaunch) for p in api._plans.values())
    q, k, v, cq, ck = args[:5]
    ref = attention_reference_varlen(q, k, v, cq, ck, causal=causal, **kw)
    assert out.shape == (q.shape[0], q.shape[1], v.shape[2]) and torch.isfinite(out).all()
    assert rel_l2(out, ref) < OUT_BOUND, f"rel L2 {rel_l2(out, ref):.3e}"
    assert (out[ref.abs().amax(-1) == 0] == 0).all(), "rows that see no key (or attend to zeros) are zeros"
    return out


@pytest.mark.parametrize("config", [EXACT, LEAN], ids=["exact", "lean"])
@pytest.mark.parametrize("h,hk", [(8, 8), (8, 2), (8, 1)])  # GQA 1, 4, 8
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("same", [True, False], ids=["same-lengths", "other-key-lengths"])
def test_random_packings_match_float64(config, h, hk, causal, same):
    lq, lk = _lengths(12, seed=h * 10 + hk + 2 * causal + same, same=same)
    args, kw = _packed(lq, lk, h, hk, 128, 128, seed=7)
    _check(args, kw, config, causal)


def _seed_variety() -> list:
    """One Gluon study seed (as packed_twin runs it) per schedule shape the varlen branches meet, at hd64,
    hd128 and hd256: 192-row blocks (three consumers, 64-row Q boxes), no ping-pong (rows past a
    sequence's end skipped), the output through the P tiles, PV deferred, natural V, f16 scores."""
    out, seen = [], set()
    for d in (64, 128, 256):
        for c in study_seeds(get_space("fp8"), d, d, loose=True):
            c = packed_twin(c)
            shape = (c.block_m, c.block_n, c.ping_pong, c.o_through_p, c.o_split, c.pv_defer, c.v_layout, c.qk_acc)
            if c.backend == "gluon" and (d, shape) not in seen:
                seen.add((d, shape))
                out.append(pytest.param(c, id=f"hd{d}-" + "-".join(map(str, shape))))
    return out


@pytest.mark.parametrize("config", _seed_variety())
def test_study_seeds_of_every_schedule_shape_match_float64(config):
    """The seeds a packed-sequence study enqueues first, on one packing with GQA and other key lengths: a
    schedule shape whose varlen branch is wrong fails here, not as a silently rejected trial."""
    d = config.head_dim_qk
    lq, lk = _lengths(12, seed=d, same=False)
    args, kw = _packed(lq, lk, 8, 2, d, config.head_dim_v, seed=d)
    _check(args, kw, config, causal=True)


@pytest.mark.parametrize("dqk,dv", [(64, 64), (256, 256), (192, 128)])
@pytest.mark.parametrize("causal", [True, False])
def test_other_head_dims(dqk, dv, causal):
    lq, lk = _lengths(9, seed=dqk + dv, same=False)
    args, kw = _packed(lq, lk, 4, 2, dqk, dv, seed=8)
    _check(args, kw, default_config("fp8", dqk, dv, "gluon"), causal)


@pytest.mark.parametrize("config", [EXACT, LEAN], ids=["exact", "lean"])
def test_32k_tokens_of_long_and_short_sequences(config):
    lq = [8192, 1, 7777, 0, 4096, 8191, 3, 4507]  # 32767 tokens
    args, kw = _packed(lq, lq, 4, 1, 128, 128, seed=9)
    _check(args, kw, config, causal=True)


@pytest.mark.parametrize(
    "lq,h,hk",
    [([6000, 3000, 1, 777], 8, 8), ([20000, 1, 4095], 8, 8), ([20000, 1, 4095], 8, 2)],
    ids=["groups-of-3-3-2-heads", "one-head-groups", "gqa4-two-groups"],
)
@pytest.mark.parametrize("causal", [True, False])
def test_head_groups_of_long_batches(lq, h, hk, causal):
    """Packed batches long enough that the varlen loop runs the heads in L2 groups (8 MiB: 32768 keys of
    K and V at hd128 over the batch's total keys: 3 heads a group at 9778 keys, the last group 2; one at
    24096; one GQA group of 4): every (sequence, head, query block) tile is still computed once."""
    args, kw = _packed(lq, lq, h, hk, 128, 128, seed=11)
    _check(args, kw, EXACT.replace(l2_group_mib=8), causal)


def test_natural_v_config_and_a_keys_fastest_v():
    lq, lk = _lengths(10, seed=11, same=False)
    args, kw = _packed(lq, lk, 8, 2, 128, 128, seed=11)
    _check(args, kw, EXACT.replace(v_layout="natural", v_permute=False), True)
    v = args[2]
    v_kmajor = v.permute(1, 2, 0).contiguous().permute(2, 0, 1)  # (total_k, hk, d), keys fastest
    out = flash_attn_varlen_func(*args[:2], v_kmajor, *args[3:], config=EXACT, **kw)
    assert torch.equal(out, flash_attn_varlen_func(*args, config=EXACT, **kw))


@pytest.mark.parametrize("config", [EXACT, LEAN], ids=["exact", "lean"])
@pytest.mark.parametrize("causal", [True, False])
def test_lse_twin_matches_float64_and_leaves_the_output_as_it_is(monkeypatch, config, causal):
    """Sequences of 0 and 1 queries, odd lengths, more queries than keys (causal: rows that see no key, -inf)
    and no keys; the LSE twin's output equals the kernel's bitwise, and the fast path gives a fresh LSE."""
    monkeypatch.setattr(api, "_plans", {})
    lq, lk = [0, 1, 333, 129, 1000, 7, 2047, 64], [5, 1, 100, 129, 1201, 0, 2047, 63]
    args, kw = _packed(lq, lk, 8, 2, 128, 128, seed=41)
    out, lse = flash_attn_varlen_func(*args, causal=causal, config=config, return_lse=True, **kw)
    (plan,) = api._plans.values()
    assert isinstance(plan.launch, gluon_varlen.PackedLaunch) and plan.launch.lse_shape == (8, sum(lq))
    q, k, v, cq, ck = args[:5]
    ref, ref_lse = attention_reference_varlen(q, k, v, cq, ck, causal=causal, return_lse=True, **kw)
    assert lse.shape == (8, sum(lq)) and lse.dtype == torch.float32 and rel_l2(out, ref) < OUT_BOUND
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen) and (lse[~seen] == float("-inf")).all()
    err = (lse[seen].double() - ref_lse[seen]).abs().max().item()
    assert err < (EXACT_LSE_BOUND if config.softmax == "exact" and config.rowsum == "fp32" else LSE_BOUNDS["fp8"]), err
    assert torch.equal(out, flash_attn_varlen_func(*args, causal=causal, config=config, **kw))
    again, lse2 = flash_attn_varlen_func(*args, causal=causal, config=config, return_lse=True, **kw)
    assert torch.equal(again, out) and torch.equal(lse2, lse) and lse2.data_ptr() != lse.data_ptr()


@pytest.mark.parametrize("permute", [False, True])
def test_packed_vt_matches_its_reference(permute):
    lk = [0, 1, 31, 32, 33, 500, 0, 7]
    v = torch.randn(sum(lk), 2, 128, device="cuda").to(FP8)
    cu = _cu(lk)
    size = 2 * 128 * gluon_varlen.vt_columns(sum(lk), len(lk))
    poison = torch.full((size,), 0x7F, dtype=torch.uint8, device="cuda")  # e4m3 NaNs in the block it reuses
    del poison
    got = gluon_varlen.packed_vt(v, cu, gluon_varlen.vt_starts(cu), permute)
    assert torch.equal(got.view(torch.uint8), gluon_varlen.packed_vt_reference(v, cu, permute).view(torch.uint8))


def test_ragged_tiles_on_the_gpu_equal_the_host_s():
    lq, lk = _lengths(20, seed=12, same=False)
    for causal in (True, False):
        dev = gluon_varlen.ragged_tiles(_cu(lq), _cu(lk), max(lq), 128, 128, causal)
        host = gluon_varlen.ragged_tiles(_cu(lq).cpu(), _cu(lk).cpu(), max(lq), 128, 128, causal)
        assert torch.equal(dev.cpu(), host)


@pytest.mark.parametrize("n", [1, 5, 40, 300, 1000])
@pytest.mark.parametrize("causal", [True, False])
def test_tile_table_kernel_equals_the_torch_construction_bitwise(n, causal):
    """Random packings from one sequence to MAX_SORTED_TILES entries and past it (the torch path), block
    shapes of every head dim, lengths 0 and 1 among them; the reference run on the same device."""
    g = torch.Generator().manual_seed(n + causal)
    for bm, bn in ((64, 128), (128, 128), (128, 64)):
        lq = [LENGTHS[int(i)] for i in torch.randint(len(LENGTHS), (n,), generator=g)]
        lk = [a + int(x) for a, x in zip(lq, torch.randint(0, 200, (n,), generator=g))]
        args = (_cu(lq), _cu(lk), max(lq), bm, bn, causal)
        got = gluon_varlen.ragged_tiles(*args)
        assert torch.equal(got, gluon_varlen.ragged_tiles_reference(*args)), (bm, bn)
    tiles = n * gluon_varlen.query_blocks(max(lq), bm)
    assert n < 1000 or tiles > gluon_varlen.MAX_SORTED_TILES  # (the largest packing takes the torch path)


def test_tile_table_kernel_at_its_limit_and_in_a_captured_graph():
    """MAX_SORTED_TILES entries exactly (the widest sort), captured in a CUDA graph and replayed on new
    lengths: the table follows the lengths in the captured buffers."""
    n = gluon_varlen.MAX_SORTED_TILES // 32  # 32 query blocks of 128 rows each at most
    g = torch.Generator().manual_seed(3)
    lq = torch.randint(0, 4097, (n,), generator=g).tolist()
    lq[0] = 4096
    cq, ck = _cu(lq), _cu([a + 7 for a in lq])
    assert torch.equal(
        gluon_varlen.ragged_tiles(cq, ck, 4096, 128, 128, True),
        gluon_varlen.ragged_tiles_reference(cq, ck, 4096, 128, 128, True),
    )
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        table = gluon_varlen.ragged_tiles(cq, ck, 4096, 128, 128, True)
    lq2 = torch.randint(0, 4097, (n,), generator=g).tolist()
    cq.copy_(_cu(lq2))
    ck.copy_(_cu(lq2[::-1]))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(table, gluon_varlen.ragged_tiles_reference(cq, ck, 4096, 128, 128, True))


def test_fast_path_equals_the_checked_path_bitwise(monkeypatch):
    monkeypatch.setattr(api, "_plans", {})
    monkeypatch.setattr(api, "_values_checked", set())
    lq, lk = _lengths(10, seed=21, same=False)
    args, kw = _packed(lq, lk, 8, 2, 128, 128, seed=21)
    first = flash_attn_varlen_func(*args, config=EXACT, **kw)
    (plan,) = api._plans.values()
    assert isinstance(plan.launch, gluon_varlen.PackedLaunch)
    copies = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    second = flash_attn_varlen_func(*copies, config=EXACT, **{n: d.clone() for n, d in kw.items()})
    assert len(api._plans) == 1 and torch.equal(first, second) and second.data_ptr() != first.data_ptr()


@pytest.mark.parametrize("config", [EXACT, LEAN], ids=["exact", "lean"])
def test_cuda_graph_capture_replays_new_lengths(monkeypatch, config):
    """The tile table and V^T copy are rebuilt from the lengths in the captured buffers at each replay."""
    monkeypatch.setattr(api, "_plans", {})
    lq, lk = [700, 1, 300, 0, 1047], [900, 5, 300, 0, 843]
    args, kw = _packed(lq, lk, 8, 2, 128, 128, seed=31)
    static = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    flash_attn_varlen_func(*static, config=config, **kw)  # the checked call: plan, compile, values
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attn_varlen_func(*static, config=config, **kw)
    lq2, lk2 = [1, 1047, 0, 1000, 0], [148, 899, 1, 900, 100]  # same totals, within the maxima
    new, _ = _packed(lq2, lk2, 8, 2, 128, 128, seed=32)
    for s, n in zip(static[:5], new[:5]):
        s.copy_(n)
    graph.replay()
    torch.cuda.synchronize()
    want = flash_attn_varlen_func(*new, config=config, **kw)
    assert torch.equal(out, want)
    ref = attention_reference_varlen(*new[:5], causal=True, **kw)
    assert rel_l2(out, ref) < OUT_BOUND
