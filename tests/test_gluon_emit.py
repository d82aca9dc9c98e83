"""Gluon emission (generator/gluon_sm90/emit.py): deterministic source with the config baked in as
constants, stable hashes, every schedule field reaching the code, only validated values as text."""

from __future__ import annotations

import ast
import hashlib

import pytest

from gluon_cases import GLUON, neighbours, sampled

from zyfa_tune.generator import KernelConfig, emit, emit_triton, gluon_registers
from zyfa_tune.generator.gluon_sm90.common import E4M3X4_ASM
from zyfa_tune.generator.gluon_sm90 import emit as emit_gluon
from zyfa_tune.generator.emitted import KERNEL_NAME
from zyfa_tune.generator.asm.exp2_poly import EXP2_CONSTRAINTS, exp2_asm
from zyfa_tune.generator.asm.lean import (MAGIC, code_sum_asm, f16_fold_asm, f16_mufu_asm, f16_mufu_constraints,
                                          f16_pack_asm, lean_tail_asm)
from zyfa_tune.generator.asm.rescale import rescale_asm, rescale_constraints
from zyfa_tune.generator.gluon_sm90.trace import EVENTS
from zyfa_tune.generator.defaults import (default_config, gluon_lean_f16_config, gluon_smem2_chunked_config,
                                       gluon_smem2_config)

#: the Gluon seed, one variant per value of every field the space searches for it, a sample of
#: the space's points, and P through shared memory (not searched), with a 128- and a 64-byte swizzle
VARIANTS = neighbours() + sampled(20) + [GLUON.replace(p_carry="smem"),
                                         default_config("fp8", 256, 256, "gluon").replace(p_carry="smem"),
                                         GLUON.replace(p_carry="smem2"), gluon_smem2_config("fp8", 128, 128),
                                         gluon_smem2_chunked_config("fp8", 256, 256),
                                         gluon_smem2_chunked_config("fp8", 192, 128),
                                         gluon_lean_f16_config("fp8", 128, 128),
                                         *(gluon_lean_f16_config("fp8", 128, 128).replace(lean_fold="corrected",
                                                                                          lean_mufu=k) for k in (1, 2)),
                                         gluon_lean_f16_config("fp8", 128, 128).replace(lean_ref="max", lean_mufu=1),
                                         gluon_lean_f16_config("fp8", 128, 128).replace(lean_ref="max", lean_floor=True,
                                                                                        lean_mufu=2),
                                         gluon_lean_f16_config("fp8", 128, 128).replace(lean_ref="max"),
                                         gluon_lean_f16_config("fp8", 128, 128).replace(lean_ref="max", lean_floor=True),
                                         gluon_lean_f16_config("fp8", 128, 128).replace(lean_floor=True)]


def constants(source: str) -> dict:
    """Module-level NAME = literal and NAME = gl.constexpr(literal) assignments."""
    out = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            value = node.value
            if isinstance(value, ast.Call) and ast.unparse(value.func) == "gl.constexpr":
                value = value.args[0]
            try:
                out[node.targets[0].id] = ast.literal_eval(value)
            except ValueError:
                pass
    return out


def code_only(source: str) -> str:
    tree = ast.parse(source)
    return "\n".join(source.splitlines()[tree.body[0].end_lineno:])


def test_emit_dispatches_on_backend():
    assert emit(GLUON).source == emit_gluon.emit(GLUON).source
    assert "@gluon.jit" in emit(GLUON).source and "@triton.jit" not in emit(GLUON).source
    with pytest.raises(ValueError, match="backend='gluon'"):
        emit_triton.emit(GLUON)
    with pytest.raises(ValueError, match="backend='triton'"):
        emit_gluon.emit(KernelConfig())
    with pytest.raises(TypeError, match="takes a KernelConfig"):
        emit_gluon.emit(GLUON.to_dict())


@pytest.mark.parametrize("cfg", VARIANTS)
def test_deterministic_and_hashed(cfg):
    a, b = emit(cfg), emit(KernelConfig.from_json(cfg.to_json()))
    assert a.source == b.source and a.source_hash == b.source_hash
    assert a.source_hash == hashlib.sha256(a.source.encode()).hexdigest()[:16]
    assert a.kernel_name == KERNEL_NAME


