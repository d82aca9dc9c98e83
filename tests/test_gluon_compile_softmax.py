"""Gluon softmax variants compiled for sm_90a on the CPU: lean P (no exponential per score; its
folds, clamps, code sums, f16 scores and MUFU shares), the row-sum MMA, the FMA-pipe exponential,
skipped rescales, per-lane sums and the f16 QK^T's async wait show in the SASS as designed, within
bounds (ptxas's exact counts change between releases), without spills.
"""

from __future__ import annotations

import re

import pytest
from gluon_cases import GLUON
from gluon_compile import (
    CODE_SUM_CASES,
    HD64,
    HD256,
    LEAN_CASES,
    LINEAR_MUFU_CASES,
    MUFU_CASES,
    QK_ASYNC_CASES,
    WINNER,
    check_usable,
    compile_each_once,
    issue_order,
    op_count,
    step_loop,
)

from zyfa_tune.search_spaces.seeds import (
    gluon_lean_f16_async_config,
    gluon_lean_f16_config,
    gluon_lean_smem2_config,
    gluon_wide_config,
)

compiled_fixture = pytest.fixture(scope="module", name="compiled")(compile_each_once)


def test_f16_scores_halve_the_softmax_and_keep_the_wgmmas_overlapped(compiled):
    """qk_acc="f16": QK^T accumulates in f16 (QGMMA ...F16.E4M3.E4M3, no float32 64 x 256 product); the row
    maximum is three-input f16 maxima (VHMNMX, two scores each), the fold two HFMA2 per two scores, the pack one
    PRMT per four codes, so the step loop is ~30% shorter than the float32 kernel's. Its k-steps are chained with
    no wait between them: Triton splits an async f16 accumulator into halves before its wait, and ptxas then
    waits after every wgmma of the kernel (without a warning); the synchronous last k-step avoids it."""
    f32, f16 = gluon_lean_smem2_config("fp8", 128, 128), gluon_lean_f16_config("fp8", 128, 128)
    art, ref = compiled(f16), compiled(f32)
    check_usable(art, f16)
    assert art.count("QGMMA.64x256x32.F16.E4M3.E4M3") > 0 and art.count("QGMMA.64x256x32.F32") == 0
    assert re.search(r"QGMMA\.64x256x32\.F16\.E4M3\.E4M3 R\d+, gdesc\[UR\d+\], R\d+ ;", art.sass)  # chained, no wait
    assert art.count("WARPGROUP.DEPBAR") < art.count("QGMMA") // 3, "a wait after every wgmma: serialised"
    assert art.count("VHMNMX") > 0 and art.count("FMNMX") < ref.count("FMNMX") // 10
    assert art.count("HFMA2") > 0 and art.count("FFMA") < ref.count("FFMA") // 10
    loop, ref_loop = step_loop(art.sass), step_loop(ref.sass)
    print(f"\n  step loop: {len(loop)} instructions (float32 scores: {len(ref_loop)})", end="")
    assert len(loop) < 0.8 * len(ref_loop)
    assert sum("PRMT" in x for x in loop) <= sum("PRMT" in x for x in ref_loop) // 2


@pytest.mark.parametrize("cfg", MUFU_CASES, ids=lambda c: f"mufu{c.lean_mufu}")
def test_lean_mufu_moves_a_share_of_the_pairs_to_the_mufu(cfg, compiled):
    """lean_mufu=k: per 256-key step a thread has 64 f16 pairs; 16 k of them take two MUFU.EX2 each (the f16x2
    exponential is two on sm_90a) and their codes from the f16 bits by an integer add and a shift, instead of
    the corrected fold's seven f16x2 operations: 32 k exponentials more than the fold alone (its 2: the rows'
    alpha), 5 x 16 k fewer HFMA2 (six of the fold's, one for the line e), and no conversion (F2FP) added."""
    corrected = cfg.replace(lean_mufu=0)
    art, ref = compiled(cfg), compiled(corrected)
    check_usable(art, cfg)
    loop, ref_loop = step_loop(art.sass), step_loop(ref.sass)
    k = cfg.lean_mufu
    assert 32 * k <= op_count(loop, "MUFU") - op_count(ref_loop, "MUFU") <= 32 * k + 8
    assert op_count(ref_loop, "HFMA2") - op_count(loop, "HFMA2") >= 4 * 16 * k
    assert op_count(loop, "F2FP") - op_count(ref_loop, "F2FP") <= 4  # (the rows' a2, b2 to f16)


