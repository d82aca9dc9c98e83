"""What the Gluon compile tests share: the configs they compile (one list per feature), the
`compiled` fixture (each config compiled once per test module, those of the selected parametrised
tests ahead of time in a process pool, one worker per core; numbers print with pytest -s), the
usability check every compiled kernel must pass, and readers of the SASS (its loops, a step's
instructions)."""

from __future__ import annotations

import multiprocessing
import os
import re
from concurrent.futures import ProcessPoolExecutor

from gluon_cases import GLUON, neighbours, sampled

from zyfa_tune.generator import ConfigError, KernelConfig, emit
from zyfa_tune.generator.build import CompiledArtifacts, compile_for_target
from zyfa_tune.generator.defaults import default_config
from zyfa_tune.search_spaces import SMEM_LIMIT, gluon_smem_estimate
from zyfa_tune.search_spaces.resources import TMA_SMEM_MARGIN
from zyfa_tune.search_spaces.seeds import (
    gluon_lanes_config,
    gluon_lean_f16_async_config,
    gluon_lean_f16_config,
    gluon_lean_max_config,
    gluon_smem2_chunked_config,
    gluon_smem2_config,
    gluon_smem2_narrow_config,
    gluon_wide_config,
)

#: lean P (Gluon): each instruction sequence, on the seed and on a tuned schedule (no ping-pong, a Q ring of 2)
LEAN_CASES = [GLUON.replace(softmax="lean", rowsum="mma", lean_fold=fold) for fold in ("fma", "sub_fma", "corrected")]
LEAN_CASES.append(
    LEAN_CASES[0].replace(ping_pong=False, q_stages=2, q_order="forward", lean_clamp="fmax", lean_pack="bfi")
)
LEAN_CASES.append(LEAN_CASES[0].replace(lean_fold="centered", lean_clamp="sat"))
#: lean P's codes made where the softmax folds the scores and carried packed: in registers, through one
#: shared-memory tile, through two with a halved first block
LEAN_CASES += [
    LEAN_CASES[0].replace(p_carry="e4m3"),
    LEAN_CASES[0].replace(p_carry="smem"),
    LEAN_CASES[0].replace(p_carry="smem2", half_block=True),
]


#: head dim 64 (Q, K, V and O tiles of 64 columns): the seed, one consumer, lean P, 64-key blocks
HD64 = default_config("fp8", 64, 64, "gluon")


HD64_CASES = [
    HD64,
    HD64.replace(block_m=64, ping_pong=False),
    HD64.replace(softmax="lean", rowsum="mma"),
    HD64.replace(block_n=64, num_stages=4),
    HD64.replace(ping_pong=False, q_stages=2, q_order="forward"),
]


#: head dim 256 (64-key blocks: the 64 x 256 accumulator's registers; Q/K boxes split by the swizzle)
HD256 = default_config("fp8", 256, 256, "gluon")


HD256_CASES = [
    HD256,
    HD256.replace(softmax="lean", rowsum="mma"),
    HD256.replace(num_stages=3),
    HD256.replace(ping_pong=False, q_stages=2, q_order="forward"),
    HD256.replace(block_m=64, ping_pong=False),
]


#: MLA's 192/128: Q and K in three 64-column parts (one TMA copy and one chained wgmma each)
MLA = default_config("fp8", 192, 128, "gluon")


MLA_CASES = [
    MLA,
    MLA.replace(softmax="lean", rowsum="mma"),
    MLA.replace(block_n=64, num_stages=4),
    MLA.replace(ping_pong=False, q_stages=2, q_order="forward"),
    MLA.replace(block_m=64, ping_pong=False),
]


#: three consumer warpgroups (block_m=192, FA3's head-dim-64 tile): Q in three 64-row TMA boxes
THREE_CASES = [
    HD64.replace(block_m=192),
    HD64.replace(block_m=192, ping_pong=False, q_stages=2),
    HD64.replace(block_m=192, softmax="lean", rowsum="mma"),
    GLUON.replace(block_m=192, block_n=64),
]


