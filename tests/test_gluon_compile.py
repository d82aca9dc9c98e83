"""Gluon kernels compiled for sm_90a on the CPU (generator.build.compile_for_target): the search
space's Gluon seed, every one-field variant of it and a sample of the space compile without
spills, issue FP8 warpgroup MMAs (QGMMA), rebalance registers per role (setmaxnreg), keep their
wgmmas overlapped (no ptxas C7514-style serialisation) and fit the shared-memory estimate; the
register estimate's calibration; the runners' compile check rejects serialised wgmmas.

Each config compiles once per module (the `compiled` fixture), those of the selected parametrised
tests ahead of time in a process pool (one worker per core); numbers print with pytest -s.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import re
from concurrent.futures import ProcessPoolExecutor

import pytest
from gluon_cases import GLUON, SPACE, neighbours, sampled

from zyfa_tune.generator import ConfigError, KernelConfig, emit, o_in_p_tile
from zyfa_tune.generator.gluon_sm90 import emit as emit_gluon
from zyfa_tune.generator.build import CompiledArtifacts, compile_for_target
from zyfa_tune.generator.defaults import default_config
from zyfa_tune.search_spaces import SMEM_LIMIT, gluon_register_estimate, gluon_smem_estimate
from zyfa_tune.search_spaces.resources import TMA_SMEM_MARGIN, gluon_infeasibility
from zyfa_tune.search_spaces.seeds import (gluon_lanes_config, gluon_lean_f16_async_config, gluon_lean_f16_config,
                                          gluon_lean_max_config, gluon_lean_smem2_config, gluon_smem2_chunked_config,
                                          gluon_smem2_config, gluon_smem2_narrow_config, gluon_three_config,
                                          gluon_wide_config)

#: lean P (Gluon): each instruction sequence, on the seed and on the 15-minute study's winner schedule
LEAN_CASES = [GLUON.replace(softmax="lean", rowsum="mma", lean_fold=fold) for fold in ("fma", "sub_fma", "corrected")]
LEAN_CASES.append(LEAN_CASES[0].replace(ping_pong=False, q_stages=2, q_order="forward", lean_clamp="fmax", lean_pack="bfi"))
LEAN_CASES.append(LEAN_CASES[0].replace(lean_fold="centered", lean_clamp="sat"))
#: lean P's codes made where the softmax folds the scores and carried packed: in registers, through one
#: shared-memory tile, through two with a halved first block
LEAN_CASES += [LEAN_CASES[0].replace(p_carry="e4m3"), LEAN_CASES[0].replace(p_carry="smem"),
               LEAN_CASES[0].replace(p_carry="smem2", half_block=True)]
#: head dim 64 (Q, K, V and O tiles of 64 columns): the seed, one consumer, lean P, 64-key blocks
HD64 = default_config("fp8", 64, 64, "gluon")
HD64_CASES = [HD64, HD64.replace(block_m=64, ping_pong=False), HD64.replace(softmax="lean", rowsum="mma"),
              HD64.replace(block_n=64, num_stages=4), HD64.replace(ping_pong=False, q_stages=2, q_order="forward")]
#: head dim 256 (64-key blocks: the 64 x 256 accumulator's registers; Q/K boxes split by the swizzle)
HD256 = default_config("fp8", 256, 256, "gluon")
HD256_CASES = [HD256, HD256.replace(softmax="lean", rowsum="mma"), HD256.replace(num_stages=3),
               HD256.replace(ping_pong=False, q_stages=2, q_order="forward"), HD256.replace(block_m=64, ping_pong=False)]
#: MLA's 192/128: Q and K in three 64-column parts (one TMA copy and one chained wgmma each)
MLA = default_config("fp8", 192, 128, "gluon")
MLA_CASES = [MLA, MLA.replace(softmax="lean", rowsum="mma"), MLA.replace(block_n=64, num_stages=4),
             MLA.replace(ping_pong=False, q_stages=2, q_order="forward"), MLA.replace(block_m=64, ping_pong=False)]
#: three consumer warpgroups (block_m=192, FA3's head-dim-64 tile): Q in three 64-row TMA boxes
THREE_CASES = [HD64.replace(block_m=192), HD64.replace(block_m=192, ping_pong=False, q_stages=2),
               HD64.replace(block_m=192, softmax="lean", rowsum="mma"), GLUON.replace(block_m=192, block_n=64)]
#: V read as given (v_layout="natural"): the producer warpgroup writes each tile's transpose
NATURAL_CASES = [GLUON.replace(v_permute=False, v_layout="natural", producer_regs=40),
                 GLUON.replace(block_m=64, ping_pong=False, overlap=False, v_permute=False, v_layout="natural",
                               q_order="heavy_first"),
                 HD64.replace(v_permute=False, v_layout="natural", producer_regs=40),
                 HD256.replace(v_permute=False, v_layout="natural", producer_regs=40),
                 MLA.replace(v_permute=False, v_layout="natural", producer_regs=40),
                 HD64.replace(block_m=192, v_permute=False, v_layout="natural", producer_regs=40, overlap=False)]
#: 192-key blocks (a 128-key and a 64-key part): overlapped, with the row-sum MMA, plain
SPLIT_CASES = [GLUON.replace(block_n=192, num_stages=2), GLUON.replace(block_n=192, num_stages=2, rowsum="mma"),
               GLUON.replace(block_n=192, overlap=False, ping_pong=False, rowsum="mma", num_stages=2, q_stages=2,
                             v_permute=False)]
#: P carried packed as e4m3 (p_carry="e4m3"): the overlapped seeds of each head dim, three consumers,
#: the 192-key block, pv_defer (128 keys with ping-pong at head dim 256; 256 keys as two parts)
PACKED_CASES = [GLUON.replace(p_carry="e4m3"), MLA.replace(p_carry="e4m3"),
                HD64.replace(block_m=192, ping_pong=False, rowsum="mma", skip_rescale=True, p_carry="e4m3"),
                GLUON.replace(block_n=192, num_stages=3, ping_pong=False, skip_rescale=True, p_carry="e4m3"),
                HD256.replace(block_n=128, num_stages=2, overlap=False, pv_defer=True, p_carry="e4m3"),
                gluon_wide_config("fp8", 128, 128).replace(pv_defer=True, p_carry="e4m3")]
#: P handed to the PV wgmma through a shared-memory tile (p_carry="smem", not searched): the seed
#: with and without ping-pong, three consumers at head dim 64, 192/128, head dim 256's 64-key blocks
#: (a 64-byte swizzle)
SMEM_CASES = [GLUON.replace(p_carry="smem"), GLUON.replace(p_carry="smem", ping_pong=False),
              HD64.replace(block_m=192, ping_pong=False, rowsum="mma", skip_rescale=True, p_carry="smem"),
              MLA.replace(p_carry="smem"), HD256.replace(p_carry="smem")]
#: two P tiles per consumer (p_carry="smem2", searched): the 256-key overlap at head dims 128 and 96 (the
#: output tile in the first P tile), with ping-pong and per-step row sums, the seed, three consumers at
#: head dim 64, 192/128 (the seed's schedule, the narrow seed, the session-18 study's winner)
SMEM2_CASES = [gluon_smem2_config("fp8", 128, 128), gluon_smem2_config("fp8", 96, 96),
               gluon_smem2_config("fp8", 128, 128).replace(lane_sums=False, ping_pong=True),
               GLUON.replace(p_carry="smem2"),
               HD64.replace(block_m=192, ping_pong=False, rowsum="mma", skip_rescale=True, p_carry="smem2"),
               MLA.replace(p_carry="smem2"), gluon_smem2_narrow_config("fp8", 192, 128),
               gluon_smem2_narrow_config("fp8", 192, 128).replace(lane_sums=False, rowsum="mma", late_rescale=True,
                                                                   turn_barrier="named", producer_regs=40)]
#: row sums kept per lane (lane_sums): the 256-key kernel, the packed overlapped seed, 192/128, hd64 and
#: hd256's 64-key blocks
LANE_CASES = [gluon_wide_config("fp8", 128, 128).replace(lane_sums=True), GLUON.replace(p_carry="e4m3", lane_sums=True),
              MLA.replace(lane_sums=True), HD64.replace(lane_sums=True), HD256.replace(lane_sums=True)]
#: head dim 96: Q / K in three 32-column parts; O padded to 128 columns (the seed, 256-key blocks,
#: V read as given) or in a 64- and a 32-column part (o_split: the seed, three consumers, 256-key
#: blocks overlapped, pv_defer, skip_rescale's asm on both parts)
HD96 = default_config("fp8", 96, 96, "gluon")
HD96_SPLIT = HD96.replace(o_split=True)
HD96_CASES = [HD96, gluon_wide_config("fp8", 96, 96).replace(lane_sums=True),
              HD96.replace(v_permute=False, v_layout="natural", producer_regs=40),
              HD96_SPLIT, HD96_SPLIT.replace(block_m=192, p_carry="e4m3", late_rescale=True),
              HD96_SPLIT.replace(block_m=192, ping_pong=False, rowsum="mma", skip_rescale=True, p_carry="e4m3"),
              HD96_SPLIT.replace(block_n=256, num_stages=2, p_carry="e4m3", lane_sums=True),
              HD96_SPLIT.replace(overlap=False, pv_defer=True, p_carry="e4m3", lane_sums=True)]
#: a half-empty first block run as half a block (half_block): the untuned hd128 kernel (256-key blocks,
#: per-lane sums), head dim 96's shipped 4K schedule, 128-key blocks under one consumer with the row-sum MMA;
#: the output stored in column chunks through the two P tiles (o_through_p, session 19): hd256's
#: 128-key overlap with P in shared memory (the seed; fits only so), 192/128's narrow seed in a 2-stage
#: ring, 64-key blocks at hd128 (four chunks of 32 columns)
CHUNKED_CASES = [gluon_smem2_chunked_config("fp8", 256, 256), gluon_smem2_chunked_config("fp8", 192, 128),
                 gluon_smem2_narrow_config("fp8", 128, 128).replace(block_n=64, num_stages=4, half_block=False,
                                                                    o_through_p=True)]
#: overlapped with P in shared memory: the smem2 seed, with ping-pong and per-step sums, one 128-key P tile
HALF_CASES = [gluon_lanes_config("fp8", 128, 128),
              gluon_wide_config("fp8", 96, 96).replace(o_split=True, lane_sums=True, half_block=True),
              GLUON.replace(block_m=64, ping_pong=False, overlap=False, q_stages=2, num_stages=2, rowsum="mma",
                            half_block=True),
              gluon_smem2_config("fp8", 128, 128),
              gluon_smem2_config("fp8", 128, 128).replace(ping_pong=True, lane_sums=False),
              GLUON.replace(p_carry="smem", half_block=True)]
#: lean P on f16 scores (qk_acc="f16", session 28): the lean 256-key kernel at head dims 128 and 64, and at 96
#: (three 32-column Q parts: the Q rescale over all of them, the last QK^T part synchronous); the corrected fold
F16_CASES = [gluon_lean_f16_config("fp8", 128, 128), gluon_lean_f16_config("fp8", 64, 64),
             gluon_lean_f16_config("fp8", 96, 96),
             gluon_lean_f16_config("fp8", 128, 128).replace(lean_fold="corrected")]
#: the key relabelling made on K's tile rows (k_perm: a 5-D TMA box, so V^T is read in key order): the 256-key
#: two-tile kernel, lean P on f16 scores, 192-key blocks (two K boxes), 192/128 (64-column K parts)
K_PERM_CASES = [gluon_smem2_config("fp8", 128, 128).replace(k_perm=True),
                gluon_lean_f16_config("fp8", 128, 128).replace(k_perm=True),
                GLUON.replace(block_n=192, num_stages=2, k_perm=True), MLA.replace(p_carry="smem2", k_perm=True)]
#: f16 scores with QK^T's wait moved behind PV(j-1)'s issue by generator/ptx_pass.py (qk_async): the F16_CASES,
#: and the qk_async seed (a 24-register producer, session 35) with and without keys relabelled on K
QK_ASYNC_CASES = [cfg.replace(qk_async=True) for cfg in F16_CASES] + [
    gluon_lean_f16_async_config("fp8", 128, 128), gluon_lean_f16_async_config("fp8", 128, 128).replace(k_perm=True)]
#: a share of the corrected f16 fold's pairs from the MUFU (lean_mufu: 1, 2, 3 of every four), at the qk_async
#: seed's 24-register producer
MUFU_CASES = [gluon_lean_f16_async_config("fp8", 128, 128).replace(lean_fold="corrected", lean_mufu=k)
              for k in (1, 2, 3)]
#: the same beside the linear fold on the row maximum (lean_ref="max"), with and without the floor line
LINEAR_MUFU_CASES = [gluon_lean_f16_async_config("fp8", 128, 128).replace(lean_ref="max", lean_mufu=k, lean_floor=f)
                     for k, f in ((1, False), (1, True))]
#: the lean seed on the row maximum at the other head dims (128-key blocks at 192/128, one Q stage and O through the
#: P tiles at hd256), with and without MUFU pairs, as it runs on a K-major V (k_perm): docs/PERF.md session 50
LEAN_MAX_CASES = [gluon_lean_max_config("fp8", *dims).replace(k_perm=True, lean_mufu=k)
                  for dims in ((64, 64), (192, 128), (256, 256)) for k in (0, 1)]
CASES = (neighbours() + sampled(6) + LEAN_CASES + F16_CASES + HD64_CASES + HD256_CASES + MLA_CASES + THREE_CASES
         + NATURAL_CASES + SPLIT_CASES + PACKED_CASES + SMEM_CASES + SMEM2_CASES + LANE_CASES + HD96_CASES + CHUNKED_CASES
         + HALF_CASES + K_PERM_CASES + QK_ASYNC_CASES + MUFU_CASES + LINEAR_MUFU_CASES + LEAN_MAX_CASES)


def test_hd96_q_and_k_in_32_column_parts_and_o_padded_or_split(compiled):
    """Head dim 96: Q and K are three 32-column TMA copies each (the seed at hd128: one) and three
    chained k32 wgmmas into one S. O padded to 128 columns is an m64n128 PV wgmma and a 4-D output
    store per consumer (clipped at 96 columns); o_split makes it an m64n64 and an m64n32 wgmma, one
    more V^T box and two 3-D output stores."""
    ref, pad, split = compiled(GLUON), compiled(HD96), compiled(HD96_SPLIT)
    load, store3, store4 = ("cp.async.bulk.tensor.2d.shared::cluster.global", "cp.async.bulk.tensor.3d.global.shared",
                            "cp.async.bulk.tensor.4d.global.shared")
    assert pad.ptx.count(load) == ref.ptx.count(load) + 4 and split.ptx.count(load) == ref.ptx.count(load) + 5
    assert pad.ptx.count(store4) == ref.ptx.count(store3) and pad.ptx.count(store3) == 0
    assert split.ptx.count(store3) == 2 * ref.ptx.count(store3) and split.ptx.count(store4) == 0
    # QK^T: 3 of hd128's 4 k-steps; PV: the same 128 columns padded, or 64 + 32
    assert pad.ptx.count("m64n128k32") == ref.ptx.count("m64n128k32") * 7 // 8
    assert split.ptx.count("m64n128k32") == ref.ptx.count("m64n128k32") * 3 // 8
    assert split.ptx.count("m64n64k32.f32.e4m3.e4m3") == split.ptx.count("m64n32k32.f32.e4m3.e4m3") > 0


def test_192_wide_q_and_k_come_in_three_parts(compiled):
    """Tensor shapes must be powers of two: a 192-wide Q / K tile is three 64-column TMA copies and
    three chained wgmmas (6 k-steps of 32, as one 192-deep product would be)."""
    art, ref = compiled(MLA), compiled(GLUON)
    loads = len(re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::cluster\.global", art.ptx))
    assert loads == len(re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::cluster\.global", ref.ptx)) + 4
    assert art.ptx.count("m64n128k32.f32.e4m3.e4m3") == ref.ptx.count("m64n128k32.f32.e4m3.e4m3") * 60 // 48


def ahead_of_time(request) -> list[KernelConfig]:
    """The configs this module's selected tests take as parameters (a config, or a calibration row's
    changes to the seed), in test order, each once."""
    configs: list[KernelConfig] = []
    for item in request.session.items:
        if item.module is not request.module or not hasattr(item, "callspec"):
            continue
        for name, value in item.callspec.params.items():
            cfg = GLUON.replace(**value) if name == "changes" else value
            if isinstance(cfg, KernelConfig) and cfg not in configs:
                try:
                    emit(cfg)
                except ConfigError:  # (a test of what fails to emit)
                    continue
                configs.append(cfg)
    return configs


@pytest.fixture(scope="module")
def compiled(request):
    cache: dict[tuple, CompiledArtifacts] = {}
    # compiles are single-threaded and take seconds each: one process per core does them ahead of the
    # tests (spawned: a clean interpreter, no forked state)
    pool = ProcessPoolExecutor(max_workers=os.cpu_count() or 1, mp_context=multiprocessing.get_context("spawn"))
    ahead = {(cfg, True, True): pool.submit(compile_for_target, emit(cfg)) for cfg in ahead_of_time(request)}

    def get(cfg: KernelConfig, causal: bool = True, descales: bool = True) -> CompiledArtifacts:
        key = (cfg, causal, descales)
        if key not in cache:
            art = cache[key] = (ahead[key].result() if key in ahead
                                else compile_for_target(emit(cfg), causal=causal, descales=descales))
            changed = {k: v for k, v in cfg.all_fields().items() if v != getattr(GLUON, k)}
            print(f"\n  gluon {changed or 'seed'} causal={causal} descales={descales}: regs={art.registers} "
                  f"spill={art.spill_bytes} smem={art.shared_bytes} QGMMA={art.count('QGMMA')} "
                  f"USETMAXREG={art.count('USETMAXREG')} EX2={art.count('MUFU.EX2')}", end="")
        return cache[key]

    yield get
    pool.shutdown(cancel_futures=True)


def check_usable(art: CompiledArtifacts, cfg: KernelConfig) -> None:
    assert art.spill_bytes == 0, f"{cfg.to_json()} spills {art.spill_bytes} bytes"
    assert art.count("QGMMA") > 0 and art.count("HGMMA") == 0
    assert art.count("USETMAXREG") > 0, "warp-specialised kernel without setmaxnreg"
    assert art.serialised_wgmma is None, art.serialised_wgmma
    assert 0 < art.shared_bytes <= SMEM_LIMIT
    # the static estimate is exact up to barriers and swizzle alignment
    assert 0 <= gluon_smem_estimate(cfg) - art.shared_bytes <= TMA_SMEM_MARGIN


@pytest.mark.parametrize("cfg", CASES, ids=lambda c: "-".join(
    f"{k}={v}" for k, v in c.all_fields().items() if v != getattr(GLUON, k)) or "seed")
def test_space_configs_compile_cleanly(cfg, compiled):
    assert SPACE.feasible(cfg) is None
    check_usable(compiled(cfg), cfg)


def test_one_consumer_natural_v_reading_a_tile_table_spills(compiled):
    """NATURAL_V_PRODUCER_REGS' calibration row: one consumer fixes the V-transposing producer at 24
    registers, enough for round robin, 8 bytes short once it also reads the balanced tile table."""
    cfg = NATURAL_CASES[1].replace(q_order="balanced")
    assert "producer warpgroup transposes V" in SPACE.feasible(cfg)
    assert compiled(cfg).spill_bytes > 0


def test_256_key_defer_issues_the_second_part_after_the_pv_wait(compiled):
    """pv_defer with 256-key blocks: PV(j-1) and QK^T(j)'s first 128-key part are issued, the wait
    lets one group (that part) run on, then the second part is issued into the registers the P in
    flight had, and one wait for all: per step two waits, one of them leaving a group in flight."""
    cfg = gluon_wide_config("fp8", 128, 128).replace(pv_defer=True, rowsum="mma", skip_rescale=True)
    art = compiled(cfg)
    assert art.spill_bytes == 0 and art.serialised_wgmma is None
    assert "WARPGROUP.DEPBAR.LE gsb0, 0x1" in art.sass
    assert "WARPGROUP.DEPBAR.LE gsb0, 0x1" not in compiled(gluon_wide_config("fp8", 128, 128)).sass


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
    loop, ref_loop = _step_loop(art.sass), _step_loop(ref.sass)
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
    loop, ref_loop = _step_loop(art.sass), _step_loop(ref.sass)
    count = lambda body, op: sum(x.split()[0] == op or x.split()[0].startswith(op + ".") for x in body)
    k = cfg.lean_mufu
    assert count(loop, "MUFU") - count(ref_loop, "MUFU") == 32 * k
    assert count(ref_loop, "HFMA2") - count(loop, "HFMA2") == 5 * 16 * k
    assert count(loop, "F2FP") - count(ref_loop, "F2FP") <= 2  # (the rows' a2, b2 to f16)


@pytest.mark.parametrize("cfg", LINEAR_MUFU_CASES, ids=lambda c: f"mufu{c.lean_mufu}-floor{c.lean_floor}")
def test_lean_mufu_beside_the_linear_fold(cfg, compiled):
    """lean_mufu=k on the linear fold: of a thread's 64 f16 pairs per 256-key step, 16 k take two MUFU.EX2 each
    and their code by a shift off the f16 bits instead of the fold's two HFMA2 (and the floor's HFMA2 and
    HMNMX2): two HFMA2 a pair (the fold's line, unsaturated, and e = 16 t + k), no conversion (F2FP) added,
    no spills."""
    art, ref = compiled(cfg), compiled(cfg.replace(lean_mufu=0))
    check_usable(art, cfg)
    loop, ref_loop = _step_loop(art.sass), _step_loop(ref.sass)
    count = lambda body, op: sum(x.split()[0] == op or x.split()[0].startswith(op + ".") for x in body)
    k, floor = cfg.lean_mufu, cfg.lean_floor
    assert count(loop, "MUFU") - count(ref_loop, "MUFU") == 32 * k
    assert count(ref_loop, "HFMA2") - count(loop, "HFMA2") == (16 * k if floor else 0)
    assert count(ref_loop, "HMNMX2") - count(loop, "HMNMX2") == (16 * k if floor else 0)
    assert count(loop, "F2FP") - count(ref_loop, "F2FP") <= 2  # (the rows' a2, b2 to f16)


def test_lean_ref_max_drops_the_grid_and_the_floor_adds_two_operations_a_pair(compiled):
    """lean_ref="max": the row maximum is no longer rounded up to the 1/8 grid (an FRND.CEIL per row), the
    step otherwise the same instructions; lean_floor: per 256-key step a thread's 64 f16 pairs each get one more
    HFMA2 (the second line) and one HMNMX2 (the larger of the two), no spills (docs/BACKENDS.md, session 45)."""
    base = gluon_lean_f16_async_config("fp8", 128, 128)
    at_max, floor = base.replace(lean_ref="max"), base.replace(lean_ref="max", lean_floor=True)
    loops = {}
    for name, cfg in (("grid", base), ("max", at_max), ("floor", floor)):
        art = compiled(cfg)
        check_usable(art, cfg)
        loops[name] = _step_loop(art.sass)
    count = lambda body, op: sum(x.split()[0] == op or x.split()[0].startswith(op + ".") for x in body)
    assert count(loops["grid"], "FRND") > 0 and count(loops["max"], "FRND") == 0
    assert abs(len(loops["max"]) - len(loops["grid"])) <= 16
    assert count(loops["floor"], "HFMA2") - count(loops["max"], "HFMA2") == 64
    assert count(loops["floor"], "HMNMX2") - count(loops["max"], "HMNMX2") == 64


def _step_loop(sass: str) -> list[str]:
    """The instructions of the shortest loop that issues a whole step's wgmmas (QK^T's four k-steps and PV's
    eight at head dim 128, 256 keys): a consumer's steady step."""
    return min((body for body in sass_loops(sass) if sum("QGMMA" in x for x in body) >= 12), key=len)


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
    assert h.count("MUFU.EX2") - w.count("MUFU.EX2") == consumers * (64 * cfg.block_n // 2 // 128 + 2)
    per_loop = [(sum("QGMMA" in t for t in b), sum("MUFU.EX2" in t for t in b))
                for b in overlapped_step_loops(h.sass, cfg.block_n)]
    assert per_loop and per_loop == [(sum("QGMMA" in t for t in b), sum("MUFU.EX2" in t for t in b))
                                     for b in overlapped_step_loops(w.sass, cfg.block_n)]
    assert compiled(cfg, causal=False).sass == compiled(whole, causal=False).sass


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
    assert len(loops) == 2 * (cfg.block_m // 64)   # masked and unmasked steps of each consumer
    for body in loops:
        fence = next(i for i, t in enumerate(body) if "FENCE.VIEW.ASYNC" in t)
        mma = [i for i, t in enumerate(body) if "QGMMA" in t]
        assert ["64x256" in body[i] for i in mma] == [i < fence for i in mma] and sum(i < fence for i in mma) == 4
        waits = [i for i, t in enumerate(body) if "WARPGROUP.DEPBAR" in t]
        assert len(waits) == 2 and sum("STSM" in t for t in body[waits[0]:waits[1]]) == 8
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
    assert gluon_register_estimate(two) == 216 and SPACE.feasible(two) is None
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
    for op in ("QGMMA", "MUFU.EX2", "STSM"):
        assert compiled(mla).count(op) == own.count(op), op


def test_lane_sums_leave_the_row_sum_shuffles_to_the_epilogue(compiled):
    """lane_sums=True: per step, each row's sum is no longer reduced over its quad of lanes (two
    shuffles per row of each thread's two rows), only once per tile in the epilogue: the 256-key
    kernel's two step bodies (masked and not) lose 4 shuffles each."""
    wide = gluon_wide_config("fp8", 128, 128)
    before, after = compiled(wide), compiled(wide.replace(lane_sums=True))
    assert before.count("SHFL") - after.count("SHFL") == 8
    assert after.count("MUFU.EX2") == before.count("MUFU.EX2") and after.spill_bytes == 0


def test_balanced_kernel_reads_its_tile_table(compiled):
    """q_order="balanced": each role loads its loop bounds and tiles from the table (global loads the
    round-robin kernel does not have); the steps are the same code."""
    rr = compiled(GLUON.replace(q_order="heavy_first"))
    art = compiled(GLUON)
    assert art.ptx.count("ld.global") > rr.ptx.count("ld.global")
    assert art.count("QGMMA") == rr.count("QGMMA") and art.count("MUFU.EX2") == rr.count("MUFU.EX2")


def test_non_causal_and_descale_free_specialisations(compiled):
    for causal, descales in ((False, True), (True, False)):
        check_usable(compiled(GLUON, causal, descales), GLUON)
    assert compiled(GLUON, True, False).ptx != compiled(GLUON).ptx


def test_schedule_shows_in_the_sass(compiled):
    """The seed overlaps: two wgmmas in flight per step (QK^T(j), PV(j-1)) need twice the QGMMAs of
    the plain schedule; the key permutation removes the shuffles that feed P to the PV wgmma."""
    seed, plain, unpermuted = compiled(GLUON), compiled(GLUON.replace(overlap=False)), \
        compiled(GLUON.replace(v_permute=False))
    assert seed.count("QGMMA") >= 2 * plain.count("QGMMA")
    assert seed.count("SHFL") < unpermuted.count("SHFL")
    assert seed.count("F2FP.SATFINITE.E4M3") > 0  # P rounded to e4m3 next to its wgmma


#: Register calibration (Triton 3.6, compile_for_target): config changes from the seed -> spills.
#: The static estimate must reject exactly the configs that spill (the full 36-config sweep it was
#: fitted on is described in search_spaces/base.py).
CALIBRATION = [
    (dict(v_permute=False, producer_regs=56), True),           # 232 needed > 224: spills 24 B
    (dict(v_permute=False), False),                            # 232 <= 240
    (dict(block_n=256, num_stages=2), True),                   # 248 > 240: spills, wgmma serialised
    (dict(block_n=256, num_stages=2, block_m=64, ping_pong=False, q_order="heavy_first"), False),  # 248 <= 256
    (dict(block_n=256, num_stages=2, block_m=64, ping_pong=False), True),  # + its tile table: 264 > 256, 8 B
    (dict(block_n=256, num_stages=2, overlap=False, producer_regs=56), False),  # no P carried: 216
    # head dims 64 and 256 (GLUON_OTHER_DIM_REGISTERS)
    (dict(head_dim_qk=64, head_dim_v=64, block_n=256, num_stages=2), False),                     # 228 <= 240
    (dict(head_dim_qk=64, head_dim_v=64, block_n=256, num_stages=2, producer_regs=56), True),    # 228 > 224: 8 B
    (dict(head_dim_qk=256, head_dim_v=256, block_n=64, num_stages=2, producer_regs=56), False),  # 204 <= 224
    (dict(head_dim_qk=256, head_dim_v=256, block_n=64, num_stages=2, v_permute=False, producer_regs=40), False),
    (dict(head_dim_qk=256, head_dim_v=256, block_n=128, num_stages=2), True),                   # 244 > 240: 48 B
    (dict(head_dim_qk=256, head_dim_v=256, block_n=128, num_stages=2, overlap=False), False),   # 240 <= 240
    # (GLUON_WIDE_PLAIN_REGISTERS: that plain step spills below 240 per consumer, and with the row-sum MMA)
    (dict(head_dim_qk=256, head_dim_v=256, block_n=128, num_stages=2, overlap=False, ping_pong=False,
          producer_regs=40), True),                                                             # 240 > 232: 8 B
    (dict(head_dim_qk=256, head_dim_v=256, block_n=128, num_stages=2, overlap=False, rowsum="mma"), True),  # 248: 24 B
    # three consumers at 160 registers (GLUON_THREE_CONSUMER_REGISTERS)
    (dict(block_m=192, num_stages=2, ping_pong=False, overlap=False, v_permute=False), True),  # 176 > 160: 80 B
    (dict(block_m=192, block_n=64, num_stages=2), False),                                        # 152 <= 160
    # ... nor where P goes through two shared tiles with fp32 row sums (160), unless the producer takes 56
    # (152 each: 512 B); with the row-sum MMA 176: 48 B
    (dict(block_m=192, p_carry="smem2", lane_sums=True, half_block=True), False),
    (dict(block_m=192, p_carry="smem2", half_block=True, o_through_p=True, q_stages=2, num_stages=2,
          producer_regs=56), True),
    (dict(block_m=192, p_carry="smem2", half_block=True, o_through_p=True, rowsum="mma"), True),
    # 192-key blocks (128 + 64 key parts) with overlap (GLUON_SPLIT_REGISTERS): 232 <= 240; 232 > 224
    # at producer_regs=56 (40 B); without the key permutation 320
    (dict(block_n=192, num_stages=2), False),
    (dict(block_n=192, num_stages=3, q_stages=2, producer_regs=56, ex2_fence=True, skip_rescale=True), True),
    (dict(block_n=192, num_stages=2, v_permute=False), True),
    # three consumers need them without overlap too (hd64, 176 > 160: 80 B)
    (dict(head_dim_qk=64, head_dim_v=64, block_m=192, block_n=192, num_stages=4, overlap=False), True),
    # 192/128 (GLUON_MLA_MMA_REGISTERS): one consumer, 256-key blocks, overlap; the row-sum MMA tips it
    (dict(head_dim_qk=192, block_m=64, ping_pong=False, block_n=256, num_stages=2, q_order="heavy_first"),
     False),                                                                                           # 248
    (dict(head_dim_qk=192, block_m=64, ping_pong=False, block_n=256, num_stages=2), True),  # table: 264, 8 B
    (dict(head_dim_qk=192, block_m=64, ping_pong=False, block_n=256, num_stages=2, rowsum="mma",
          q_order="heavy_first"), True),                                                               # 264
    # pv_defer: P(j-1) in flight under QK^T(j) like overlap's carried P (session 6)
    (dict(overlap=False, pv_defer=True), False),                                                           # 168
    (dict(block_n=192, num_stages=3, ping_pong=False, overlap=False, pv_defer=True, rowsum="mma"), False),  # 208
    # 256 keys: two 128-key parts, the second QK^T after the PV wait, O rescaled in place
    # (GLUON_SPLIT_DEFER_REGISTERS)
    (dict(block_n=256, num_stages=2, ping_pong=False, q_stages=2, overlap=False, pv_defer=True), False),   # 224
    (dict(block_n=256, num_stages=2, ping_pong=False, q_stages=2, overlap=False, pv_defer=True, skip_rescale=True,
          rowsum="mma"), False),                                                                           # 240
    (dict(block_n=256, num_stages=2, ping_pong=False, q_stages=2, overlap=False, pv_defer=True, skip_rescale=True,
          rowsum="mma", producer_regs=40), True),                                                          # 240 > 232: 16 B
    (dict(head_dim_qk=256, head_dim_v=256, block_n=128, num_stages=2, overlap=False, pv_defer=True), False),  # 232
    (dict(head_dim_qk=256, head_dim_v=256, block_n=128, num_stages=2, overlap=False, pv_defer=True,
          rowsum="mma"), True),                                                                 # 248 > 240: 32 B
    (dict(head_dim_qk=256, head_dim_v=256, block_n=128, num_stages=2, overlap=False, pv_defer=True,
          producer_regs=56), True),                                                             # 232 > 224: 128 B
    # head dim 96: padded O (128 columns) at three consumers; O in two parts (o_split) at three
    # consumers with P packed or not (GLUON_SPLIT_O_F32_THREE_REGISTERS), 256-key overlapped blocks
    (dict(head_dim_qk=96, head_dim_v=96, block_m=192, p_carry="e4m3"), True),                # 192 > 160: 152 B
    (dict(head_dim_qk=96, head_dim_v=96, o_split=True, block_m=192, p_carry="e4m3"), False),            # 152
    (dict(head_dim_qk=96, head_dim_v=96, o_split=True, block_m=192, ping_pong=False), True),  # 168: 24 B
    (dict(head_dim_qk=96, head_dim_v=96, o_split=True, block_n=256, num_stages=2, p_carry="e4m3"), False),  # 232
    (dict(head_dim_qk=96, head_dim_v=96, o_split=True, block_m=192, overlap=False, rowsum="mma", num_stages=4),
     False),                                                                                          # 136
    (dict(head_dim_qk=96, head_dim_v=96, o_split=True, block_m=192, overlap=False, v_permute=False, rowsum="mma",
          num_stages=4), True),                                                                       # 168: 8 B
    # two P tiles at 256 keys (no P in registers: 216) with the row-sum MMA (GLUON_TWO_TILE_MMA_REGISTERS),
    # exact and lean
    (dict(block_n=256, num_stages=2, ping_pong=False, q_stages=2, p_carry="smem2"), False),              # 216
    (dict(block_n=256, num_stages=2, ping_pong=False, p_carry="smem2", rowsum="mma"), True),  # 248: 48 B
    (dict(block_n=256, num_stages=2, ping_pong=False, p_carry="smem2", softmax="lean", rowsum="mma"), True),  # 32 B
    # lean P summing its decoded codes per lane instead (no row-sum MMA): fits, with and without ping-pong
    (dict(block_n=256, num_stages=2, ping_pong=False, p_carry="smem2", softmax="lean", rowsum="rounded",
          lane_sums=True, half_block=True), False),
    (dict(block_n=256, num_stages=2, q_stages=2, p_carry="smem2", softmax="lean", rowsum="rounded", lane_sums=True,
          producer_regs=56, skip_rescale=True, p_scale_log2=7), False),
    # and at hd256 on 128-key blocks with the output through the P tiles (the same 192 registers of
    # accumulator and scores; without ping-pong 8 bytes spilled too, left to the compile check)
    (dict(head_dim_qk=256, head_dim_v=256, num_stages=2, p_carry="smem2", o_through_p=True, lane_sums=True),
     False),                                                                                          # 228
    (dict(head_dim_qk=256, head_dim_v=256, num_stages=2, p_carry="smem2", o_through_p=True, rowsum="mma",
          late_rescale=True), True),                                                           # 260: 32 B
]


@pytest.mark.parametrize("changes,spills", CALIBRATION, ids=lambda x: str(x))
def test_register_estimate_calibration(changes, spills, compiled):
    cfg = GLUON.replace(**changes)
    art = compiled(cfg)
    assert (art.spill_bytes > 0) == spills
    reason = gluon_infeasibility(cfg)
    assert (reason is not None) == spills, reason
    if spills:
        assert reason.startswith("registers") and str(gluon_register_estimate(cfg)) in reason


def test_serialised_wgmma_is_a_compile_error(compiled, monkeypatch):
    """ptxas serialises the wgmmas of the 256-key overlapped kernel (C7512, the register-pressure
    sibling of C7514): the artifact reports it and the runners' compile check rejects the kernel
    even where it would not spill."""
    from zyfa_tune.tuning import runners

    cfg = GLUON.replace(block_n=256, num_stages=2)
    art = compiled(cfg)
    assert art.serialised_wgmma is not None and "wgmma.mma_async instructions are serialized" in art.serialised_wgmma
    assert compiled(GLUON).serialised_wgmma is None
    no_spill = dataclasses.replace(art, spill_bytes=0)
    monkeypatch.setattr("zyfa_tune.generator.build.compile_for_target", lambda *a, **k: no_spill)
    check = runners._compile_check(cfg, True)
    assert check.error.startswith("ptxas serialises the wgmmas: ") and "serialized" in check.error


# ---- loops of the SASS ----------------------------------------------------------------------------

_SASS_LINE = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(.*?)\s*;", re.M)


def sass_loops(sass: str, innermost: bool = False) -> list[list[str]]:
    """Bodies (instruction texts) of the loops in `sass`, one per backward branch, from its target
    to the branch; `innermost`: only those with no backward branch inside."""
    ins = [(int(a, 16), text) for a, text in _SASS_LINE.findall(sass)]
    back = [(a, int(m.group(1), 16)) for a, t in ins
            if (m := re.search(r"\bBRA (0x[0-9a-f]+)", t)) and int(m.group(1), 16) < a]
    return [[t for a, t in ins if target <= a <= addr] for addr, target in back
            if not (innermost and any(target <= a < addr for a, _ in back))]


# ---- rows past the queries' end ------------------------------------------------------------------

def pass_loops(sass: str) -> int:
    """Loops that wait on stages and release them (SYNCS) with no wgmma, TMA load or exponential:
    a consumer passing a tile's K/V stages on (_pass_blocks)."""
    return sum(not any(op in t for t in body for op in ("QGMMA", "UTMALDG", "MUFU"))
               and sum("SYNCS.ARRIVE" in t for t in body) >= 2 for body in sass_loops(sass))


@pytest.mark.parametrize("cfg,consumers", [
    (gluon_wide_config("fp8", 128, 128), 2),     # two consumer warpgroups, no ping-pong
    (gluon_three_config("fp8", 64, 64), 3),      # three (192-row tiles: 4096 = 21 x 192 + 64)
    (GLUON, 0),                                  # ping-pong: the turns need every consumer's wgmmas
], ids=["wide", "three-hd64", "ping-pong"])
def test_consumers_past_the_end_only_pass_their_blocks_on(cfg, consumers, compiled):
    """A consumer whose 64 rows all lie past the queries' end (the partial last block of a tile)
    computes nothing: it waits for each of the tile's K / V stages and releases it, so that the
    producer's count of releases stays whole. One such loop per consumer, none with ping-pong. (On the
    GPU, the three-consumer cases at 1000 and 4096 tokens run it: tests/test_gpu_gluon.py.)"""
    assert pass_loops(compiled(cfg).sass) == consumers


# ---- ex2_fence: every exponential of an overlapped step issues before its PV wait ------------------

def overlapped_step_loops(sass: str, block_n: int, mmas: int | None = None) -> list[list[str]]:
    """The bodies of the consumers' overlapped-step loops (masked and unmasked, every consumer): the
    backward branches whose body issues QK^T(j) (4 QGMMA over head dim 128) and PV(j-1) (block_n / 32)
    and the step's exponentials; `mmas`: another count of QGMMA per step."""
    return [body for body in sass_loops(sass)
            if sum("QGMMA" in t for t in body) == (mmas or 4 + block_n // 32)
            and sum("MUFU.EX2" in t for t in body) >= block_n // 2]


def exponentials_after_pv_wait(body: list[str]) -> int:
    """MUFU.EX2 after the step's last wgmma wait(0) (WARPGROUP.DEPBAR.LE gsb0, 0x0): exponentials
    that ptxas scheduled after the PV wait, i.e. not under the PV wgmma."""
    waits = [i for i, t in enumerate(body) if re.search(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x0$", t)]
    assert waits, "no PV wait in the loop"
    return sum("MUFU.EX2" in t for t in body[waits[-1] + 1:])


@pytest.mark.parametrize("changes,causal", [
    ({}, True), ({}, False), (dict(p_scale_log2=0), True), (dict(block_n=64), True),
    (dict(block_m=64, ping_pong=False), True), (dict(v_permute=False), True), (dict(producer_regs=56), True),
], ids=lambda x: str(x))
def test_ex2_fence_puts_every_exponential_before_the_pv_wait(changes, causal, compiled):
    """ptxas hoists the PV wait above part of the softmax's exponentials (docs/BACKENDS.md, limit 5);
    ex2_fence (a barrier on the row sums right before the wait) keeps all of them before it, in every
    overlapped loop of every consumer, at a few instructions per step, without spills or serialised
    wgmmas."""
    plain_cfg = GLUON.replace(**changes)
    cfg = plain_cfg.replace(ex2_fence=True)
    plain, fenced = compiled(plain_cfg, causal), compiled(cfg, causal)
    check_usable(fenced, cfg)
    consumers, exps = cfg.block_m // 64, cfg.block_n // 2 + 2   # P and the two rows' rescale factors
    plain_loops, fenced_loops = (overlapped_step_loops(a.sass, cfg.block_n) for a in (plain, fenced))
    assert len(fenced_loops) == len(plain_loops) == 2 * consumers   # masked and unmasked steps
    print(f"\n  EX2 after the PV wait, off -> on: {[exponentials_after_pv_wait(b) for b in plain_loops]} -> "
          f"{[exponentials_after_pv_wait(b) for b in fenced_loops]} (of {exps}); instructions per step "
          f"{[len(b) for b in plain_loops]} -> {[len(b) for b in fenced_loops]}", end="")
    for body, plain_body in zip(fenced_loops, plain_loops):
        assert sum("MUFU.EX2" in t for t in body) == exps
        assert exponentials_after_pv_wait(body) == 0
        assert sum("BAR.RED.AND" in t for t in body) == 1
        assert len(body) - len(plain_body) <= 8
    if not changes and causal:  # the seed without the fence: ptxas's hoisting that the field undoes
        assert sum(exponentials_after_pv_wait(b) for b in plain_loops) > 0


@pytest.mark.parametrize("changes", [dict(), dict(block_n=192, num_stages=3, ping_pong=False, rowsum="mma"),
                                     dict(block_n=256, num_stages=2, q_stages=2, ping_pong=False, rowsum="mma",
                                          skip_rescale=True)],
                         ids=lambda x: str(x))
def test_pv_defer_pairs_the_products_and_waits_once(changes, compiled):
    """pv_defer: in every step loop QK^T(j) and PV(j-1) are issued in one burst, then one wait(0),
    and every exponential of the step comes after it (the softmax is not under an MMA, unlike
    overlap); no spills, no serialised wgmmas. With two key parts (192, 256 keys) PV(j-1) goes first
    and one wait inside the burst lets QK^T(j)'s first part run on (gsb0 <= 1) before the second."""
    cfg = GLUON.replace(overlap=False, pv_defer=True, **changes)
    art = compiled(cfg)
    check_usable(art, cfg)
    parts = 2 if emit_gluon.key_parts(cfg)[1] else 1
    qk = 4 * parts                                  # hd128: 4 k-steps per key part
    loops = overlapped_step_loops(art.sass, cfg.block_n, qk + cfg.block_n // 32 * (2 if cfg.rowsum == "mma" else 1))
    assert len(loops) == 2 * (cfg.block_m // 64)   # masked and unmasked steps of each consumer
    for body in loops:
        mma = [i for i, t in enumerate(body) if "QGMMA" in t]
        waits = [i for i, t in enumerate(body) if "WARPGROUP.DEPBAR" in t]
        inside = [w for w in waits if mma[0] < w < mma[-1]]
        if parts == 1:
            assert not inside                      # one burst of wgmmas
        else:
            assert len(inside) == 1 and body[inside[0]].endswith("gsb0, 0x1")
            assert sum("QGMMA" in t for t in body[inside[0]:]) == 4  # the second part's k-steps
        assert exponentials_after_pv_wait(body) == sum("MUFU.EX2" in t for t in body)


def test_ex2_fence_barriers_are_not_triton_s(compiled):
    """The fence's named barriers (15 for consumer 0, 14 for consumer 1) are none of the ones Triton
    gives the partitions."""
    ptx = compiled(GLUON.replace(ex2_fence=True)).ptx
    triton_ids = {int(i) for i in re.findall(r"\bbar(?:rier)?\.sync\s+(\d+)", ptx)}
    assert triton_ids and not triton_ids & {14, 15}
    assert {int(i) for i in re.findall(r"\bbar\.red\.and\.pred\s+\w+,\s*(\d+)", ptx)} == {14, 15}


@pytest.mark.parametrize("cfg", LEAN_CASES, ids=lambda c: f"{c.lean_fold}-{c.lean_clamp}-{c.lean_pack}-pp{c.ping_pong}")
def test_lean_p_has_no_exponentials_per_score(cfg, compiled):
    """Lean P: the loop's MUFU.EX2 are the per-row rescale factors only (the exact seed has one per
    score: 396), the codes are packed by byte moves, the row sum is an extra m64n8 FP8 wgmma per
    PV, and the ones tile is written as whole words (a 2-D e4m3 store became stmatrix.b16 and left
    half the bytes unwritten: the bug the GPU test found)."""
    art = compiled(cfg)
    exact = compiled(GLUON)
    check_usable(art, cfg)
    assert art.count("MUFU.EX2") <= 16 < exact.count("MUFU.EX2")
    clamp = {"imax": "max.s32 r0, r0, 1262485504;", "fmax": "max.f32 r0, r0, 0f4B400000;",
             "sat": "fma.rn.f32 r0, r0, 0f43000000, 0f4B400000;"}[cfg.lean_clamp]
    packs = art.ptx.count(clamp)  # one per pack of four scores
    assert packs > 0 and art.ptx.count("prmt.b32 r0" if cfg.lean_pack == "prmt" else "bfi.b32 r0") >= packs
    assert art.ptx.count("m64n8k32.f32.e4m3.e4m3") == art.ptx.count("m64n128k32.f32.e4m3.e4m3") // 2
    assert re.search(r"st\.shared\.v\d\.b32\s+\[[^\]]+\], \{943208504, 943208504", art.ptx)  # 0x38383838


#: lean P's row sum from its packed codes (rowsum="rounded"): in registers per row, through two shared
#: tiles per lane (the 256-key two-tile kernel)
CODE_SUM_CASES = [GLUON.replace(softmax="lean", rowsum="rounded", p_carry="e4m3"),
                  gluon_smem2_config("fp8", 128, 128).replace(softmax="lean", rowsum="rounded", q_stages=1)]


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
    assert unpacks == art.ptx.count("cvt.rn.f16x2.e4m3x2") and unpacks % (cfg.block_n // 4) == 0
    assert unpacks >= 2 * (cfg.block_n // 4) and art.count("HADD2") >= unpacks
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
    assert clamps >= 2 * (base.block_n // 2) and art.count("FFMA.SAT") == clamps
    assert art.count("FFMA") - art.count("FFMA.SAT") >= imax.count("FFMA")  # (centered: b by an FFMA per row)
    assert art.count("QGMMA") == imax.count("QGMMA")


#: the hd128 study's winner schedule (ping-pong off, Q ring of 2), exact softmax
WINNER = GLUON.replace(ping_pong=False, q_stages=2)


@pytest.mark.parametrize("cfg", [GLUON.replace(rowsum="mma"), WINNER.replace(rowsum="mma"),
                                 WINNER.replace(rowsum="mma", overlap=False, block_m=64, block_n=64)],
                         ids=["seed", "winner", "plain"])
def test_exact_rowsum_mma_replaces_the_row_sum_adds(cfg, compiled):
    """rowsum="mma" under exact softmax: the float32 row sum (one FADD per score) is gone, an m64n8
    FP8 wgmma per PV sums the e4m3-rounded probabilities instead; the exponentials stay."""
    art, ref = compiled(cfg), compiled(cfg.replace(rowsum="fp32"))
    check_usable(art, cfg)
    assert art.count("MUFU.EX2") == ref.count("MUFU.EX2")
    scores = ref.count("MUFU.EX2") - 12 if cfg.overlap else 0  # 12: the rows' rescale factors
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
    rescale = 12  # one MUFU.EX2 per row statistic update, not per score
    per_score = ref.count("MUFU.EX2") - rescale
    assert art.count("MUFU.EX2") == rescale + per_score * (8 - share) // 8
    assert art.count("FFMA") >= ref.count("FFMA") + degree * per_score * share // 8


def test_three_consumers_load_q_in_64_row_boxes(compiled):
    """block_m=192: TMA boxes must be powers of two, so the producer loads a Q tile as three 64-row
    boxes (one per consumer) where two consumers take one 128-row box; three consumer partitions and
    the producer each set their registers (setmaxnreg)."""
    three, two = compiled(THREE_CASES[0]), compiled(HD64)
    loads = r"cp\.async\.bulk\.tensor\.2d\.shared::cluster\.global"
    assert len(re.findall(loads, three.ptx)) == len(re.findall(loads, two.ptx)) + 2
    assert three.ptx.count("setmaxnreg") > two.ptx.count("setmaxnreg")


@pytest.mark.parametrize("cfg", [WINNER, HD64.replace(ping_pong=False), HD256.replace(ping_pong=False)],
                         ids=["hd128", "hd64", "hd256"])
def test_skip_rescale_branches_around_the_multiplies(cfg, compiled):
    """skip_rescale: each of the three rescale sites of each consumer becomes a warp vote and a
    uniform branch over the same FMULs (none removed, none added: the O registers are tied)."""
    art, ref = compiled(cfg.replace(skip_rescale=True)), compiled(cfg)
    check_usable(art, cfg)
    consumers = cfg.block_m // 64
    assert art.count("VOTE.ANY") - ref.count("VOTE.ANY") == 3 * consumers
    assert art.count("FMUL") == ref.count("FMUL")
    assert art.ptx.count("vote.sync.any.pred") == 3 * consumers and art.ptx.count("bra.uni") >= 3 * consumers


def test_rescale_asm_text():
    from zyfa_tune.generator.asm.rescale import rescale_asm, rescale_constraints

    text = rescale_asm(8)
    assert "setp.ne.f32 p, $16, 0f3F800000;" in text and "setp.ne.or.f32 p, $18, 0f3F800000, p;" in text
    assert text.count("mul.f32") == 8 and "mul.f32 $7, $7, $23;" in text
    assert rescale_constraints(8).split(",") == ["=r"] * 8 + [str(i) for i in range(8)] + ["r"] * 8
    for bad in (0, 6, 8.0, True):
        with pytest.raises(ValueError, match="multiple of 4"):
            rescale_asm(bad)
    always = rescale_asm(8, skip=False)  # in place, no test or branch: a 256-key pv_defer block's rescale
    assert always.count("mul.f32") == 8 and "vote" not in always and "bra" not in always and "SKIP" not in always


def test_natural_v_is_transposed_by_the_producer(compiled):
    """v_layout="natural": V's (keys, dim) tile arrives by TMA and the producer warpgroup writes its
    transpose into the V^T ring: shared loads, byte permutes and shared stores the twin reading the
    V^T copy does not have, the consumers' wgmmas unchanged. At producer_regs=24 the producer spills,
    which the static check rejects."""
    natural = NATURAL_CASES[0]
    art, twin = compiled(natural), compiled(natural.replace(v_layout="transposed"))
    assert art.count("QGMMA") == twin.count("QGMMA")
    for op in ("LDS", "STS", "PRMT"):
        assert art.count(op) > twin.count(op), op
    assert art.ptx.count("bar.sync") > twin.ptx.count("bar.sync")  # the producer's join before its arrive
    starved = natural.replace(producer_regs=24)
    assert "transposes V" in gluon_infeasibility(starved)
    assert compiled(starved).spill_bytes > 0
    # one consumer keeps producer_regs at 24: fine with 128-key blocks, not with 256
    one = NATURAL_CASES[1].replace(block_n=256, num_stages=2)
    assert "transposes V" in gluon_infeasibility(one) and compiled(one).spill_bytes > 0
    wide = HD256.replace(block_m=64, ping_pong=False, v_permute=False, v_layout="natural", overlap=False)
    assert "transposes V" in gluon_infeasibility(wide) and compiled(wide).spill_bytes > 0


@pytest.mark.parametrize("cfg", K_PERM_CASES, ids=lambda c: c.to_json()[-60:])
def test_k_perm_loads_k_in_5d_boxes_and_leaves_the_step_alone(cfg, compiled):
    """k_perm: every K copy is a 5-D TMA box (Q's stay 2-D), the twin's 2-D K copies are gone, and the
    consumers' code is the twin's but for the masked steps' key indices: as many QGMMAs, the same registers,
    no spills, nothing serialised."""
    art, twin = compiled(cfg), compiled(cfg.replace(k_perm=False))
    copy = r"cp\.async\.bulk\.tensor\.{}d\.shared::cluster\.global"
    k_copies = len(re.findall(copy.format(5), art.ptx))  # (per K part and box; Triton may repeat a site)
    assert k_copies >= (2 if cfg.block_n == 192 else 1) * (cfg.head_dim_qk // emit_gluon.qk_part_width(cfg))
    assert len(re.findall(copy.format(2), twin.ptx)) == len(re.findall(copy.format(2), art.ptx)) + k_copies
    assert "UTMALDG.5D" in art.sass and "UTMALDG.5D" not in twin.sass
    assert art.count("QGMMA") == twin.count("QGMMA") and art.registers == twin.registers
    assert art.spill_bytes == 0 and art.serialised_wgmma is None


def _issue_order(art: CompiledArtifacts) -> str:
    """The step loop's wgmmas and waits in order: 'h' an f16-accumulator QGMMA (QK^T), 'f' a float32 one (PV), 'w'
    a wait. The step loop: the shortest loop holding both kinds."""
    loop = min((b for b in sass_loops(art.sass) if any("QGMMA" in x and ".F16." in x for x in b)
                and any("QGMMA" in x and ".F32." in x for x in b)), key=len)
    return "".join("h" if "QGMMA" in x and ".F16." in x else "f" if "QGMMA" in x else "w"
                   for x in loop if "QGMMA" in x or "WARPGROUP.DEPBAR" in x)


@pytest.mark.parametrize("cfg", QK_ASYNC_CASES,
                         ids=lambda c: f"hd{c.head_dim_qk}-{c.lean_fold}-p{c.producer_regs}{'-kperm' * c.k_perm}")
def test_qk_async_issues_pv_behind_the_f16_qk_without_waiting(cfg, compiled):
    """qk_async: in the step loop the f16 QK^T(j) QGMMAs are followed by PV(j-1)'s with no wait between (the
    twin waits for QK^T first), then one wait for QK^T and, at the end, one for PV: the float32-score kernels'
    order. The same QGMMAs and instructions otherwise (the split only moves), no spill, nothing serialised."""
    art, twin = compiled(cfg), compiled(cfg.replace(qk_async=False))
    order, twin_order = _issue_order(art), _issue_order(twin)
    qk, pv = twin_order.count("h"), twin_order.count("f")
    assert twin_order == "h" * qk + "w" + "f" * pv + "w" * (len(twin_order) - qk - pv - 1), twin_order
    assert order == "h" * qk + "f" * pv + "w" * (len(order) - qk - pv) and order.count("w") >= 1, order
    assert twin.ptx.count("wgmma.wait_group.sync.aligned 0") - art.ptx.count("wgmma.wait_group.sync.aligned 0") >= 2
    assert art.count("QGMMA") == twin.count("QGMMA") and art.spill_bytes == 0 and art.serialised_wgmma is None


def test_192_key_blocks_come_in_two_parts(compiled):
    """block_n=192: tensor shapes must be powers of two, so K and V^T come as a 128-key and a 64-key
    TMA box each (two more copies per block than the 128-key twin), QK^T and PV are two wgmmas each
    (m64n128 and m64n64; PV k=128 then k=64), and nothing serialises the wgmmas (C7514)."""
    split = SPLIT_CASES[0]
    art, twin = compiled(split), compiled(split.replace(block_n=128))
    loads = r"cp\.async\.bulk\.tensor\.2d\.shared::cluster\.global"
    assert len(re.findall(loads, art.ptx)) == len(re.findall(loads, twin.ptx)) + 2
    assert "m64n64k32.f32.e4m3.e4m3" in art.ptx and "m64n64k32.f32.e4m3.e4m3" not in twin.ptx
    assert art.serialised_wgmma is None and art.spill_bytes == 0
    with pytest.raises(ConfigError, match="block_n=192"):
        split.replace(softmax="lean", rowsum="mma")


def test_named_turn_barriers_replace_the_mbarrier_turns(compiled):
    """turn_barrier="named": the consumers take turns on hardware named barriers 8.. (bar.sync on
    their own, bar.arrive on the next one's, 256 threads: FA3's warp scheduler barrier) instead of
    mbarrier waits; two consumers use barriers 8 and 9, three 8-10; nothing else changes."""
    sync, arrive = r"BAR\.SYNC(?:\.DEFER_BLOCKING)? 0x([0-9a-f]+), 0x100", r"BAR\.ARV 0x([0-9a-f]+), 0x100"
    art, ref = compiled(GLUON.replace(turn_barrier="named")), compiled(GLUON)
    check_usable(art, GLUON)
    assert re.findall(sync, ref.sass) == [] and re.findall(arrive, ref.sass) == []
    assert set(re.findall(sync, art.sass)) == {"8", "9"} and set(re.findall(arrive, art.sass)) == {"8", "9"}
    waits = r"mbarrier\.try_wait"
    assert len(re.findall(waits, art.ptx)) < len(re.findall(waits, ref.ptx))
    assert art.count("QGMMA") == ref.count("QGMMA")
    three = compiled(THREE_CASES[0].replace(turn_barrier="named"))
    assert set(re.findall(arrive, three.sass)) == {"8", "9", "a"}
    with pytest.raises(ConfigError, match="turn_barrier='named'"):
        GLUON.replace(ping_pong=False, turn_barrier="named")


def test_ex2_fence_barrier_per_consumer_of_three(compiled):
    """ex2_fence's bar.red is over one warpgroup's 128 threads, so each consumer needs its own named
    barrier: 15, 14 and, with three consumers, 13 (two sharing one would let their threads mix)."""
    art = compiled(THREE_CASES[0].replace(ping_pong=False, ex2_fence=True))
    assert set(re.findall(r"bar\.red\.and\.pred q, (\d+), 128", art.ptx)) == {"13", "14", "15"}
    assert art.spill_bytes == 0


@pytest.mark.parametrize("cfg", [GLUON.replace(rowsum="mma"),
                                 GLUON.replace(block_n=192, num_stages=3, ping_pong=False, skip_rescale=True,
                                               rowsum="mma")], ids=["128", "192"])
def test_ex2_fence_with_the_row_sum_mma_ors_the_probabilities(cfg, compiled):
    """With rowsum="mma" ptxas puts (nearly) every exponential after the PV wait; ex2_fence then ORs
    all of a thread's probabilities into the predicate of its barrier (one per key part), which puts
    every exponential before the wait, at about 0.7 instruction per score, without spills."""
    fenced_cfg = cfg.replace(ex2_fence=True)
    plain, fenced = compiled(cfg), compiled(fenced_cfg)
    check_usable(fenced, fenced_cfg)
    exps = (64 * cfg.block_n) // 128 + 2   # P and the two rows' rescale factors
    loops = [(b, p) for b, p in zip(overlapped_loops(fenced.sass, exps), overlapped_loops(plain.sass, exps))]
    assert len(loops) == 2 * cfg.block_m // 64  # masked and unmasked steps, every consumer
    for body, plain_body in loops:
        assert exponentials_after_pv_wait(plain_body) >= exps - 8
        assert exponentials_after_pv_wait(body) == 0
        assert sum("BAR.RED.AND" in t for t in body) == (2 if cfg.block_n == 192 else 1)
        assert len(body) - len(plain_body) <= cfg.block_n // 2 * 3 // 4 + 8
    lean = GLUON.replace(softmax="lean", rowsum="mma", ex2_fence=True)  # lean P: fences its FMA outputs
    check_usable(compiled(lean), lean)


def overlapped_loops(sass: str, exps: int) -> list[list[str]]:
    """Bodies of the innermost loops (no backward branch inside) with exactly `exps` MUFU.EX2 and a
    wgmma wait: the overlapped steps, masked and unmasked, of every consumer."""
    return [body for body in sass_loops(sass, innermost=True)
            if sum("MUFU.EX2" in t for t in body) == exps and any("WARPGROUP.DEPBAR" in t for t in body)]


def test_fence_asm_text():
    from zyfa_tune.generator.asm.fence import fence_barrier, p_fence_asm, p_fence_constraints, row_sum_fence_asm

    assert [fence_barrier(k) for k in range(3)] == [15, 14, 13]
    rows = row_sum_fence_asm(14)
    assert "bar.red.and.pred q, 14, 128, p;" in rows and "setp.geu.and.f32 p, $3, 0f00000000, p;" in rows
    with pytest.raises(ValueError):
        fence_barrier(3)

    text = p_fence_asm(8, 15)
    ors = re.findall(r"(?:lop3\.b32|or\.b32) acc, ([^;]*);", text)
    operands = {op.strip() for line in ors for op in line.split(",")} - {"acc", "0xFE"}
    assert operands == {f"${k}" for k in range(8, 16)}  # every input register is read
    assert "bar.red.and.pred q, 15, 128, p;" in text and "setp.ne.b32 p, acc, 0;" in text
    assert p_fence_constraints(4).split(",") == ["=r"] * 4 + ["0", "1", "2", "3"]
    for n, barrier in ((2, 15), (7, 15), (8, 12), (8.0, 15), (8, True)):
        with pytest.raises(ValueError):
            p_fence_asm(n, barrier)


@pytest.mark.parametrize("cfg", PACKED_CASES[:4], ids=("seed", "192/128", "hd64-three", "192-keys"))
def test_packed_p_carry_rounds_once_and_moves_no_bytes(cfg, compiled):
    """p_carry="e4m3": P is rounded where the softmax makes it, four keys per register, and the PV
    wgmma reads a copy of those registers (one LOP3 each: the copy keeps ptxas from writing the next
    step's P into registers an in-flight wgmma reads, which would serialise every wgmma). The float32
    twin moves bytes into place (PRMT); the packed kernel has none, and the same conversions and
    exponentials."""
    art, twin = compiled(cfg), compiled(cfg.replace(p_carry="f32"))
    check_usable(art, cfg)
    assert twin.count("PRMT") > 0 and art.count("PRMT") == 0
    assert art.count("F2FP") == twin.count("F2FP") and art.count("MUFU.EX2") == twin.count("MUFU.EX2")
    copies = len(re.findall(r"LOP3\.LUT R\d+, R(\d+), R\1, R\1, 0xf0", art.sass))
    assert copies == twin.count("PRMT")  # one register copy where the twin had one byte move