@pytest.mark.parametrize("cfg", LINEAR_MUFU_CASES, ids=lambda c: f"mufu{c.lean_mufu}-floor{c.lean_floor}")
def test_lean_mufu_beside_the_linear_fold(cfg, compiled):
    """lean_mufu=k on the linear fold: of a thread's 64 f16 pairs per 256-key step, 16 k take two MUFU.EX2 each
    and their code by a shift off the f16 bits instead of the fold's two HFMA2 (and the floor's HFMA2 and
    HMNMX2): two HFMA2 a pair (the fold's line, unsaturated, and e = 16 t + k), no conversion (F2FP) added,
    no spills."""
    art, ref = compiled(cfg), compiled(cfg.replace(lean_mufu=0))
    check_usable(art, cfg)
    loop, ref_loop = step_loop(art.sass), step_loop(ref.sass)
    k, floor = cfg.lean_mufu, cfg.lean_floor
    assert 32 * k <= op_count(loop, "MUFU") - op_count(ref_loop, "MUFU") <= 32 * k + 8
    for op in ("HFMA2", "HMNMX2"):  # the floor's two operations a pair, gone from the MUFU's pairs
        assert abs(op_count(ref_loop, op) - op_count(loop, op) - (16 * k if floor else 0)) <= 8, op
    assert op_count(loop, "F2FP") - op_count(ref_loop, "F2FP") <= 4  # (the rows' a2, b2 to f16)


def test_lean_ref_max_drops_the_grid_and_the_floor_adds_two_operations_a_pair(compiled):
    """lean_ref="max": the row maximum is no longer rounded up to the 1/8 grid (an FRND.CEIL per row), the
    step otherwise the same instructions; lean_floor: per 256-key step a thread's 64 f16 pairs each get one more
    HFMA2 (the second line) and one HMNMX2 (the larger of the two), no spills."""
    base = gluon_lean_f16_async_config("fp8", 128, 128)
    at_max, floor = base.replace(lean_ref="max"), base.replace(lean_ref="max", lean_floor=True)
    loops = {}
    for name, cfg in (("grid", base), ("max", at_max), ("floor", floor)):
        art = compiled(cfg)
        check_usable(art, cfg)
        loops[name] = step_loop(art.sass)
    assert op_count(loops["grid"], "FRND") > 0 and op_count(loops["max"], "FRND") == 0
    assert abs(len(loops["max"]) - len(loops["grid"])) <= 16
    for op in ("HFMA2", "HMNMX2"):  # 64 pairs a step, one more of each
        assert 56 <= op_count(loops["floor"], op) - op_count(loops["max"], op) <= 72, op


@pytest.mark.parametrize("cfg", LEAN_CASES, ids=lambda c: f"{c.lean_fold}-{c.lean_clamp}-{c.lean_pack}-pp{c.ping_pong}")
def test_lean_p_has_no_exponentials_per_score(cfg, compiled):
    """Lean P: the loop's MUFU.EX2 are the per-row rescale factors only (the exact seed has one per
    score), the codes are packed by byte moves, the row sum is an extra m64n8 FP8 wgmma per
    PV, and the ones tile is written as whole words (a 2-D e4m3 store became stmatrix.b16 and left
    half the bytes unwritten: the bug the GPU test found)."""
    art = compiled(cfg)
    exact = compiled(GLUON)
    check_usable(art, cfg)
    assert art.count("MUFU.EX2") <= 16 < exact.count("MUFU.EX2")
    clamp = {
        "imax": "max.s32 r0, r0, 1262485504;",
        "fmax": "max.f32 r0, r0, 0f4B400000;",
        "sat": "fma.rn.f32 r0, r0, 0f43000000, 0f4B400000;",
    }[cfg.lean_clamp]
    packs = art.ptx.count(clamp)  # one per pack of four scores
    assert packs > 0 and art.ptx.count("prmt.b32 r0" if cfg.lean_pack == "prmt" else "bfi.b32 r0") >= packs
    assert art.ptx.count("m64n8k32.f32.e4m3.e4m3") == art.ptx.count("m64n128k32.f32.e4m3.e4m3") // 2
    assert re.search(r"st\.shared\.v\d\.b32\s+\[[^\]]+\], \{943208504, 943208504", art.ptx)  # 0x38383838