#: V read as given (v_layout="natural"): the producer warpgroup writes each tile's transpose
NATURAL_CASES = [
    GLUON.replace(v_permute=False, v_layout="natural", producer_regs=40),
    GLUON.replace(
        block_m=64, ping_pong=False, overlap=False, v_permute=False, v_layout="natural", q_order="heavy_first"
    ),
    HD64.replace(v_permute=False, v_layout="natural", producer_regs=40),
    HD256.replace(v_permute=False, v_layout="natural", producer_regs=40),
    MLA.replace(v_permute=False, v_layout="natural", producer_regs=40),
    HD64.replace(block_m=192, v_permute=False, v_layout="natural", producer_regs=40, overlap=False),
]


#: 192-key blocks (a 128-key and a 64-key part): overlapped, with the row-sum MMA, plain
SPLIT_CASES = [
    GLUON.replace(block_n=192, num_stages=2),
    GLUON.replace(block_n=192, num_stages=2, rowsum="mma"),
    GLUON.replace(block_n=192, overlap=False, ping_pong=False, rowsum="mma", num_stages=2, q_stages=2, v_permute=False),
]


#: P carried packed as e4m3 (p_carry="e4m3"): the overlapped seeds of each head dim, three consumers,
#: the 192-key block, pv_defer (128 keys with ping-pong at head dim 256; 256 keys as two parts)
PACKED_CASES = [
    GLUON.replace(p_carry="e4m3"),
    MLA.replace(p_carry="e4m3"),
    HD64.replace(block_m=192, ping_pong=False, rowsum="mma", skip_rescale=True, p_carry="e4m3"),
    GLUON.replace(block_n=192, num_stages=3, ping_pong=False, skip_rescale=True, p_carry="e4m3"),
    HD256.replace(block_n=128, num_stages=2, overlap=False, pv_defer=True, p_carry="e4m3"),
    gluon_wide_config("fp8", 128, 128).replace(pv_defer=True, p_carry="e4m3"),
]


#: P handed to the PV wgmma through a shared-memory tile (p_carry="smem", not searched): the seed
#: with and without ping-pong, three consumers at head dim 64, 192/128, head dim 256's 64-key blocks
#: (a 64-byte swizzle)
SMEM_CASES = [
    GLUON.replace(p_carry="smem"),
    GLUON.replace(p_carry="smem", ping_pong=False),
    HD64.replace(block_m=192, ping_pong=False, rowsum="mma", skip_rescale=True, p_carry="smem"),
    MLA.replace(p_carry="smem"),
    HD256.replace(p_carry="smem"),
]


#: two P tiles per consumer (p_carry="smem2", searched): the 256-key overlap at head dims 128 and 96 (the
#: output tile in the first P tile), with ping-pong and per-step row sums, the seed, three consumers at
#: head dim 64, 192/128 (the seed's schedule, the narrow seed, a tuned schedule)
SMEM2_CASES = [
    gluon_smem2_config("fp8", 128, 128),
    gluon_smem2_config("fp8", 96, 96),
    gluon_smem2_config("fp8", 128, 128).replace(lane_sums=False, ping_pong=True),
    GLUON.replace(p_carry="smem2"),
    HD64.replace(block_m=192, ping_pong=False, rowsum="mma", skip_rescale=True, p_carry="smem2"),
    MLA.replace(p_carry="smem2"),
    gluon_smem2_narrow_config("fp8", 192, 128),
    gluon_smem2_narrow_config("fp8", 192, 128).replace(
        lane_sums=False, rowsum="mma", late_rescale=True, turn_barrier="named", producer_regs=40
    ),
]


#: row sums kept per lane (lane_sums): the 256-key kernel, the packed overlapped seed, 192/128, hd64 and
#: hd256's 64-key blocks
LANE_CASES = [
    gluon_wide_config("fp8", 128, 128).replace(lane_sums=True),
    GLUON.replace(p_carry="e4m3", lane_sums=True),
    MLA.replace(lane_sums=True),
    HD64.replace(lane_sums=True),
    HD256.replace(lane_sums=True),
]