def test_distinct_configs_give_distinct_code():
    """Configs differing in a kernel field give different code; ones differing only in a launch field
    (l2_group_mib) the same code under another header, so another source hash (database variants are
    keyed by it: a launch twin's trials must not be filed under its twin's config)."""
    codes = {code_only(emit(c).source) for c in VARIANTS}
    assert len(codes) == len({c.kernel_config() for c in VARIANTS})
    launch_twins = [c for c in VARIANTS if c != c.kernel_config()]
    assert launch_twins
    for c in launch_twins:
        twin = emit(c.kernel_config())
        assert code_only(emit(c).source) == code_only(twin.source) and emit(c).source_hash != twin.source_hash


def fence_constants(cfg) -> dict:
    """ex2_fence's asm per consumer: on the row sums (rowsum="fp32") or on each key part's
    probabilities (rowsum="mma"), empty elsewhere."""
    from zyfa_tune.generator.asm.fence import (ROW_SUM_FENCE_CONSTRAINTS, p_fence_asm, p_fence_constraints,
                                               row_sum_fence_asm)

    none = ("",) * 3
    rows = cfg.ex2_fence and cfg.rowsum == "fp32"
    out = {"ROW_SUM_FENCE_ASM": tuple(row_sum_fence_asm(15 - k) for k in range(3)) if rows else none,
           "ROW_SUM_FENCE_CONSTRAINTS": ROW_SUM_FENCE_CONSTRAINTS}
    keys = {"A": 128 if cfg.block_n == 192 else cfg.block_n, "B": 64 if cfg.block_n == 192 else 0}
    for part, k in keys.items():
        n, on = k // 2, cfg.ex2_fence and cfg.rowsum == "mma" and k > 0
        out[f"P_FENCE_{part}_ASM"] = tuple(p_fence_asm(n, 15 - c) for c in range(3)) if on else none
        out[f"P_FENCE_{part}_CONSTRAINTS"] = p_fence_constraints(n) if on else ""
    return out


