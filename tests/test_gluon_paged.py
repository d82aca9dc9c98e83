"""The Gluon varlen kernel's paged twin (emit(config, paged=True)) on the CPU: it compiles for sm_90a
without spills for the natural-V versions of the default and lean configs; its parameters exist only in
the twin; configs it cannot run are refused by name; the launch arguments carry the page table, its stride
and the page size. GPU runs: tests/test_gpu_gluon_paged.py."""

from __future__ import annotations

import pytest
import torch

from zyfa_tune.generator import HOPPER, emit
from zyfa_tune.generator.build import compile_for_target
from zyfa_tune.generator.defaults import default_config
from zyfa_tune.generator.gluon_sm90 import emit as emit_gluon
from zyfa_tune.kernels import gluon_launch, gluon_paged
from zyfa_tune.search_spaces.resources import static_infeasibility
from zyfa_tune.search_spaces.seeds import gluon_lean_max_config, gluon_natural_config

FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16
GLUON = default_config("fp8", 128, 128, "gluon")
NATURAL = gluon_paged.natural_config(GLUON)


#: the exact schedule of a shipped H200 pick: 256 keys, P through two shared-memory tiles
EXACT_256 = GLUON.replace(block_n=256, num_stages=2, q_stages=2, skip_rescale=True, p_carry="smem2")


@pytest.mark.parametrize(
    "name,cfg", [("default", GLUON), ("lean-max", gluon_lean_max_config("fp8", 128, 128)), ("exact-256", EXACT_256)]
)
@pytest.mark.parametrize("causal", [True, False])
def test_paged_twin_compiles_clean(name, cfg, causal):
    """The natural-V versions the API runs (K relabelled by k_perm, P carried as the pick carries it) compile
    with no spills, causal (a cache's queries attend bottom-right aligned) or not; QGMMA only."""
    natural = gluon_paged.natural_config(cfg)
    art = compile_for_target(emit(natural, paged=True), causal=causal)
    assert art.spill_bytes == 0, f"{name}: spills {art.spill_bytes} bytes"
    assert art.count("QGMMA") > 0 and art.count("HGMMA") == 0 and art.serialised_wgmma is None
    assert art.shared_bytes <= HOPPER.shared_memory_bytes


def test_the_key_order_twin_spills_no_more_than_its_varlen_kernel():
    """The natural seed (V^T in key order, no k_perm): its varlen kernel runs too, and the pages add no spills."""
    seed = gluon_natural_config("fp8", 128, 128)
    for causal in (True, False):
        bound = compile_for_target(emit(seed, serving=True), causal=causal).spill_bytes
        assert compile_for_target(emit(seed, paged=True), causal=causal).spill_bytes <= min(bound, 16)


@pytest.mark.parametrize("d,bound", [(64, 0), (256, 24)])
def test_other_head_dims_compile_within_a_spill_bound(d, bound):
    """hd64 compiles clean; hd256's twin spills 24 bytes where its varlen kernel spills none (the stale-slot
    mask of its 16-dim rows beside 40 producer registers): a bound, so that more would show."""
    art = compile_for_target(
        emit(gluon_paged.natural_config(default_config("fp8", d, d, "gluon")), paged=True), causal=True
    )
    assert art.spill_bytes <= bound and art.count("QGMMA") > 0


def test_natural_config_keeps_the_schedule_and_reads_v_as_stored():
    """A v_permute pick keeps its P carry with the relabelling made on K (k_perm), at its own block where the
    raw V slots fit beside its rings, else at 128 keys; a pick in key order stays so; a natural config is
    its own."""
    assert NATURAL.v_layout == "natural" and NATURAL.k_perm and NATURAL.v_permute
    assert (NATURAL.block_n, NATURAL.p_carry, NATURAL.softmax) == (GLUON.block_n, GLUON.p_carry, GLUON.softmax)
    assert NATURAL.producer_regs >= gluon_natural_config("fp8", 128, 128).producer_regs
    lean = gluon_lean_max_config("fp8", 128, 128)
    too_big = lean.replace(v_layout="natural", k_perm=True, producer_regs=gluon_paged.PERM_PRODUCER_REGS)
    assert "shared memory" in static_infeasibility(too_big)  # (256 keys: two raw V slots more)
    natural_lean = gluon_paged.natural_config(lean)
    assert natural_lean == too_big.replace(block_n=128) and natural_lean.softmax == "lean"
    in_order = GLUON.replace(v_permute=False, p_carry="f32")
    assert gluon_paged.natural_config(in_order) == in_order.replace(
        v_layout="natural", producer_regs=gluon_natural_config("fp8", 128, 128).producer_regs
    )
    assert gluon_paged.natural_config(NATURAL) is NATURAL


def test_the_paged_parameters_exist_only_in_the_twin():
    seed = gluon_natural_config("fp8", 128, 128)  # (a varlen kernel takes no k_perm)
    plain, twin = emit(seed, serving=True).source, emit(NATURAL, paged=True).source
    assert "PAGE_TABLE" not in plain and "PAGE_TABLE, PAGE_STRIDE, PAGE_SIZE" in twin
    params = emit_gluon.kernel_params(NATURAL, True, paged=True)
    assert params[-3:] == ("PAGE_TABLE", "PAGE_STRIDE", "PAGE_SIZE") and params[:-3] == emit_gluon.kernel_params(
        NATURAL, True
    )
    with pytest.raises(ValueError, match="^config: k_perm reads K in 16-key groups, which packed sequences"):
        emit(NATURAL, serving=True)
    with pytest.raises(ValueError, match="^config: the paged twin reads V as stored: it takes v_layout='natural'"):
        emit(GLUON, paged=True)
    with pytest.raises(ValueError, match="^paged: backend='triton'"):
        emit(default_config("fp8", 128, 128), paged=True)


