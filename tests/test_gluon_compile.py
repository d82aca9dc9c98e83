"""Gluon kernels compiled for sm_90a on the CPU (generator.build.compile_for_target): the search
space's Gluon seed, every one-field variant of it and a sample of the space compile without spills,
issue FP8 warpgroup MMAs (QGMMA), rebalance registers per role (setmaxnreg), keep their wgmmas
overlapped (no ptxas C7514-style serialisation) and fit the shared-memory estimate; the tile shapes
(head dims, key parts, consumers, V as given, K relabelled) show in the TMA copies and wgmmas; the
register estimate's calibration; the runners' compile check rejects serialised wgmmas.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
from gluon_cases import GLUON, SPACE
from gluon_compile import (
    CASES,
    HD64,
    HD96,
    HD96_SPLIT,
    HD256,
    K_PERM_CASES,
    MLA,
    NATURAL_CASES,
    SPLIT_CASES,
    THREE_CASES,
    check_usable,
    compile_each_once,
    pass_loops,
)

from zyfa_tune.generator import ConfigError
from zyfa_tune.generator.gluon_sm90 import emit as emit_gluon
from zyfa_tune.search_spaces import gluon_register_estimate
from zyfa_tune.search_spaces.resources import gluon_infeasibility
from zyfa_tune.search_spaces.seeds import gluon_three_config, gluon_wide_config

compiled_fixture = pytest.fixture(scope="module", name="compiled")(compile_each_once)


@pytest.mark.parametrize(
    "cfg",
    CASES,
    ids=lambda c: "-".join(f"{k}={v}" for k, v in c.all_fields().items() if v != getattr(GLUON, k)) or "seed",
)
def test_space_configs_compile_cleanly(cfg, compiled):
    assert SPACE.feasible(cfg) is None
    check_usable(compiled(cfg), cfg)


def test_non_causal_and_descale_free_specialisations(compiled):
    for causal, descales in ((False, True), (True, False)):
        check_usable(compiled(GLUON, causal, descales), GLUON)
    assert compiled(GLUON, True, False).ptx != compiled(GLUON).ptx


def test_schedule_shows_in_the_sass(compiled):
    """The seed overlaps: two wgmmas in flight per step (QK^T(j), PV(j-1)) need twice the QGMMAs of
    the plain schedule; the key permutation removes the shuffles that feed P to the PV wgmma."""
    seed, plain, unpermuted = (
        compiled(GLUON),
        compiled(GLUON.replace(overlap=False)),
        compiled(GLUON.replace(v_permute=False)),
    )
    assert seed.count("QGMMA") >= 2 * plain.count("QGMMA")
    assert seed.count("SHFL") < unpermuted.count("SHFL")
    assert seed.count("F2FP.SATFINITE.E4M3") > 0  # P rounded to e4m3 next to its wgmma


def test_balanced_kernel_reads_its_tile_table(compiled):
    """q_order="balanced": each role loads its loop bounds and tiles from the table (global loads the
    round-robin kernel does not have); the steps are the same code."""
    rr = compiled(GLUON.replace(q_order="heavy_first"))
    art = compiled(GLUON)
    assert art.ptx.count("ld.global") > rr.ptx.count("ld.global")
    assert art.count("QGMMA") == rr.count("QGMMA") and abs(art.count("MUFU.EX2") - rr.count("MUFU.EX2")) <= 4


def test_hd96_q_and_k_in_32_column_parts_and_o_padded_or_split(compiled):
    """Head dim 96: Q and K are three 32-column TMA copies each (the seed at hd128: one) and three
    chained k32 wgmmas into one S. O padded to 128 columns is an m64n128 PV wgmma and a 4-D output
    store per consumer (clipped at 96 columns); o_split makes it an m64n64 and an m64n32 wgmma, one
    more V^T box and two 3-D output stores."""
    ref, pad, split = compiled(GLUON), compiled(HD96), compiled(HD96_SPLIT)
    load, store3, store4 = (
        "cp.async.bulk.tensor.2d.shared::cluster.global",
        "cp.async.bulk.tensor.3d.global.shared",
        "cp.async.bulk.tensor.4d.global.shared",
    )
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


def test_three_consumers_load_q_in_64_row_boxes(compiled):
    """block_m=192: TMA boxes must be powers of two, so the producer loads a Q tile as three 64-row
    boxes (one per consumer) where two consumers take one 128-row box; three consumer partitions and
    the producer each set their registers (setmaxnreg)."""
    three, two = compiled(THREE_CASES[0]), compiled(HD64)
    loads = r"cp\.async\.bulk\.tensor\.2d\.shared::cluster\.global"
    assert len(re.findall(loads, three.ptx)) == len(re.findall(loads, two.ptx)) + 2
    assert three.ptx.count("setmaxnreg") > two.ptx.count("setmaxnreg")


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


def test_one_consumer_natural_v_reading_a_tile_table_spills(compiled):
    """NATURAL_V_PRODUCER_REGS' calibration row: one consumer fixes the V-transposing producer at 24
    registers, enough for round robin, 8 bytes short once it also reads the balanced tile table."""
    cfg = NATURAL_CASES[1].replace(q_order="balanced")
    assert "producer warpgroup transposes V" in SPACE.feasible(cfg)
    assert compiled(cfg).spill_bytes > 0


@pytest.mark.parametrize("cfg", K_PERM_CASES, ids=lambda c: c.to_json()[-60:])
def test_k_perm_loads_k_in_5d_boxes_and_leaves_the_step_alone(cfg, compiled):
    """k_perm: every K copy is a 5-D TMA box (Q's stay 2-D), the twin's 2-D K copies are gone, and the
    consumers' code is the twin's but for the masked steps' key indices: as many QGMMAs, about the same registers,
    no spills, nothing serialised."""
    art, twin = compiled(cfg), compiled(cfg.replace(k_perm=False))
    copy = r"cp\.async\.bulk\.tensor\.{}d\.shared::cluster\.global"
    k_copies = len(re.findall(copy.format(5), art.ptx))  # (per K part and box; Triton may repeat a site)
    assert k_copies >= (2 if cfg.block_n == 192 else 1) * (cfg.head_dim_qk // emit_gluon.qk_part_width(cfg))
    assert len(re.findall(copy.format(2), twin.ptx)) == len(re.findall(copy.format(2), art.ptx)) + k_copies
    assert "UTMALDG.5D" in art.sass and "UTMALDG.5D" not in twin.sass
    assert art.count("QGMMA") == twin.count("QGMMA") and abs(art.registers - twin.registers) <= 8
    assert art.spill_bytes == 0 and art.serialised_wgmma is None


@pytest.mark.parametrize(
    "cfg,consumers",
    [
        (gluon_wide_config("fp8", 128, 128), 2),  # two consumer warpgroups, no ping-pong
        (gluon_three_config("fp8", 64, 64), 3),  # three (192-row tiles: 4096 = 21 x 192 + 64)
        (GLUON, 0),  # ping-pong: the turns need every consumer's wgmmas
    ],
    ids=["wide", "three-hd64", "ping-pong"],
)
def test_consumers_past_the_end_only_pass_their_blocks_on(cfg, consumers, compiled):
    """A consumer whose 64 rows all lie past the queries' end (the partial last block of a tile)
    computes nothing: it waits for each of the tile's K / V stages and releases it, so that the
    producer's count of releases stays whole. One such loop per consumer, none with ping-pong. (On the
    GPU, the three-consumer cases at 1000 and 4096 tokens run it: tests/test_gpu_gluon.py.)"""
    assert pass_loops(compiled(cfg).sass) == consumers


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


#: Register calibration (Triton 3.6, compile_for_target): config changes from the seed -> spills.
#: The static estimate must reject exactly the configs that spill (the full 36-config sweep it was
#: fitted on is described in search_spaces/resources.py).
CALIBRATION = [
    (dict(v_permute=False, producer_regs=56), True),  # 232 needed > 224: spills 24 B
    (dict(v_permute=False), False),  # 232 <= 240
    (dict(block_n=256, num_stages=2), True),  # 248 > 240: spills, wgmma serialised
    (dict(block_n=256, num_stages=2, block_m=64, ping_pong=False, q_order="heavy_first"), False),  # 248 <= 256
    (dict(block_n=256, num_stages=2, block_m=64, ping_pong=False), True),  # + its tile table: 264 > 256, 8 B
    (dict(block_n=256, num_stages=2, overlap=False, producer_regs=56), False),  # no P carried: 216
    # head dims 64 and 256 (GLUON_OTHER_DIM_REGISTERS)
    (dict(head_dim_qk=64, head_dim_v=64, block_n=256, num_stages=2), False),  # 228 <= 240
    (dict(head_dim_qk=64, head_dim_v=64, block_n=256, num_stages=2, producer_regs=56), True),  # 228 > 224: 8 B
    (dict(head_dim_qk=256, head_dim_v=256, block_n=64, num_stages=2, producer_regs=56), False),  # 204 <= 224
    (dict(head_dim_qk=256, head_dim_v=256, block_n=64, num_stages=2, v_permute=False, producer_regs=40), False),
    (dict(head_dim_qk=256, head_dim_v=256, block_n=128, num_stages=2), True),  # 244 > 240: 48 B
    (dict(head_dim_qk=256, head_dim_v=256, block_n=128, num_stages=2, overlap=False), False),  # 240 <= 240
    # (GLUON_WIDE_PLAIN_REGISTERS: that plain step spills below 240 per consumer, and with the row-sum MMA)
    (
        dict(
            head_dim_qk=256, head_dim_v=256, block_n=128, num_stages=2, overlap=False, ping_pong=False, producer_regs=40
        ),
        True,
    ),  # 240 > 232: 8 B
    (dict(head_dim_qk=256, head_dim_v=256, block_n=128, num_stages=2, overlap=False, rowsum="mma"), True),  # 248: 24 B
    # three consumers at 160 registers (GLUON_THREE_CONSUMER_REGISTERS)
    (dict(block_m=192, num_stages=2, ping_pong=False, overlap=False, v_permute=False), True),  # 176 > 160: 80 B
    (dict(block_m=192, block_n=64, num_stages=2), False),  # 152 <= 160
    # ... nor where P goes through two shared tiles with fp32 row sums (160), unless the producer takes 56
    # (152 each: 512 B); with the row-sum MMA 176: 48 B
    (dict(block_m=192, p_carry="smem2", lane_sums=True, half_block=True), False),
    (
        dict(
            block_m=192, p_carry="smem2", half_block=True, o_through_p=True, q_stages=2, num_stages=2, producer_regs=56
        ),
        True,
    ),
    (dict(block_m=192, p_carry="smem2", half_block=True, o_through_p=True, rowsum="mma"), True),
    # ... and only with Q and K in one part: hd96 (three 32-column parts) 176 > 160: 8 B
    (dict(head_dim_qk=96, head_dim_v=96, block_m=192, p_carry="smem2", lane_sums=True, half_block=True), True),
    # two P tiles at 256 keys (216): a halved first block, ping-pong and per-row sums together need 232
    # (GLUON_TWO_TILE_HALF_PING_PONG_REGISTERS): 8 B at 224; with lane sums none
    (dict(block_n=256, num_stages=2, q_stages=2, p_carry="smem2", half_block=True, producer_regs=56), True),
    (
        dict(block_n=256, num_stages=2, q_stages=2, p_carry="smem2", half_block=True, producer_regs=56, lane_sums=True),
        False,
    ),
    (dict(block_n=256, num_stages=2, q_stages=2, p_carry="smem2", half_block=True, producer_regs=40), False),  # 232
    # 192-key blocks (128 + 64 key parts) with overlap (GLUON_SPLIT_REGISTERS): 232 <= 240; 232 > 224
    # at producer_regs=56 (40 B); without the key permutation 320
    (dict(block_n=192, num_stages=2), False),
    (dict(block_n=192, num_stages=3, q_stages=2, producer_regs=56, ex2_fence=True, skip_rescale=True), True),
    (dict(block_n=192, num_stages=2, v_permute=False), True),
    # three consumers need them without overlap too (hd64, 176 > 160: 80 B)
    (dict(head_dim_qk=64, head_dim_v=64, block_m=192, block_n=192, num_stages=4, overlap=False), True),
    # 192/128 (GLUON_MLA_MMA_REGISTERS): one consumer, 256-key blocks, overlap; the row-sum MMA tips it
    (
        dict(head_dim_qk=192, block_m=64, ping_pong=False, block_n=256, num_stages=2, q_order="heavy_first"),
        False,
    ),  # 248
    (dict(head_dim_qk=192, block_m=64, ping_pong=False, block_n=256, num_stages=2), True),  # table: 264, 8 B
    (
        dict(
            head_dim_qk=192, block_m=64, ping_pong=False, block_n=256, num_stages=2, rowsum="mma", q_order="heavy_first"
        ),
        True,
    ),  # 264
    # pv_defer: P(j-1) in flight under QK^T(j) like overlap's carried P
    (dict(overlap=False, pv_defer=True), False),  # 168
    (dict(block_n=192, num_stages=3, ping_pong=False, overlap=False, pv_defer=True, rowsum="mma"), False),  # 208
    # 256 keys: two 128-key parts, the second QK^T after the PV wait, O rescaled in place
    # (GLUON_SPLIT_DEFER_REGISTERS)
    (dict(block_n=256, num_stages=2, ping_pong=False, q_stages=2, overlap=False, pv_defer=True), False),  # 232
    (
        dict(block_n=256, num_stages=2, ping_pong=False, q_stages=2, overlap=False, pv_defer=True, producer_regs=40),
        False,
    ),  # 232 <= 232
    (
        dict(block_n=256, num_stages=2, ping_pong=False, q_stages=2, overlap=False, pv_defer=True, producer_regs=56),
        True,
    ),  # 232 > 224: 16 B
    (
        dict(
            block_n=256,
            num_stages=2,
            ping_pong=False,
            q_stages=2,
            overlap=False,
            pv_defer=True,
            skip_rescale=True,
            rowsum="mma",
        ),
        False,
    ),  # 240
    (
        dict(
            block_n=256,
            num_stages=2,
            ping_pong=False,
            q_stages=2,
            overlap=False,
            pv_defer=True,
            skip_rescale=True,
            rowsum="mma",
            producer_regs=40,
        ),
        True,
    ),  # 240 > 232: 16 B
    (dict(head_dim_qk=256, head_dim_v=256, block_n=128, num_stages=2, overlap=False, pv_defer=True), False),  # 232
    (
        dict(head_dim_qk=256, head_dim_v=256, block_n=128, num_stages=2, overlap=False, pv_defer=True, rowsum="mma"),
        True,
    ),  # 248 > 240: 32 B
    (
        dict(
            head_dim_qk=256, head_dim_v=256, block_n=128, num_stages=2, overlap=False, pv_defer=True, producer_regs=56
        ),
        True,
    ),  # 232 > 224: 128 B
    # head dim 96: padded O (128 columns) at three consumers; O in two parts (o_split) at three
    # consumers with P packed or not (GLUON_SPLIT_O_F32_THREE_REGISTERS), 256-key overlapped blocks
    (dict(head_dim_qk=96, head_dim_v=96, block_m=192, p_carry="e4m3"), True),  # 192 > 160: 152 B
    (dict(head_dim_qk=96, head_dim_v=96, o_split=True, block_m=192, p_carry="e4m3"), False),  # 152
    (dict(head_dim_qk=96, head_dim_v=96, o_split=True, block_m=192, ping_pong=False), True),  # 168: 24 B
    (dict(head_dim_qk=96, head_dim_v=96, o_split=True, block_n=256, num_stages=2, p_carry="e4m3"), False),  # 232
    (
        dict(head_dim_qk=96, head_dim_v=96, o_split=True, block_m=192, overlap=False, rowsum="mma", num_stages=4),
        False,
    ),  # 136
    (
        dict(
            head_dim_qk=96,
            head_dim_v=96,
            o_split=True,
            block_m=192,
            overlap=False,
            v_permute=False,
            rowsum="mma",
            num_stages=4,
        ),
        True,
    ),  # 168: 8 B
    # two P tiles at 256 keys (no P in registers: 216) with the row-sum MMA (GLUON_TWO_TILE_MMA_REGISTERS),
    # exact and lean
    (dict(block_n=256, num_stages=2, ping_pong=False, q_stages=2, p_carry="smem2"), False),  # 216
    (dict(block_n=256, num_stages=2, ping_pong=False, p_carry="smem2", rowsum="mma"), True),  # 248: 48 B
    (dict(block_n=256, num_stages=2, ping_pong=False, p_carry="smem2", softmax="lean", rowsum="mma"), True),  # 32 B
    # lean P summing its decoded codes per lane instead (no row-sum MMA): fits, with and without ping-pong
    (
        dict(
            block_n=256,
            num_stages=2,
            ping_pong=False,
            p_carry="smem2",
            softmax="lean",
            rowsum="rounded",
            lane_sums=True,
            half_block=True,
        ),
        False,
    ),
    (
        dict(
            block_n=256,
            num_stages=2,
            q_stages=2,
            p_carry="smem2",
            softmax="lean",
            rowsum="rounded",
            lane_sums=True,
            producer_regs=56,
            skip_rescale=True,
            p_scale_log2=7,
        ),
        False,
    ),
    # and at hd256 on 128-key blocks with the output through the P tiles (the same 192 registers of
    # accumulator and scores; without ping-pong 8 bytes spilled too, left to the compile check)
    (
        dict(head_dim_qk=256, head_dim_v=256, num_stages=2, p_carry="smem2", o_through_p=True, lane_sums=True),
        False,
    ),  # 228
    (
        dict(
            head_dim_qk=256,
            head_dim_v=256,
            num_stages=2,
            p_carry="smem2",
            o_through_p=True,
            rowsum="mma",
            late_rescale=True,
        ),
        True,
    ),  # 260: 32 B
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
    from zyfa_tune.tuning import compile_check

    cfg = GLUON.replace(block_n=256, num_stages=2)
    art = compiled(cfg)
    assert art.serialised_wgmma is not None and "wgmma.mma_async instructions are serialized" in art.serialised_wgmma
    assert compiled(GLUON).serialised_wgmma is None
    no_spill = dataclasses.replace(art, spill_bytes=0)
    monkeypatch.setattr("zyfa_tune.generator.build.compile_for_target", lambda *a, **k: no_spill)
    check = compile_check._compile_check(cfg, True)
    assert check.error.startswith("ptxas serialises the wgmmas: ") and "serialized" in check.error
