"""Gluon emission (generator/gluon_sm90/emit.py): deterministic source with the config baked in as
constants, stable hashes, every kernel field reaching the code, the constants meaning what the config
says, only validated values as text."""

from __future__ import annotations

import ast
import hashlib

import pytest
from gluon_cases import GLUON, neighbours, sampled

from zyfa_tune.generator import KernelConfig, emit
from zyfa_tune.generator.defaults import default_config
from zyfa_tune.generator.emitted import KERNEL_NAME
from zyfa_tune.generator.gluon_sm90 import device
from zyfa_tune.generator.gluon_sm90 import emit as emit_gluon
from zyfa_tune.generator.gluon_sm90.trace import TraceBuffer
from zyfa_tune.generator.triton import emit as emit_triton
from zyfa_tune.search_spaces.seeds import (
    gluon_defer_config,
    gluon_lean_config,
    gluon_lean_f16_config,
    gluon_smem2_chunked_config,
    gluon_smem2_config,
    gluon_three_config,
)

#: the Gluon seed, one variant per value of every field the space searches for it, a sample of
#: the space's points, and P through shared memory (not searched), with a 128- and a 64-byte swizzle
VARIANTS = (
    neighbours()
    + sampled(20)
    + [
        GLUON.replace(p_carry="smem"),
        default_config("fp8", 256, 256, "gluon").replace(p_carry="smem"),
        GLUON.replace(p_carry="smem2"),
        gluon_smem2_config("fp8", 128, 128),
        gluon_smem2_chunked_config("fp8", 256, 256),
        gluon_smem2_chunked_config("fp8", 192, 128),
        gluon_lean_f16_config("fp8", 128, 128),
        *(gluon_lean_f16_config("fp8", 128, 128).replace(lean_fold="corrected", lean_mufu=k) for k in (1, 2)),
        gluon_lean_f16_config("fp8", 128, 128).replace(lean_ref="max", lean_mufu=1),
        gluon_lean_f16_config("fp8", 128, 128).replace(lean_ref="max", lean_floor=True, lean_mufu=2),
        gluon_lean_f16_config("fp8", 128, 128).replace(lean_ref="max"),
        gluon_lean_f16_config("fp8", 128, 128).replace(lean_ref="max", lean_floor=True),
        gluon_lean_f16_config("fp8", 128, 128).replace(lean_floor=True),
    ]
)


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
    return "\n".join(source.splitlines()[tree.body[0].end_lineno :])


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


def split_block(cfg: KernelConfig) -> bool:
    return cfg.block_n == 192 or (cfg.block_n == 256 and cfg.pv_defer)


def power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@pytest.mark.parametrize("cfg", VARIANTS)
def test_source_carries_the_config(cfg):
    """The source compiles as Python, its docstring holds the config (round trip), and its module
    constants are schedule_constants(cfg) as literals plus the host's three."""
    src = emit(cfg).source
    tree = ast.parse(src)
    compile(tree, "<emitted>", "exec")
    (line,) = [ln for ln in ast.get_docstring(tree).splitlines() if ln.startswith("config: ")]
    assert KernelConfig.from_json(line[len("config: ") :]) == cfg
    c = constants(src)
    host = {"NUM_WARPS": 4, "PERSISTENT": cfg.persistent, "KERNEL_NAME": KERNEL_NAME}
    own = constants(device.source())  # the device code's own (E4M3X4_ASM)
    device_only = {k: v for k, v in c.items() if k not in host and k not in own}
    assert device_only == emit_gluon.schedule_constants(cfg)
    assert {k: c[k] for k in host} == host