@pytest.mark.parametrize("cfg", VARIANTS)
def test_constants_are_the_config(cfg):
    src = emit(cfg).source
    tree = ast.parse(src)
    compile(tree, "<emitted>", "exec")
    doc = ast.get_docstring(tree)
    (line,) = [ln for ln in doc.splitlines() if ln.startswith("config: ")]
    assert KernelConfig.from_json(line[len("config: "):]) == cfg
    c = constants(src)
    lean = cfg.softmax == "lean"
    consumer_regs, producer_regs = gluon_registers(cfg)
    in_place = cfg.skip_rescale or (cfg.block_n == 256 and cfg.pv_defer)
    # key parts: 192 = 128 + 64; a 256-key pv_defer block 128 + 128; else one part
    # O's accumulator columns: a power of two (96 padded to 128), or with o_split 64 + 32 (else a
    # stand-in 8 wide); the wgmmas of one PV issue
    ow, oc = (64, 32) if cfg.o_split else (128 if cfg.head_dim_v == 96 else cfg.head_dim_v, 0)
    pv_groups = (2 if cfg.block_n == 192 or (cfg.block_n == 256 and cfg.pv_defer) else 1) * (
        2 if cfg.rowsum == "mma" else 1) + cfg.o_split
    parts = (128, 64) if cfg.block_n == 192 else (128, 128) if cfg.block_n == 256 and cfg.pv_defer else (cfg.block_n, 0)
    assert c == {"BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "HEAD_D": cfg.head_dim_v, "HEAD_QK": cfg.head_dim_qk,
                 "O_W": ow,
                 "O_SPLIT": cfg.o_split, "O_C": oc or 8, "PV_GROUPS": pv_groups,
                 "QK_PARTS": cfg.head_dim_qk // emit_gluon.qk_part_width(cfg), "QK_W": emit_gluon.qk_part_width(cfg),
                 "Q_BOXES": 3 if cfg.block_m == 192 else 1,
                 "STAGES": cfg.num_stages,
                 "Q_STAGES": cfg.q_stages, "NUM_CONSUMERS": cfg.block_m // 64, "OVERLAP": cfg.overlap,
                 "PINGPONG": cfg.ping_pong, "HEAVY_FIRST": cfg.q_order == "heavy_first",
                 "BALANCED": cfg.q_order == "balanced", "V_PERM": cfg.v_permute, "K_PERM": cfg.k_perm,
                 "V_NATURAL": cfg.v_layout == "natural", "NAMED_TURNS": cfg.turn_barrier == "named",
                 "BN_A": parts[0], "BN_B": parts[1], "SPLIT": parts[1] > 0, **fence_constants(cfg),
                 "P_OFFSET": float(cfg.p_scale_log2), "CONSUMER_REGS": consumer_regs,
                 "PRODUCER_REGS": producer_regs, "NUM_WARPS": 4, "PERSISTENT": cfg.persistent,
                 "KERNEL_NAME": KERNEL_NAME, "LEAN": lean,
                 "LEAN_FMA": lean and (cfg.lean_fold in ("fma", "centered") or cfg.qk_acc == "f16"),
                 # lean_ref="max": the line on the row's maximum, lowered 5/16 code (with _f16_fold's margin ~0.45)
                 "LEAN_CENTER": (0.3125 if cfg.lean_ref == "max" else 0.4375 if cfg.lean_fold == "centered" else 0.0)
                                if lean else 0.0, "PV_DEFER": cfg.pv_defer,
                 "LEAN_MAGIC": MAGIC, "LEAN_SAT": lean and cfg.lean_clamp == "sat", "LEAN_SAT_SCALE": 128.0,
                 "LEAN_ASM": lean_tail_asm(cfg.lean_fold, cfg.lean_clamp, cfg.lean_pack) if lean else "",
                 "ROWSUM_MMA": cfg.rowsum == "mma", "CODE_SUMS": lean and cfg.rowsum == "rounded",
                 "CODE_SUM_ASM": code_sum_asm() if lean and cfg.rowsum == "rounded" else "",
                 "CODE_SUM_CONSTRAINTS": "=f,r,r,r,r", "EXP2_POLY": cfg.exp2_poly,
                 "EXP2_ASM": exp2_asm(cfg.exp2_poly, cfg.exp2_poly_degree) if cfg.exp2_poly else "",
                 "EXP2_CONSTRAINTS": EXP2_CONSTRAINTS, "RESCALE_IN_PLACE": in_place, "RESCALE_PACK": ow // 2,
                 "RESCALE_ASM": rescale_asm(ow // 2, skip=cfg.skip_rescale) if in_place else "",
                 "RESCALE_CONSTRAINTS": rescale_constraints(ow // 2) if in_place else "",
                 "RESCALE_C_PACK": oc // 2 or 1,
                 "RESCALE_C_ASM": rescale_asm(oc // 2, skip=cfg.skip_rescale) if in_place and oc else "",
                 "RESCALE_C_CONSTRAINTS": rescale_constraints(oc // 2) if in_place and oc else "",
                 "PACK_P": cfg.p_carry == "e4m3", "E4M3X4_ASM": E4M3X4_ASM.value,
                 "P_SMEM": cfg.p_carry in ("smem", "smem2"), "K_AHEAD": cfg.p_carry in ("smem", "smem2"),
                 "P_SWIZZLE": min(128, cfg.block_n), "P_DOUBLE": cfg.p_carry == "smem2",
                 # smem2: the output tile in the first P tile where 64 x block_n bytes hold 64 x O_W bf16,
                 # or (o_through_p) in chunks of block_n / 2 columns through both P tiles
                 "O_IN_P": cfg.p_carry == "smem2" and not cfg.o_split and (cfg.block_n >= 2 * ow or cfg.o_through_p),
                 "O_CHUNK": cfg.block_n // 2 if cfg.o_through_p else ow,
                 "O_CHUNKS": ow // (cfg.block_n // 2) if cfg.o_through_p else 1,
                 "LANE_SUMS": cfg.lane_sums, "LATE_RESCALE": cfg.late_rescale and cfg.overlap, "HALF_BLOCK": cfg.half_block,
                 # qk_acc="f16": Q rows rescaled so that 448 sum|q| stays within 2^15
                 "F16_S": cfg.qk_acc == "f16", "Q_HEADROOM": 448.0 / 32768.0, "QK_ASYNC": cfg.qk_async,
                 "F16_FOLD_ASM": f16_fold_asm(cfg.lean_fold, cfg.lean_floor) if cfg.qk_acc == "f16" else "",
                 # lean_floor: e4m3's subnormal codes from a second line, 3 codes an octave, meeting at 2^-6
                 "LEAN_FLOOR": cfg.lean_floor, "LEAN_FLOOR_SLOPE": 3.0, "LEAN_FLOOR_AT": -6.0,
                 "F16_PACK_ASM": f16_pack_asm() if cfg.qk_acc == "f16" else "",
                 # lean_mufu: k of every four f16 pairs by the MUFU (the line e = x + P - 8: 1 - 16 u on the
                 # corrected fold's u, 16 t + k on the linear fold's t)
                 "LEAN_MUFU": cfg.lean_mufu,
                 "F16_MUFU_ASM": f16_mufu_asm(cfg.lean_mufu, cfg.lean_fold, cfg.lean_floor) if cfg.lean_mufu else "",
                 "F16_MUFU_CONSTRAINTS": ",".join(["=r"] * 4 + ["r"] * 4 * (
                     5 if cfg.lean_fold == "corrected" else 5 if cfg.lean_floor else 3)), "F16_MUFU_TOP": 1.0,
                 # the corrected fold on f16 scores folds u = 1 - t at the row's own maximum (no 1/8 grid)
                 "F16_U": cfg.qk_acc == "f16" and cfg.lean_fold == "corrected",
                 "LEAN_GRID": lean and cfg.lean_fold in ("fma", "centered") and cfg.lean_ref == "grid",
                 # timeline stamps off (tests/test_timeline.py traces)
                 "TRACE": False, "TRACE_STEPS": 0, "TRACE_EVENTS": len(EVENTS), "TRACE_ASM": "", "TRACE_AFTER_ASM": "",
                 **{f"EV_{name.upper()}": i for i, name in enumerate(EVENTS)}}
    funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert {KERNEL_NAME, "_producer", "_consumer", "_softmax", "_ov_step"} <= set(funcs)
    entry = ast.unparse(funcs[KERNEL_NAME])
    assert entry.count("(_consumer, (") == cfg.block_m // 64 and entry.count("(_producer, (") == 1
    assert entry.count("CONSUMER_REGS, ") == cfg.block_m // 64 - 1 and "PRODUCER_REGS]" in entry
    params = [a.arg for a in funcs[KERNEL_NAME].args.args]
    assert params == list(emit_gluon.descriptor_blocks(cfg)) + list(emit_gluon.SCALAR_PARAMS) + list(emit_gluon.tile_params(cfg)) + ["CAUSAL"]


@pytest.mark.parametrize("cfg", VARIANTS)
def test_only_validated_values_become_text(cfg):
    """Apart from the docstring (the validated config as JSON), the strings in the source are the
    device code's own (fixed) strings and, for lean P (its code sums too) and exp2_poly, the PTX
    generator.lean_asm and generator.exp2_poly build from validated enum / int fields (skip_rescale:
    generator.rescale_asm from the head dim; ex2_fence: generator.fence_asm from the block and
    consumer): the config adds no text of its own."""
    def strings(src: str) -> set:
        tree = ast.parse(src)
        doc = tree.body[0].value
        return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                and n is not doc}
    expected = strings(emit(GLUON).source) - {""}  # the seed: LEAN_ASM = EXP2_ASM = ""
    lean = cfg.softmax == "lean"
    expected |= {lean_tail_asm(cfg.lean_fold, cfg.lean_clamp, cfg.lean_pack) if lean else ""}
    expected |= {code_sum_asm() if lean and cfg.rowsum == "rounded" else ""}  # code sums: no config text
    expected |= {f16_fold_asm(cfg.lean_fold, cfg.lean_floor), f16_pack_asm()} if cfg.qk_acc == "f16" else set()
    expected |= {f16_mufu_asm(cfg.lean_mufu, cfg.lean_fold, cfg.lean_floor)} if cfg.lean_mufu else set()  # enums, 1..4
    expected = (expected - {f16_mufu_constraints(GLUON.lean_fold, GLUON.lean_floor)}) | {f16_mufu_constraints(cfg.lean_fold, cfg.lean_floor)}  # enums
    expected |= {exp2_asm(cfg.exp2_poly, cfg.exp2_poly_degree) if cfg.exp2_poly else ""}
    if emit_gluon.rescale_in_place(cfg):  # skip_rescale, or a 256-key pv_defer block (always, in place)
        expected |= {rescale_asm(cfg.head_dim_v // 2, skip=cfg.skip_rescale), rescale_constraints(cfg.head_dim_v // 2)}
    for value in fence_constants(cfg).values():  # ex2_fence: generator.fence_asm, from ints only
        expected |= set(value) if isinstance(value, tuple) else {value}
    assert strings(emit(cfg).source) == expected