def test_paged_error_names_what_the_twin_cannot_run():
    assert gluon_paged.paged_error(NATURAL, 128) is None and gluon_paged.paged_error(NATURAL, 256) is None
    assert "does not divide the page_size 64" in gluon_paged.paged_error(NATURAL, 64)
    assert "v_layout='natural'" in gluon_paged.paged_error(GLUON, 128)
    assert "Gluon" in gluon_paged.paged_error(default_config("fp8", 128, 128), 128)


def _call(page_size=128, lens=(1, 200, 256), sq=1, pages=8):
    b = len(lens)
    q = torch.zeros(b * sq, 8, 128, dtype=FP8)
    kc, vc = (torch.zeros(pages, page_size, 2, 128, dtype=FP8) for _ in range(2))
    table = torch.randperm(pages)[: b * 2].view(b, 2).to(torch.int32).contiguous()
    seqlens = torch.tensor(lens, dtype=torch.int32)
    cu_q = gluon_paged.query_offsets(b, sq, q.device)
    out = torch.empty(b * sq, 8, 128, dtype=BF16)
    return q, kc, vc, out, (cu_q, table, seqlens), tuple(torch.ones(b, 2) for _ in range(3))


def test_paged_arguments_carry_the_page_table_and_key_offsets():
    q, kc, vc, out, pages, ds = _call()
    _, args, options = gluon_paged.arguments(NATURAL, q, kc, vc, out, 0.1, True, ds, pages, 1, 132)
    n_desc = len(gluon_launch.descriptor_owners(NATURAL))
    named = dict(zip(emit_gluon.kernel_params(NATURAL, True, paged=True), args[n_desc:]))
    assert len(args) == n_desc + len(named) and named["PAGE_TABLE"] is pages[1]
    assert (named["PAGE_STRIDE"], named["PAGE_SIZE"]) == (2, 128) and options["CAUSAL"] is True
    assert named["CU_K"].tolist() == [0, 1, 201, 457] and named["CU_Q"] is pages[0]
    assert named["SEQ_K"] == 8 * 128  # (the cache rows: the L2 head groups' size)


def test_paged_arguments_are_checked():
    q, kc, vc, out, pages, ds = _call(page_size=64)
    with pytest.raises(ValueError, match="^config: block_n=128 does not divide the page_size 64"):
        gluon_paged.arguments(NATURAL, q, kc, vc, out, 0.1, True, ds, pages, 1, 132)
    q, kc, vc, out, pages, ds = _call()
    bad = (pages[0], pages[1].to(torch.int64), pages[2])
    with pytest.raises(ValueError, match="^page_table: expected int32"):
        gluon_paged.arguments(NATURAL, q, kc, vc, out, 0.1, True, ds, bad, 1, 132)
    with pytest.raises(ValueError, match="^k_cache: pages must be contiguous"):
        apart = torch.zeros(8, 2, 128, 2, 128, dtype=FP8)[:, 0]  # (K and V interleaved per page)
        gluon_paged.arguments(NATURAL, q, apart, vc, out, 0.1, True, ds, pages, 1, 132)
    one_head = kc[:, :, :1]  # (pages evenly spaced: TMA reads them in place)
    _, args, _ = gluon_paged.arguments(NATURAL, q, one_head, vc[:, :, :1], out, 0.1, True, ds, pages, 1, 132)
    assert args[-3] is pages[1]


def test_key_offsets_and_query_offsets():
    assert gluon_paged.key_offsets(torch.tensor([3, 0, 5], dtype=torch.int32)).tolist() == [0, 3, 3, 8]
    assert gluon_paged.query_offsets(3, 4, torch.device("cpu")).tolist() == [0, 4, 8, 12]


# ---- routing: which dispatcher picks the API runs on the twin ----------------------------------------


@pytest.mark.parametrize(
    "picked,page_size,runs",
    [
        (GLUON, 128, True),
        (GLUON, 256, True),
        (gluon_lean_max_config("fp8", 128, 128), 128, True),  # (its natural seed: block_n 128)
        (default_config("fp8", 64, 64, "gluon"), 128, True),
        (GLUON, 64, False),  # (a 128-key block straddles 64-key pages: Triton)
        (default_config("fp8", 192, 128, "gluon"), 128, False),  # (Q/K in two chunks: Triton)
        (default_config("fp8", 128, 128), 128, False),  # (a Triton pick)
    ],
)
def test_the_api_runs_a_gluon_pick_on_the_paged_twin(picked, page_size, runs):
    from zyfa_tune.kvcache import gluon_paged_config

    config = gluon_paged_config(picked, page_size)
    assert (config is not None) == runs
    if runs:
        assert config.v_layout == "natural" and gluon_paged.paged_error(config, page_size) is None


def test_the_dispatched_paged_config_is_the_twin_s_unless_pages_lie_apart(monkeypatch):
    from zyfa_tune import kvcache

    fake = type("Dispatcher", (), {"config_for": lambda self, *a: GLUON})()
    monkeypatch.setattr(kvcache.dispatch, "dispatcher", lambda: fake)
    dims = ("fp8", 128, 128, True, 2, 8, 2, 300, 128)
    assert kvcache.dispatched_paged_config(*dims, False, 0) == NATURAL
    triton = kvcache.dispatched_paged_config(*dims, True, 0)  # (pages apart: pointer loads)
    assert triton.backend == "triton" and triton.loads == "pointer"