@pytest.mark.parametrize("cfg", VARIANTS)
def test_constants_mean_the_config(cfg):
    """Each constant says what its field means: shapes, the key / column / O parts (powers of two that
    add up to the block and head dims), the register split, and which variant is on."""
    k = emit_gluon.schedule_constants(cfg)
    assert (k["BLOCK_M"], k["BLOCK_N"], k["HEAD_QK"], k["HEAD_D"]) == (
        cfg.block_m,
        cfg.block_n,
        cfg.head_dim_qk,
        cfg.head_dim_v,
    )
    assert k["NUM_CONSUMERS"] == cfg.block_m // 64 and k["STAGES"] == cfg.num_stages
    # key parts: one, or two powers of two adding up to the block
    assert k["SPLIT"] == split_block(cfg) == (k["BN_B"] > 0)
    assert (
        k["BN_A"] + k["BN_B"] == cfg.block_n and power_of_two(k["BN_A"]) and (k["BN_B"] == 0 or power_of_two(k["BN_B"]))
    )
    # Q / K column parts and O columns: powers of two covering the head dims
    assert k["QK_PARTS"] * k["QK_W"] == cfg.head_dim_qk and power_of_two(k["QK_W"])
    if cfg.o_split:
        assert k["O_SPLIT"] and k["O_W"] + k["O_C"] == cfg.head_dim_v
    else:
        assert power_of_two(k["O_W"]) and cfg.head_dim_v <= k["O_W"] < 2 * cfg.head_dim_v
    assert k["O_CHUNK"] * k["O_CHUNKS"] == k["O_W"]
    # registers: within the architecture's limits, and a warpgroup's worth of the file each
    consumers, producer = k["CONSUMER_REGS"], k["PRODUCER_REGS"]
    assert 24 <= producer <= consumers <= 256 and consumers % 8 == 0 == producer % 8
    if k["NUM_CONSUMERS"] > 1:
        assert 128 * (consumers * k["NUM_CONSUMERS"] + producer) <= 65536
    # the variants
    lean = cfg.softmax == "lean"
    assert k["LEAN"] == lean and bool(k["LEAN_ASM"]) == lean
    assert k["ROWSUM_MMA"] == (cfg.rowsum == "mma") and k["CODE_SUMS"] == (lean and cfg.rowsum == "rounded")
    assert k["PV_GROUPS"] == (2 if k["SPLIT"] else 1) * (2 if k["ROWSUM_MMA"] else 1) + k["O_SPLIT"]
    assert k["P_SMEM"] == (cfg.p_carry in ("smem", "smem2")) and k["P_DOUBLE"] == (cfg.p_carry == "smem2")
    assert k["PACK_P"] == (cfg.p_carry == "e4m3")
    assert (k["HEAVY_FIRST"], k["BALANCED"]) == (cfg.q_order == "heavy_first", cfg.q_order == "balanced")
    assert (k["OVERLAP"], k["PINGPONG"], k["PV_DEFER"]) == (cfg.overlap, cfg.ping_pong, cfg.pv_defer)
    assert (k["V_PERM"], k["K_PERM"], k["V_NATURAL"]) == (cfg.v_permute, cfg.k_perm, cfg.v_layout == "natural")
    assert k["P_OFFSET"] == float(cfg.p_scale_log2) and k["P_SWIZZLE"] == min(128, cfg.block_n)
    f16 = cfg.qk_acc == "f16"
    assert k["F16_S"] == f16 and bool(k["F16_FOLD_ASM"]) == f16 and bool(k["F16_PACK_ASM"]) == f16
    assert bool(k["F16_MUFU_ASM"]) == (cfg.lean_mufu > 0) and k["LEAN_MUFU"] == cfg.lean_mufu
    assert k["EXP2_POLY"] == cfg.exp2_poly and bool(k["EXP2_ASM"]) == (cfg.exp2_poly > 0)
    assert k["RESCALE_IN_PLACE"] == emit_gluon.rescale_in_place(cfg) == bool(k["RESCALE_ASM"])
    assert bool(k["RESCALE_C_ASM"]) == (k["RESCALE_IN_PLACE"] and cfg.o_split)
    # ex2_fence: one asm per consumer warpgroup, each on its own named barrier
    fences = k["ROW_SUM_FENCE_ASM"] if cfg.rowsum == "fp32" else k["P_FENCE_A_ASM"]
    assert (len(set(fences)) == 3) == cfg.ex2_fence and all(a == "" for a in fences) == (not cfg.ex2_fence)
    # timeline stamps only in a traced twin
    assert not k["TRACE"] and k["TRACE_ASM"] == k["TRACE_AFTER_ASM"] == ""