#: head dim 96: Q / K in three 32-column parts; O padded to 128 columns (the seed, 256-key blocks,
#: V read as given) or in a 64- and a 32-column part (o_split: the seed, three consumers, 256-key
#: blocks overlapped, pv_defer, skip_rescale's asm on both parts)
HD96 = default_config("fp8", 96, 96, "gluon")


HD96_SPLIT = HD96.replace(o_split=True)


HD96_CASES = [
    HD96,
    gluon_wide_config("fp8", 96, 96).replace(lane_sums=True),
    HD96.replace(v_permute=False, v_layout="natural", producer_regs=40),
    HD96_SPLIT,
    HD96_SPLIT.replace(block_m=192, p_carry="e4m3", late_rescale=True),
    HD96_SPLIT.replace(block_m=192, ping_pong=False, rowsum="mma", skip_rescale=True, p_carry="e4m3"),
    HD96_SPLIT.replace(block_n=256, num_stages=2, p_carry="e4m3", lane_sums=True),
    HD96_SPLIT.replace(overlap=False, pv_defer=True, p_carry="e4m3", lane_sums=True),
]


#: a half-empty first block run as half a block (half_block): the untuned hd128 kernel (256-key blocks,
#: per-lane sums), head dim 96's shipped 4K schedule, 128-key blocks under one consumer with the row-sum MMA;
#: the output stored in column chunks through the two P tiles (o_through_p): hd256's
#: 128-key overlap with P in shared memory (the seed; fits only so), 192/128's narrow seed in a 2-stage
#: ring, 64-key blocks at hd128 (four chunks of 32 columns)
CHUNKED_CASES = [
    gluon_smem2_chunked_config("fp8", 256, 256),
    gluon_smem2_chunked_config("fp8", 192, 128),
    gluon_smem2_narrow_config("fp8", 128, 128).replace(block_n=64, num_stages=4, half_block=False, o_through_p=True),
]


#: overlapped with P in shared memory: the smem2 seed, with ping-pong and per-step sums, one 128-key P tile
HALF_CASES = [
    gluon_lanes_config("fp8", 128, 128),
    gluon_wide_config("fp8", 96, 96).replace(o_split=True, lane_sums=True, half_block=True),
    GLUON.replace(block_m=64, ping_pong=False, overlap=False, q_stages=2, num_stages=2, rowsum="mma", half_block=True),
    gluon_smem2_config("fp8", 128, 128),
    gluon_smem2_config("fp8", 128, 128).replace(ping_pong=True, lane_sums=False),
    GLUON.replace(p_carry="smem", half_block=True),
]


#: lean P on f16 scores (qk_acc="f16"): the lean 256-key kernel at head dims 128 and 64, and at 96
#: (three 32-column Q parts: the Q rescale over all of them, the last QK^T part synchronous); the corrected fold
F16_CASES = [
    gluon_lean_f16_config("fp8", 128, 128),
    gluon_lean_f16_config("fp8", 64, 64),
    gluon_lean_f16_config("fp8", 96, 96),
    gluon_lean_f16_config("fp8", 128, 128).replace(lean_fold="corrected"),
]


#: the key relabelling made on K's tile rows (k_perm: a 5-D TMA box, so V^T is read in key order): the 256-key
#: two-tile kernel, lean P on f16 scores, 192-key blocks (two K boxes), 192/128 (64-column K parts)
K_PERM_CASES = [
    gluon_smem2_config("fp8", 128, 128).replace(k_perm=True),
    gluon_lean_f16_config("fp8", 128, 128).replace(k_perm=True),
    GLUON.replace(block_n=192, num_stages=2, k_perm=True),
    MLA.replace(p_carry="smem2", k_perm=True),
]


#: f16 scores with QK^T's wait moved behind PV(j-1)'s issue by generator/ptx_pass.py (qk_async): the F16_CASES,
#: and the qk_async seed (a 24-register producer) with and without keys relabelled on K
QK_ASYNC_CASES = [cfg.replace(qk_async=True) for cfg in F16_CASES] + [
    gluon_lean_f16_async_config("fp8", 128, 128),
    gluon_lean_f16_async_config("fp8", 128, 128).replace(k_perm=True),
]


