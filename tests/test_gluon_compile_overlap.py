"""Gluon step schedules compiled for sm_90a on the CPU: what keeps QK^T(j) and PV(j-1) overlapped
(ex2_fence's barriers, pv_defer's paired issue), P carried packed or through one or two shared-memory
tiles, the half first block and the output through the P tiles, as the SASS shows them.
"""

from __future__ import annotations

import re

import pytest
from gluon_cases import GLUON, SPACE
from gluon_compile import (
    CHUNKED_CASES,
    HALF_CASES,
    PACKED_CASES,
    SMEM2_CASES,
    SMEM_CASES,
    THREE_CASES,
    check_usable,
    compile_each_once,
    exponentials_after_pv_wait,
    overlapped_loops,
    overlapped_step_loops,
)

from zyfa_tune.generator import o_in_p_tile
from zyfa_tune.generator.gluon_sm90 import emit as emit_gluon
from zyfa_tune.search_spaces import SMEM_LIMIT, gluon_register_estimate, gluon_smem_estimate
from zyfa_tune.search_spaces.seeds import gluon_lanes_config, gluon_wide_config

compiled_fixture = pytest.fixture(scope="module", name="compiled")(compile_each_once)


@pytest.mark.parametrize(
    "changes,causal",
    [
        ({}, True),
        ({}, False),
        (dict(p_scale_log2=0), True),
        (dict(block_n=64), True),
        (dict(block_m=64, ping_pong=False), True),
        (dict(v_permute=False), True),
        (dict(producer_regs=56), True),
    ],
    ids=lambda x: str(x),
)
def test_ex2_fence_puts_every_exponential_before_the_pv_wait(changes, causal, compiled):
    """ptxas hoists the PV wait above part of the softmax's exponentials;
    ex2_fence (a barrier on the row sums right before the wait) keeps all of them before it, in every
    overlapped loop of every consumer, at a few instructions per step, without spills or serialised
    wgmmas."""
    plain_cfg = GLUON.replace(**changes)
    cfg = plain_cfg.replace(ex2_fence=True)
    plain, fenced = compiled(plain_cfg, causal), compiled(cfg, causal)
    check_usable(fenced, cfg)
    consumers, exps = cfg.block_m // 64, cfg.block_n // 2 + 2  # P and the two rows' rescale factors
    plain_loops, fenced_loops = (overlapped_step_loops(a.sass, cfg.block_n) for a in (plain, fenced))
    assert len(fenced_loops) == len(plain_loops) == 2 * consumers  # masked and unmasked steps
    print(
        f"\n  EX2 after the PV wait, off -> on: {[exponentials_after_pv_wait(b) for b in plain_loops]} -> "
        f"{[exponentials_after_pv_wait(b) for b in fenced_loops]} (of {exps}); instructions per step "
        f"{[len(b) for b in plain_loops]} -> {[len(b) for b in fenced_loops]}",
        end="",
    )
    for body, plain_body in zip(fenced_loops, plain_loops):
        assert sum("MUFU.EX2" in t for t in body) == exps
        assert exponentials_after_pv_wait(body) == 0
        assert sum("BAR.RED.AND" in t for t in body) == 1
        assert len(body) - len(plain_body) <= 8
    if not changes and causal:  # the seed without the fence: ptxas's hoisting that the field undoes
        assert sum(exponentials_after_pv_wait(b) for b in plain_loops) > 0


def test_ex2_fence_barriers_are_not_triton_s(compiled):
    """The fence's named barriers (15 for consumer 0, 14 for consumer 1) are none of the ones Triton
    gives the partitions."""
    ptx = compiled(GLUON.replace(ex2_fence=True)).ptx
    triton_ids = {int(i) for i in re.findall(r"\bbar(?:rier)?\.sync\s+(\d+)", ptx)}
    assert triton_ids and not triton_ids & {14, 15}
    assert {int(i) for i in re.findall(r"\bbar\.red\.and\.pred\s+\w+,\s*(\d+)", ptx)} == {14, 15}


def test_ex2_fence_barrier_per_consumer_of_three(compiled):
    """ex2_fence's bar.red is over one warpgroup's 128 threads, so each consumer needs its own named
    barrier: 15, 14 and, with three consumers, 13 (two sharing one would let their threads mix)."""
    art = compiled(THREE_CASES[0].replace(ping_pong=False, ex2_fence=True))
    assert set(re.findall(r"bar\.red\.and\.pred q, (\d+), 128", art.ptx)) == {"13", "14", "15"}
    assert art.spill_bytes == 0