def test_lean_and_exact_seeds():
    """Lean P's constants on the lean seed and off on the exact one (its fold's magic and scale in
    range); the f16 lean seed folds on f16 scores and scales Q's rows into range."""
    exact = emit_gluon.schedule_constants(GLUON)
    lean = emit_gluon.schedule_constants(gluon_lean_config("fp8", 128, 128))
    f16 = emit_gluon.schedule_constants(gluon_lean_f16_config("fp8", 128, 128))
    assert not exact["LEAN"] and exact["LEAN_ASM"] == "" and not exact["LEAN_FMA"] and exact["LEAN_CENTER"] == 0.0
    assert lean["LEAN"] and "cvt" not in lean["LEAN_ASM"] and lean["LEAN_MAGIC"] == 1.5 * 2**23
    assert f16["F16_S"] and f16["LEAN"] and 0 < f16["Q_HEADROOM"] * 2**15 <= 448.0


def test_structural_seeds():
    """Two key parts for a 192-key block (128 + 64) and a 256-key pv_defer block (128 + 128); three
    consumers for a 192-row tile, each a box of its own; O through two P tiles in chunks."""
    for cfg in (default_config("fp8", 128, 128, "gluon").replace(block_n=192), gluon_defer_config("fp8", 256, 256)):
        k = emit_gluon.schedule_constants(cfg)
        if k["SPLIT"]:
            assert (k["BN_A"], k["BN_B"]) == ((128, 64) if cfg.block_n == 192 else (128, 128))
    three = emit_gluon.schedule_constants(gluon_three_config("fp8", 96, 96))
    assert three["NUM_CONSUMERS"] == 3 and three["Q_BOXES"] == 3
    chunked = emit_gluon.schedule_constants(gluon_smem2_chunked_config("fp8", 256, 256))
    assert chunked["O_IN_P"] and chunked["O_CHUNKS"] > 1


def test_traced_twin_differs_in_stamps_only():
    """A traced twin turns the stamps on (its asm, its slot count) and changes no other constant."""
    plain = emit_gluon.schedule_constants(GLUON)
    traced = emit_gluon.schedule_constants(GLUON, TraceBuffer(address=1 << 20, steps=8))
    changed = {k for k in plain if plain[k] != traced[k]}
    assert changed == {"TRACE", "TRACE_STEPS", "TRACE_ASM", "TRACE_AFTER_ASM"}
    assert traced["TRACE"] and traced["TRACE_STEPS"] == 8 and "%clock" in traced["TRACE_ASM"]


@pytest.mark.parametrize("cfg", VARIANTS)
def test_entry_kernel(cfg):
    """One consumer partition per 64 rows and one producer, the register split for the workers, and
    the parameters the launcher passes, in its order."""
    tree = ast.parse(emit(cfg).source)
    funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert {KERNEL_NAME, "_producer", "_consumer", "_softmax", "_ov_step"} <= set(funcs)
    entry = ast.unparse(funcs[KERNEL_NAME])
    assert entry.count("(_consumer, (") == cfg.block_m // 64 and entry.count("(_producer, (") == 1
    assert entry.count("CONSUMER_REGS, ") == cfg.block_m // 64 - 1 and "PRODUCER_REGS]" in entry
    params = [a.arg for a in funcs[KERNEL_NAME].args.args]
    assert params == (
        list(emit_gluon.descriptor_blocks(cfg))
        + list(emit_gluon.SCALAR_PARAMS)
        + list(emit_gluon.tile_params(cfg))
        + ["CAUSAL"]
    )


def strings(src: str) -> set[str]:
    """The string constants of a source, its module docstring left out."""
    tree = ast.parse(src)
    first = tree.body[0]
    doc = first.value if isinstance(first, ast.Expr) else None
    return {
        n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str) and n is not doc
    }


def constant_strings(cfg: KernelConfig) -> set[str]:
    out: set[str] = set()
    for value in emit_gluon.schedule_constants(cfg).values():
        out |= {v for v in (value if isinstance(value, tuple) else (value,)) if isinstance(v, str)}
    return out


@pytest.mark.parametrize("cfg", VARIANTS)
def test_only_validated_values_become_text(cfg):
    """Apart from the docstring (the validated config as JSON), the strings in the source are the
    device code's own, the parameter names and kernel name, and the PTX of schedule_constants (built
    by generator/asm from validated enum / int fields): the config adds no text of its own."""
    fixed = strings(device.source()) | set(emit_gluon.SCALAR_PARAMS) | {KERNEL_NAME}
    got = strings(emit(cfg).source)
    assert got <= fixed | constant_strings(cfg)
    assert constant_strings(cfg) - {""} <= got
    for text in constant_strings(cfg):  # PTX, never the config's own text
        assert cfg.to_json() not in text