#: a share of the corrected f16 fold's pairs from the MUFU (lean_mufu: 1, 2, 3 of every four), at the qk_async
#: seed's 24-register producer
MUFU_CASES = [
    gluon_lean_f16_async_config("fp8", 128, 128).replace(lean_fold="corrected", lean_mufu=k) for k in (1, 2, 3)
]


#: the same beside the linear fold on the row maximum (lean_ref="max"), with and without the floor line
LINEAR_MUFU_CASES = [
    gluon_lean_f16_async_config("fp8", 128, 128).replace(lean_ref="max", lean_mufu=k, lean_floor=f)
    for k, f in ((1, False), (1, True))
]


#: the lean seed on the row maximum at the other head dims (128-key blocks at 192/128, one Q stage and O through the
#: P tiles at hd256), with and without MUFU pairs, as it runs on a K-major V (k_perm)
LEAN_MAX_CASES = [
    gluon_lean_max_config("fp8", *dims).replace(k_perm=True, lean_mufu=k)
    for dims in ((64, 64), (192, 128), (256, 256))
    for k in (0, 1)
]


#: lean P's row sum from its packed codes (rowsum="rounded"): in registers per row, through two shared
#: tiles per lane (the 256-key two-tile kernel)
CODE_SUM_CASES = [
    GLUON.replace(softmax="lean", rowsum="rounded", p_carry="e4m3"),
    gluon_smem2_config("fp8", 128, 128).replace(softmax="lean", rowsum="rounded", q_stages=1),
]


#: a tuned hd128 schedule (ping-pong off, Q ring of 2), exact softmax
WINNER = GLUON.replace(ping_pong=False, q_stages=2)


CASES = (
    neighbours()
    + sampled(6)
    + LEAN_CASES
    + F16_CASES
    + HD64_CASES
    + HD256_CASES
    + MLA_CASES
    + THREE_CASES
    + NATURAL_CASES
    + SPLIT_CASES
    + PACKED_CASES
    + SMEM_CASES
    + SMEM2_CASES
    + LANE_CASES
    + HD96_CASES
    + CHUNKED_CASES
    + HALF_CASES
    + K_PERM_CASES
    + QK_ASYNC_CASES
    + MUFU_CASES
    + LINEAR_MUFU_CASES
    + LEAN_MAX_CASES
)


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


def compile_each_once(request):
    """The body of each compile test module's `compiled` fixture (module scope): compiled(cfg, causal,
    descales) -> CompiledArtifacts, each once; the module's parametrised configs ahead of time."""
    cache: dict[tuple, CompiledArtifacts] = {}
    # compiles are single-threaded and take seconds each: one process per core does them ahead of the
    # tests (spawned: a clean interpreter, no forked state)
    pool = ProcessPoolExecutor(max_workers=os.cpu_count() or 1, mp_context=multiprocessing.get_context("spawn"))
    ahead = {(cfg, True, True): pool.submit(compile_for_target, emit(cfg)) for cfg in ahead_of_time(request)}

    def get(cfg: KernelConfig, causal: bool = True, descales: bool = True) -> CompiledArtifacts:
        key = (cfg, causal, descales)
        if key not in cache:
            art = cache[key] = (
                ahead[key].result() if key in ahead else compile_for_target(emit(cfg), causal=causal, descales=descales)
            )
            changed = {k: v for k, v in cfg.all_fields().items() if v != getattr(GLUON, k)}
            print(
                f"\n  gluon {changed or 'seed'} causal={causal} descales={descales}: regs={art.registers} "
                f"spill={art.spill_bytes} smem={art.shared_bytes} QGMMA={art.count('QGMMA')} "
                f"USETMAXREG={art.count('USETMAXREG')} EX2={art.count('MUFU.EX2')}",
                end="",
            )
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


_SASS_LINE = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(.*?)\s*;", re.M)