@pytest.mark.parametrize("cfg", CODE_SUM_CASES, ids=["e4m3-rows", "smem2-256-lanes"])
def test_lean_code_sums_decode_the_codes_without_an_mma(cfg, compiled):
    """rowsum="rounded" under lean P: no m64n8 row-sum wgmma and no ones tile; each pair of codes is
    converted to f16x2 once (F2FP.F16.E4M3.UNPACK_B: one per two scores of a step body) and added
    as f16x2; no exponential per score, no spill, and (per lane) no more shuffles than the exact
    kernel with lane sums."""
    art, mma = compiled(cfg), compiled(cfg.replace(rowsum="mma", lane_sums=False))
    exact = compiled(cfg.replace(softmax="exact", rowsum="fp32"))
    check_usable(art, cfg)
    assert art.spill_bytes == 0 and art.count("MUFU.EX2") <= 16
    assert "m64n8k32" not in art.ptx and "943208504" not in art.ptx  # no row-sum wgmma, no 0x38383838 fill
    assert art.ptx.count("m64n128k32.f32.e4m3.e4m3") == mma.ptx.count("m64n128k32.f32.e4m3.e4m3")
    # a thread's codes per step body: 2 rows x block_n / 4 keys, two per unpack; at least the masked and
    # the unmasked body, each with all of its unpacks
    unpacks = art.count("F2FP.F16.E4M3.UNPACK_B")
    assert unpacks >= art.ptx.count("cvt.rn.f16x2.e4m3x2") >= 2 * (cfg.block_n // 4)
    assert art.count("HADD2") >= unpacks
    assert art.count("SHFL") <= exact.count("SHFL")


@pytest.mark.parametrize("fold", ["fma", "centered"])
def test_lean_sat_clamp_is_one_saturating_fma_per_code(fold, compiled):
    """clamp "sat" on the 256-key two-tile kernel with code sums: each code's integer max (VIMNMX)
    becomes a saturating FMA (FFMA.SAT), its magic add one more FFMA; the same wgmmas, no spill."""
    base = CODE_SUM_CASES[1].replace(lean_fold=fold)
    art, imax = compiled(base.replace(lean_clamp="sat")), compiled(base)
    check_usable(art, base.replace(lean_clamp="sat"))
    assert art.spill_bytes == 0
    clamps = imax.count("VIMNMX") - art.count("VIMNMX")
    assert clamps >= 2 * (base.block_n // 2) and art.count("FFMA.SAT") >= clamps
    assert art.count("FFMA") - art.count("FFMA.SAT") >= imax.count("FFMA")  # (centered: b by an FFMA per row)
    assert art.count("QGMMA") == imax.count("QGMMA")


@pytest.mark.parametrize(
    "cfg",
    [
        GLUON.replace(rowsum="mma"),
        WINNER.replace(rowsum="mma"),
        WINNER.replace(rowsum="mma", overlap=False, block_m=64, block_n=64),
    ],
    ids=["seed", "winner", "plain"],
)
def test_exact_rowsum_mma_replaces_the_row_sum_adds(cfg, compiled):
    """rowsum="mma" under exact softmax: the float32 row sum (one FADD per score) is gone, an m64n8
    FP8 wgmma per PV sums the e4m3-rounded probabilities instead; the exponentials stay."""
    art, ref = compiled(cfg), compiled(cfg.replace(rowsum="fp32"))
    check_usable(art, cfg)
    assert abs(art.count("MUFU.EX2") - ref.count("MUFU.EX2")) <= ref.count("MUFU.EX2") // 50
    scores = ref.count("MUFU.EX2") - 12 if cfg.overlap else 0  # (about 12: the rows' rescale factors)
    assert art.count("FADD") <= ref.count("FADD") - 0.9 * scores
    pv = art.ptx.count(f"m64n{cfg.head_dim_v}k32.f32.e4m3.e4m3") // (2 if cfg.block_n == cfg.head_dim_v else 1)
    assert art.ptx.count("m64n8k32.f32.e4m3.e4m3") == pv  # one row-sum wgmma per PV wgmma (QK^T shares n128)


@pytest.mark.parametrize("share,degree", [(2, 3), (4, 2), (8, 3)])
def test_exp2_poly_moves_exponentials_to_the_fma_pipe(share, degree, compiled):
    """exp2_poly: share/8 of the per-score MUFU.EX2 become polynomial FMAs (3 or 2 per score), no
    spills, the schedule otherwise intact."""
    cfg = WINNER.replace(exp2_poly=share, exp2_poly_degree=degree)
    art, ref = compiled(cfg), compiled(WINNER)
    check_usable(art, cfg)
    rescale = 12  # about one MUFU.EX2 per row statistic update, not per score
    per_score = ref.count("MUFU.EX2") - rescale
    assert abs(art.count("MUFU.EX2") - (rescale + per_score * (8 - share) // 8)) <= max(16, per_score // 20)
    assert art.count("FFMA") >= ref.count("FFMA") + 0.9 * degree * per_score * share // 8


@pytest.mark.parametrize(
    "cfg", [WINNER, HD64.replace(ping_pong=False), HD256.replace(ping_pong=False)], ids=["hd128", "hd64", "hd256"]
)
def test_skip_rescale_branches_around_the_multiplies(cfg, compiled):
    """skip_rescale: each of the three rescale sites of each consumer becomes a warp vote and a
    uniform branch over the same FMULs (none removed, none added: the O registers are tied)."""
    art, ref = compiled(cfg.replace(skip_rescale=True)), compiled(cfg)
    check_usable(art, cfg)
    consumers = cfg.block_m // 64
    assert art.count("VOTE.ANY") - ref.count("VOTE.ANY") >= 3 * consumers
    assert abs(art.count("FMUL") - ref.count("FMUL")) <= ref.count("FMUL") // 50
    assert art.ptx.count("vote.sync.any.pred") == 3 * consumers and art.ptx.count("bra.uni") >= 3 * consumers


def test_lane_sums_leave_the_row_sum_shuffles_to_the_epilogue(compiled):
    """lane_sums=True: per step, each row's sum is no longer reduced over its quad of lanes (two
    shuffles per row of each thread's two rows), only once per tile in the epilogue: the 256-key
    kernel's two step bodies (masked and not) lose their shuffles (4 each)."""
    wide = gluon_wide_config("fp8", 128, 128)
    before, after = compiled(wide), compiled(wide.replace(lane_sums=True))
    assert before.count("SHFL") - after.count("SHFL") >= 4
    assert abs(after.count("MUFU.EX2") - before.count("MUFU.EX2")) <= 4 and after.spill_bytes == 0


@pytest.mark.parametrize(
    "cfg", QK_ASYNC_CASES, ids=lambda c: f"hd{c.head_dim_qk}-{c.lean_fold}-p{c.producer_regs}{'-kperm' * c.k_perm}"
)
def test_qk_async_issues_pv_behind_the_f16_qk_without_waiting(cfg, compiled):
    """qk_async: in the step loop the f16 QK^T(j) QGMMAs are followed by PV(j-1)'s with no wait between (the
    twin waits for QK^T first), then one wait for QK^T and, at the end, one for PV: the float32-score kernels'
    order. The same QGMMAs and instructions otherwise (the split only moves), no spill, nothing serialised."""
    art, twin = compiled(cfg), compiled(cfg.replace(qk_async=False))
    order, twin_order = issue_order(art), issue_order(twin)
    qk, pv = twin_order.count("h"), twin_order.count("f")
    assert twin_order == "h" * qk + "w" + "f" * pv + "w" * (len(twin_order) - qk - pv - 1), twin_order
    assert order == "h" * qk + "f" * pv + "w" * (len(order) - qk - pv) and order.count("w") >= 1, order
    assert twin.ptx.count("wgmma.wait_group.sync.aligned 0") - art.ptx.count("wgmma.wait_group.sync.aligned 0") >= 2
    assert art.count("QGMMA") == twin.count("QGMMA") and art.spill_bytes == 0 and art.serialised_wgmma is None