@pytest.mark.parametrize(
    "cfg",
    [
        GLUON.replace(rowsum="mma"),
        GLUON.replace(block_n=192, num_stages=3, ping_pong=False, skip_rescale=True, rowsum="mma"),
    ],
    ids=["128", "192"],
)
def test_ex2_fence_with_the_row_sum_mma_ors_the_probabilities(cfg, compiled):
    """With rowsum="mma" ptxas puts (nearly) every exponential after the PV wait; ex2_fence then ORs
    all of a thread's probabilities into the predicate of its barrier (one per key part), which puts
    every exponential before the wait, at about 0.7 instruction per score, without spills."""
    fenced_cfg = cfg.replace(ex2_fence=True)
    plain, fenced = compiled(cfg), compiled(fenced_cfg)
    check_usable(fenced, fenced_cfg)
    exps = (64 * cfg.block_n) // 128 + 2  # P and the two rows' rescale factors
    loops = [(b, p) for b, p in zip(overlapped_loops(fenced.sass, exps), overlapped_loops(plain.sass, exps))]
    assert len(loops) == 2 * cfg.block_m // 64  # masked and unmasked steps, every consumer
    for body, plain_body in loops:
        assert exponentials_after_pv_wait(plain_body) >= exps - 8
        assert exponentials_after_pv_wait(body) == 0
        assert sum("BAR.RED.AND" in t for t in body) == (2 if cfg.block_n == 192 else 1)
        assert len(body) - len(plain_body) <= cfg.block_n // 2 * 3 // 4 + 8
    lean = GLUON.replace(softmax="lean", rowsum="mma", ex2_fence=True)  # lean P: fences its FMA outputs
    check_usable(compiled(lean), lean)