def sass_loops(sass: str, innermost: bool = False) -> list[list[str]]:
    """Bodies (instruction texts) of the loops in `sass`, one per backward branch, from its target
    to the branch; `innermost`: only those with no backward branch inside."""
    ins = [(int(a, 16), text) for a, text in _SASS_LINE.findall(sass)]
    back = [
        (a, int(m.group(1), 16))
        for a, t in ins
        if (m := re.search(r"\bBRA (0x[0-9a-f]+)", t)) and int(m.group(1), 16) < a
    ]
    return [
        [t for a, t in ins if target <= a <= addr]
        for addr, target in back
        if not (innermost and any(target <= a < addr for a, _ in back))
    ]


def pass_loops(sass: str) -> int:
    """Loops that wait on stages and release them (SYNCS) with no wgmma, TMA load or exponential:
    a consumer passing a tile's K/V stages on (_pass_blocks)."""
    return sum(
        not any(op in t for t in body for op in ("QGMMA", "UTMALDG", "MUFU"))
        and sum("SYNCS.ARRIVE" in t for t in body) >= 2
        for body in sass_loops(sass)
    )


def overlapped_step_loops(sass: str, block_n: int, mmas: int | None = None) -> list[list[str]]:
    """The bodies of the consumers' overlapped-step loops (masked and unmasked, every consumer): the
    backward branches whose body issues QK^T(j) (4 QGMMA over head dim 128) and PV(j-1) (block_n / 32)
    and the step's exponentials; `mmas`: another count of QGMMA per step."""
    return [
        body
        for body in sass_loops(sass)
        if sum("QGMMA" in t for t in body) == (mmas or 4 + block_n // 32)
        and sum("MUFU.EX2" in t for t in body) >= block_n // 2
    ]


def exponentials_after_pv_wait(body: list[str]) -> int:
    """MUFU.EX2 after the step's last wgmma wait(0) (WARPGROUP.DEPBAR.LE gsb0, 0x0): exponentials
    that ptxas scheduled after the PV wait, i.e. not under the PV wgmma."""
    waits = [i for i, t in enumerate(body) if re.search(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x0$", t)]
    assert waits, "no PV wait in the loop"
    return sum("MUFU.EX2" in t for t in body[waits[-1] + 1 :])


def overlapped_loops(sass: str, exps: int) -> list[list[str]]:
    """Bodies of the innermost loops (no backward branch inside) with exactly `exps` MUFU.EX2 and a
    wgmma wait: the overlapped steps, masked and unmasked, of every consumer."""
    return [
        body
        for body in sass_loops(sass, innermost=True)
        if sum("MUFU.EX2" in t for t in body) == exps and any("WARPGROUP.DEPBAR" in t for t in body)
    ]


def op_count(body: list[str], op: str) -> int:
    """Instructions of `body` whose opcode is `op` (with any modifiers: MUFU counts MUFU.EX2)."""
    return sum(x.split()[0] == op or x.split()[0].startswith(op + ".") for x in body)


def step_loop(sass: str) -> list[str]:
    """The instructions of the shortest loop that issues a whole step's wgmmas (QK^T's four k-steps and PV's
    eight at head dim 128, 256 keys): a consumer's steady step."""
    return min((body for body in sass_loops(sass) if sum("QGMMA" in x for x in body) >= 12), key=len)


def issue_order(art: CompiledArtifacts) -> str:
    """The step loop's wgmmas and waits in order: 'h' an f16-accumulator QGMMA (QK^T), 'f' a float32 one (PV), 'w'
    a wait. The step loop: the shortest loop holding both kinds."""
    loop = min(
        (
            b
            for b in sass_loops(art.sass)
            if any("QGMMA" in x and ".F16." in x for x in b) and any("QGMMA" in x and ".F32." in x for x in b)
        ),
        key=len,
    )
    return "".join(
        "h" if "QGMMA" in x and ".F16." in x else "f" if "QGMMA" in x else "w"
        for x in loop
        if "QGMMA" in x or "WARPGROUP.DEPBAR" in x
    )