@pytest.mark.parametrize(
    "changes",
    [
        dict(),
        dict(block_n=192, num_stages=3, ping_pong=False, rowsum="mma"),
        dict(block_n=256, num_stages=2, q_stages=2, ping_pong=False, rowsum="mma", skip_rescale=True),
    ],
    ids=lambda x: str(x),
)
def test_pv_defer_pairs_the_products_and_waits_once(changes, compiled):
    """pv_defer: in every step loop QK^T(j) and PV(j-1) are issued in one burst, then one wait(0),
    and every exponential of the step comes after it (the softmax is not under an MMA, unlike
    overlap); no spills, no serialised wgmmas. With two key parts (192, 256 keys) PV(j-1) goes first
    and one wait inside the burst lets QK^T(j)'s first part run on (gsb0 <= 1) before the second."""
    cfg = GLUON.replace(overlap=False, pv_defer=True, **changes)
    art = compiled(cfg)
    check_usable(art, cfg)
    parts = 2 if emit_gluon.key_parts(cfg)[1] else 1
    qk = 4 * parts  # hd128: 4 k-steps per key part
    loops = overlapped_step_loops(art.sass, cfg.block_n, qk + cfg.block_n // 32 * (2 if cfg.rowsum == "mma" else 1))
    assert len(loops) == 2 * (cfg.block_m // 64)  # masked and unmasked steps of each consumer
    for body in loops:
        mma = [i for i, t in enumerate(body) if "QGMMA" in t]
        waits = [i for i, t in enumerate(body) if "WARPGROUP.DEPBAR" in t]
        inside = [w for w in waits if mma[0] < w < mma[-1]]
        if parts == 1:
            assert not inside  # one burst of wgmmas
        else:
            assert len(inside) == 1 and body[inside[0]].endswith("gsb0, 0x1")
            assert sum("QGMMA" in t for t in body[inside[0] :]) == 4  # the second part's k-steps
        assert exponentials_after_pv_wait(body) == sum("MUFU.EX2" in t for t in body)


def test_256_key_defer_issues_the_second_part_after_the_pv_wait(compiled):
    """pv_defer with 256-key blocks: PV(j-1) and QK^T(j)'s first 128-key part are issued, the wait
    lets one group (that part) run on, then the second part is issued into the registers the P in
    flight had, and one wait for all: per step two waits, one of them leaving a group in flight."""
    cfg = gluon_wide_config("fp8", 128, 128).replace(pv_defer=True, rowsum="mma", skip_rescale=True)
    art = compiled(cfg)
    assert art.spill_bytes == 0 and art.serialised_wgmma is None
    assert "WARPGROUP.DEPBAR.LE gsb0, 0x1" in art.sass
    assert "WARPGROUP.DEPBAR.LE gsb0, 0x1" not in compiled(gluon_wide_config("fp8", 128, 128)).sass


def test_smem_p_is_staged_by_stmatrix_and_fenced(compiled):
    """p_carry="smem": each step stores the packed P through stmatrix (as 32-bit words: 8-bit stores are
    lowered to stmatrix.b16 with half the bytes lost) and fences it for the async proxy; the PV wgmma
    reads its A operand from shared memory (no register P operand)."""
    art, ref = compiled(SMEM_CASES[0]), compiled(GLUON.replace(p_carry="e4m3"))
    stmatrix = "stmatrix.sync.aligned.m8n8.x4.shared.b16"  # (the bf16 output tile is stored so in both)
    assert art.ptx.count(stmatrix) >= ref.ptx.count(stmatrix) + 8
    assert art.ptx.count("fence.proxy.async.shared::cta") > ref.ptx.count("fence.proxy.async.shared::cta")
    # PV: m64n128k32 wgmmas whose A is a shared-memory descriptor, not registers
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n128k32\.f32\.e4m3\.e4m3 \{[^}]*\}, %rd", art.ptx)
    assert not re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n128k32\.f32\.e4m3\.e4m3 \{[^}]*\}, \{", art.ptx)
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n128k32\.f32\.e4m3\.e4m3 \{[^}]*\}, \{", ref.ptx)


def test_smem_p_at_256_keys_spills_as_estimated(compiled):
    """The register estimate counts smem's packed words like the packed carry: at 256 keys with overlap
    (estimated 248 of 240) it rejects the config, which spills 16 bytes (outside the step loop)."""
    cfg = gluon_wide_config("fp8", 128, 128).replace(overlap=True, p_carry="smem")
    assert "registers" in SPACE.feasible(cfg)
    assert compiled(cfg).spill_bytes > 0


def test_double_smem_p_is_published_under_qk_and_stored_under_pv(compiled):
    """p_carry="smem2" at 256 keys (the overlap that fits only so): in each step loop the proxy fence that
    publishes P(j-1) comes after QK^T(j)'s four m64n256 wgmmas and before PV(j-1)'s m64n128 ones, the 8
    stmatrix of P(j) into the other tile lie between the QK^T wait and the PV wait, and no score's
    exponential comes after the PV wait (at most the two rows' correction factors, needed only by the
    next step's rescale). The single tile's step fences before issuing anything."""
    cfg = SMEM2_CASES[0]
    loops = overlapped_step_loops(compiled(cfg).sass, cfg.block_n)
    assert len(loops) == 2 * (cfg.block_m // 64)  # masked and unmasked steps of each consumer
    for body in loops:
        fence = next(i for i, t in enumerate(body) if "FENCE.VIEW.ASYNC" in t)
        mma = [i for i, t in enumerate(body) if "QGMMA" in t]
        assert ["64x256" in body[i] for i in mma] == [i < fence for i in mma] and sum(i < fence for i in mma) == 4
        waits = [i for i, t in enumerate(body) if "WARPGROUP.DEPBAR" in t]
        assert len(waits) == 2 and sum("STSM" in t for t in body[waits[0] : waits[1]]) >= 8
        assert exponentials_after_pv_wait(body) <= 2
    single = SMEM_CASES[0]
    for body in overlapped_step_loops(compiled(single).sass, single.block_n):
        fence = next(i for i, t in enumerate(body) if "FENCE.VIEW.ASYNC" in t)
        assert fence < min(i for i, t in enumerate(body) if "QGMMA" in t)


def test_double_smem_p_fits_the_256_key_overlap():
    """Two P tiles take no P register across the step (estimated 216 of 240: accepted, where one tile's
    carried words make it 248) and the output tile lives in the first P tile at head dim 128 (64 x 256
    e4m3 = 64 x 128 bf16 bytes), so the 2-stage ring with a Q ring of 2 fits (compiled: check_usable)."""
    two = SMEM2_CASES[0]
    assert gluon_register_estimate(two) < gluon_register_estimate(two.replace(p_carry="smem"))
    assert SPACE.feasible(two) is None
    assert "registers" in SPACE.feasible(two.replace(p_carry="smem"))
    assert o_in_p_tile(two) and not o_in_p_tile(GLUON.replace(p_carry="smem2"))  # 128 keys: 8 KiB < 16 KiB
    assert gluon_smem_estimate(two) == gluon_smem_estimate(two.replace(p_carry="smem")) <= SMEM_LIMIT


def test_output_through_the_p_tiles_fits_hd256_and_stores_chunks(compiled):
    """o_through_p: at hd256 the 128-key overlap with two P tiles fits only without an output tile of its
    own (estimated 263 KB with one, ~199 KB without); each consumer stores its O in one TMA store per
    chunk (UTMASTG), and the chunks change nothing but the epilogue (the same wgmmas and exponentials as
    the kernel with its own output tile, 192/128)."""
    hd256, mla, narrow64 = CHUNKED_CASES
    assert gluon_smem_estimate(hd256) <= SMEM_LIMIT < gluon_smem_estimate(hd256.replace(o_through_p=False))
    assert SPACE.feasible(hd256) is None and "shared" in SPACE.feasible(hd256.replace(o_through_p=False))
    for cfg, chunks in ((hd256, 4), (mla, 2), (narrow64, 4)):
        assert compiled(cfg).count("UTMASTG") == chunks * cfg.block_m // 64, cfg.summary()
    own = compiled(mla.replace(o_through_p=False))
    assert own.count("UTMASTG") == mla.block_m // 64
    assert compiled(mla).count("QGMMA") == own.count("QGMMA")
    for op in ("MUFU.EX2", "STSM"):
        assert abs(compiled(mla).count(op) - own.count(op)) <= 4, op


def test_half_block_adds_a_half_width_step_to_the_causal_kernel(compiled):
    """half_block: beside each copy of the 256-key step (four m64n256 QK^T k-steps, PV in m64n128 at head
    dim 128), one of the half step: four m64n128 QK^T k-steps on the K tile's first 128 rows and four PV
    k-steps on V^T's first 128 keys. Not in the non-causal kernel (no code, no spills there)."""
    half = gluon_lanes_config("fp8", 128, 128)
    whole = half.replace(half_block=False)
    assert half.half_block
    for causal in (True, False):
        h, w = compiled(half, causal=causal), compiled(whole, causal=causal)
        assert h.spill_bytes == 0 and h.ptx.count("m64n256k32") == w.ptx.count("m64n256k32") > 0
        added = h.ptx.count("m64n128k32") - w.ptx.count("m64n128k32")
        assert added == (2 * w.ptx.count("m64n256k32") if causal else 0)
    assert compiled(half, causal=False).sass == compiled(whole, causal=False).sass


@pytest.mark.parametrize("cfg", HALF_CASES[3:], ids=["smem2", "smem2-pp-rowsum", "smem-128"])
def test_half_block_on_shared_p_halves_the_first_softmax_only(cfg, compiled):
    """half_block with P in shared memory: the first block keeps its whole QK^T (no second wgmma shape:
    a half-width accumulator in a second copy of the block makes ptxas spill in the step loops) and gets
    a second softmax on its lower half (per thread 64 x block_n / 2 / 128 exponentials, 2 for its rows'
    rescale factors), whose P goes to the tile beside zeros; the step loops are the whole-block kernel's
    (same wgmmas and exponentials). The non-causal kernel compiles no half block at all."""
    whole = cfg.replace(half_block=False)
    assert cfg.half_block
    h, w = compiled(cfg), compiled(whole)
    check_usable(h, cfg)
    consumers = cfg.block_m // 64
    assert h.count("QGMMA") == w.count("QGMMA")
    added = h.count("MUFU.EX2") - w.count("MUFU.EX2")
    assert abs(added - consumers * (64 * cfg.block_n // 2 // 128 + 2)) <= 4 * consumers
    per_loop = [
        (sum("QGMMA" in t for t in b), sum("MUFU.EX2" in t for t in b))
        for b in overlapped_step_loops(h.sass, cfg.block_n)
    ]
    assert per_loop and per_loop == [
        (sum("QGMMA" in t for t in b), sum("MUFU.EX2" in t for t in b))
        for b in overlapped_step_loops(w.sass, cfg.block_n)
    ]
    assert compiled(cfg, causal=False).sass == compiled(whole, causal=False).sass


@pytest.mark.parametrize("cfg", PACKED_CASES[:4], ids=("seed", "192/128", "hd64-three", "192-keys"))
def test_packed_p_carry_rounds_once_and_moves_no_bytes(cfg, compiled):
    """p_carry="e4m3": P is rounded where the softmax makes it, four keys per register, and the PV
    wgmma reads a copy of those registers (one LOP3 each: the copy keeps ptxas from writing the next
    step's P into registers an in-flight wgmma reads, which would serialise every wgmma). The float32
    twin moves bytes into place (PRMT); the packed kernel has none, and the same conversions and
    exponentials."""
    art, twin = compiled(cfg), compiled(cfg.replace(p_carry="f32"))
    check_usable(art, cfg)
    assert twin.count("PRMT") > 0 and art.count("PRMT") <= twin.count("PRMT") // 8
    for op in ("F2FP", "MUFU.EX2"):
        assert abs(art.count(op) - twin.count(op)) <= twin.count(op) // 50, op
    copies = len(re.findall(r"LOP3\.LUT R\d+, R(\d+), R\1, R\1, 0xf0", art.sass))
    assert copies >= twin.count("PRMT") // 2  # a register copy where the twin had a byte move
