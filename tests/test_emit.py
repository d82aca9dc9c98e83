"""Kernel emission: determinism, hashing, well-formed source, no config text flowing into code,
and the lean P PTX text (generator/asm/lean.py)."""

from __future__ import annotations

import ast
import hashlib
import itertools
import json
import random
import re

import pytest

from zyfa_tune.generator import CHOICES, ConfigError, EmittedKernel, KernelConfig, chunks_of, emit, head_chunks
from zyfa_tune.generator.asm.lean import LEAN_P_CONSTRAINTS, lean_p_asm
from zyfa_tune.generator.config import GLUON_FIELDS
from zyfa_tune.generator.defaults import default_config
from zyfa_tune.generator.triton.emit import KERNEL_NAME

LEAN_VARIANTS = list(itertools.product(CHOICES["lean_fold"], CHOICES["lean_clamp"], CHOICES["lean_pack"]))


def sample_configs(n: int = 150, seed: int = 0) -> list[KernelConfig]:
    """Valid Triton-backend configs drawn at random from CHOICES (invalid combinations are redrawn;
    Gluon configs have their own tests, tests/test_gluon_emit.py)."""
    rng = random.Random(seed)
    out: list[KernelConfig] = []
    seen: set[KernelConfig] = set()
    while len(out) < n:
        values = {name: rng.choice(choices) for name, choices in CHOICES.items()}
        values.update(backend="triton", **{f: getattr(KernelConfig(), f) for f in GLUON_FIELDS})
        if values["scale_block"]:
            values["scale_block"] = values["block_n"]
        try:
            cfg = KernelConfig(**values)
        except ConfigError:
            continue
        if cfg not in seen:
            seen.add(cfg)
            out.append(cfg)
    return out


SAMPLE = sample_configs()
#: hand-picked configs covering every enum value at least once
NAMED = {
    "default": KernelConfig(),
    "bf16": KernelConfig(dtype="bf16", p_scale_log2=0, head_dim_qk=96, head_dim_v=96),
    "lean_mma_sb": KernelConfig(softmax="lean", rowsum="mma", scale_block=128, q_order="forward"),
    "lean_sub_fmax_bfi": KernelConfig(
        softmax="lean",
        rowsum="rounded",
        lean_fold="sub_fma",
        lean_clamp="fmax",
        lean_pack="bfi",
        head_dim_qk=192,
        block_n=64,
    ),
}


def code_only(source: str) -> str:
    """The source without its module docstring (which records the config as JSON)."""
    tree = ast.parse(source)
    assert isinstance(tree.body[0], ast.Expr) and isinstance(tree.body[0].value, ast.Constant)
    return "\n".join(source.splitlines()[tree.body[0].end_lineno :])


def module_constant(source: str, name: str):
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets if isinstance(t, ast.Name)] == [name]:
            return ast.literal_eval(node.value)
    raise AssertionError(f"{name} not assigned at module level")


# ---- determinism and hashing ----------------------------------------------------------------


@pytest.mark.parametrize("name", NAMED)
def test_emit_is_deterministic(name):
    cfg = NAMED[name]
    a, b = emit(cfg), emit(cfg)
    fresh = emit(KernelConfig.from_json(cfg.to_json()))  # a separate, equal instance
    assert isinstance(a, EmittedKernel)
    assert a.source == b.source == fresh.source
    assert a.source_hash == b.source_hash == fresh.source_hash
    assert a.source_hash == hashlib.sha256(a.source.encode()).hexdigest()[:16]
    assert re.fullmatch(r"[0-9a-f]{16}", a.source_hash)
    assert a.kernel_name == KERNEL_NAME and a.config == cfg


def test_distinct_configs_give_distinct_hashes():
    hashes = {emit(cfg).source_hash for cfg in SAMPLE}
    assert len(hashes) == len(SAMPLE)


@pytest.mark.parametrize("field", [f for f in CHOICES if f not in ("dtype", "softmax")])
def test_every_field_reaches_the_code(field):
    """Each field changes the emitted code itself (not only the docstring), except that the lean
    sequence fields are irrelevant (and so absent) when softmax='exact'."""
    exact = KernelConfig(block_n=64)
    lean = KernelConfig(block_n=64, softmax="lean", rowsum="rounded")
    for base in (exact, lean):
        for value in CHOICES[field]:
            if value == getattr(base, field):
                continue
            changes = {field: value}
            if field == "scale_block":
                changes["block_n"] = value or 64
            if field == "block_n":
                changes["scale_block"] = 0
            try:
                other = base.replace(**changes)
            except ConfigError:
                continue  # e.g. rowsum='fp32' with lean
            a, b = emit(base).source, emit(other).source
            assert a != b
            if field.startswith("lean_") and base.softmax == "exact":
                assert code_only(a) == code_only(b), (field, value)
            else:
                assert code_only(a) != code_only(b), (field, value)


def test_emit_rejects_non_config():
    for bad in (None, {}, KernelConfig().to_dict(), KernelConfig().to_json(), "fp8"):
        with pytest.raises(TypeError, match="emit\\(\\) takes a KernelConfig"):
            emit(bad)


# ---- source well-formedness ------------------------------------------------------------------


@pytest.mark.parametrize("cfg", SAMPLE[:40] + list(NAMED.values()))
def test_source_parses_and_records_config(cfg):
    src = emit(cfg).source
    tree = ast.parse(src)
    compile(tree, "<emitted>", "exec")
    doc = ast.get_docstring(tree)
    config_lines = [ln for ln in doc.splitlines() if ln.startswith("config: ")]
    assert len(config_lines) == 1
    assert KernelConfig.from_json(config_lines[0][len("config: ") :]) == cfg
    assert module_constant(src, "NUM_WARPS") == cfg.num_warps
    assert module_constant(src, "NUM_STAGES") == cfg.num_stages
    assert module_constant(src, "BLOCK_M") == cfg.block_m
    assert module_constant(src, "KERNEL_NAME") == KERNEL_NAME
    funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert KERNEL_NAME in funcs
    assert ("_lean_p" in funcs) == (cfg.softmax == "lean")


@pytest.mark.parametrize("cfg", SAMPLE + list(NAMED.values()))
def test_string_literals_are_from_a_fixed_set(cfg):
    """Config strings reach the source only through fixed mappings, never as text: apart from
    the docstring (which holds the validated config as JSON), every string literal is one of a
    few constants or the lean asm text for the config's variant."""
    tree = ast.parse(emit(cfg).source)
    allowed = {KERNEL_NAME, "-inf"}
    if cfg.softmax == "lean":
        allowed |= {lean_p_asm(cfg.lean_fold, cfg.lean_clamp, cfg.lean_pack), LEAN_P_CONSTRAINTS}
    docstring = tree.body[0].value
    literals = [n for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    rest = {n.value for n in literals if n is not docstring}
    assert rest <= allowed, rest - allowed
    if cfg.softmax == "lean":
        assert rest == allowed
    # no bytes / f-string / JoinedStr constructs at all
    assert not any(isinstance(n, ast.JoinedStr) for n in ast.walk(tree))
    assert not any(isinstance(n, ast.Constant) and isinstance(n.value, bytes) for n in ast.walk(tree))


@pytest.mark.parametrize("cfg", SAMPLE[:40] + list(NAMED.values()))
def test_only_needed_code_is_emitted(cfg):
    code = code_only(emit(cfg).source)
    qk_chunks, v_chunks = chunks_of(cfg)
    n_qk, n_v = len(qk_chunks), len(v_chunks)
    # two key loops (unmasked, then the masked diagonal band / ragged end)
    assert code.count("for n0 in tl.range(") == 2
    dots = n_qk + n_v + (1 if cfg.rowsum == "mma" else 0)
    assert code.count("tl.dot(") == 2 * dots
    # exact: exp2 of the rescale factor and of the scores; lean: the rescale factor only
    assert code.count("tl.math.exp2(") == (2 if cfg.softmax == "lean" else 4)
    assert ("inline_asm_elementwise" in code) == (cfg.softmax == "lean")
    assert ("k_exp" in code) == (cfg.scale_block != 0)
    assert ("tl.float8e4nv" in code) == (cfg.dtype == "fp8")
    assert ("v_descale" in code) == (cfg.dtype == "fp8")
    assert ("N_M_BLOCKS - 1 - pid" in code) == (cfg.q_order == "heavy_first")
    assert ("tl.ceil(m_new * 8.0) * 0.125" in code) == (cfg.softmax == "lean" and cfg.lean_fold == "fma")
    assert f"ref = m_new - {cfg.p_scale_log2}.0" in code
    for off, w in qk_chunks:
        if cfg.loads == "tma":
            assert f"desc_q_{w}.load([b * SEQ_Q + start_m * {cfg.block_m}, h * {cfg.head_dim_qk} + {off}])" in code
            assert f"desc_k_{w}.load([b * SEQ_K + n0, hk * {cfg.head_dim_qk} + {off}])" in code
        else:
            assert f"({off} + tl.arange(0, {w}))[None, :]" in code
    assert ("desc_" in code) == (cfg.loads == "tma")
    assert ("tl.load(k_base" in code) == (cfg.loads == "pointer")
    assert ("stride_vd" in code) == (cfg.loads == "pointer" and cfg.v_layout == "transposed")


# ---- head chunks -----------------------------------------------------------------------------


def test_head_chunks_examples():
    assert head_chunks(96) == [(0, 64), (64, 32)]
    assert head_chunks(192) == [(0, 128), (128, 64)]
    assert head_chunks(128) == [(0, 128)]
    assert head_chunks(64) == [(0, 64)]
    assert head_chunks(256) == [(0, 256)]


@pytest.mark.parametrize("dim", [d for d in CHOICES["head_dim_qk"] if d % 16 == 0])
def test_head_chunks_properties(dim):
    """Widths of 16s split into distinct power-of-two chunks end to end (overlaps: test_head_dims.py)."""
    chunks = head_chunks(dim)
    widths = [w for _, w in chunks]
    assert all(w & (w - 1) == 0 for w in widths)
    assert widths == sorted(widths, reverse=True) and len(set(widths)) == len(widths)
    offsets = [o for o, _ in chunks]
    assert offsets == list(itertools.accumulate([0] + widths[:-1]))
    assert sum(widths) == dim


# ---- lean asm text ---------------------------------------------------------------------------


def asm_ops(text: str) -> list[str]:
    return [ln.split()[0] for ln in text.splitlines()[2:-1]]


@pytest.mark.parametrize("fold,clamp,pack", LEAN_VARIANTS)
def test_lean_asm_instruction_counts(fold, clamp, pack):
    text = lean_p_asm(fold, clamp, pack)
    lines = text.splitlines()
    scratch = ", t, u" if fold == "corrected" else ""
    assert lines[0] == "{" and lines[1] == f".reg .b32 r0, r1, r2, r3{scratch};" and lines[-1] == "}"
    ops = asm_ops(text)
    # per score: fma 1 FMA; sub_fma 2; corrected 4 FMAs + max (x floor) + add.rm + 2 sub
    fold_fmas = {"fma": 4, "centered": 4, "sub_fma": 8, "corrected": 16}[fold]
    fold_other = {"fma": 0, "centered": 0, "sub_fma": 0, "corrected": 16}[fold]
    x_floor = 4 if fold == "corrected" else 0
    if clamp == "sat":  # the fold's last FMA saturates; the clamp is one more FMA (+ magic), no max
        assert ops.count("fma.rn.sat.f32") == 4 and ops.count("fma.rn.f32") == fold_fmas - 4 + 4
        assert ops.count("max.s32") == 0 and ops.count("max.f32") == x_floor
    else:
        assert ops.count("fma.rn.f32") == fold_fmas and "sat" not in text
        assert ops.count("max.s32" if clamp == "imax" else "max.f32") == 4 + (x_floor if clamp == "fmax" else 0)
        assert ops.count("max.f32" if clamp == "imax" else "max.s32") == (x_floor if clamp == "imax" else 0)
    if fold == "corrected":
        assert ops.count("add.rm.f32") == 4 and ops.count("sub.f32") == 8
    assert ops.count("prmt.b32" if pack == "prmt" else "bfi.b32") == 3
    assert ops.count("bfi.b32" if pack == "prmt" else "prmt.b32") == 0
    assert len(ops) == fold_fmas + fold_other + 4 + 3
    assert "ex2" not in text and "cvt" not in text and "mufu" not in text.lower()
    # operands: $0 written once (last), $1..$12 all read, nothing beyond
    assert [ln for ln in lines if "$0" in ln] == [lines[-2]]
    assert sorted({int(m) for m in re.findall(r"\$(\d+)", text)}) == list(range(13))
    # the asm ends with one statement per line, each terminated by ';'
    assert all(ln.endswith(";") for ln in lines[1:-1])


def test_lean_asm_variants_differ_and_constraints():
    """Every variant is its own PTX, except that "centered" is "fma"'s instruction sequence: its
    offset lives in the per-row b and the reference grid, which the kernel source computes."""
    texts = {v: lean_p_asm(*v) for v in LEAN_VARIANTS}
    distinct = [v for v in LEAN_VARIANTS if v[0] != "centered"]
    assert len({texts[v] for v in distinct}) == len(distinct)
    assert all(texts[("centered", *v[1:])] == texts[("fma", *v[1:])] for v in distinct if v[0] == "fma")
    assert LEAN_P_CONSTRAINTS == "=r," + ",".join(["f"] * 12)
    for backend in ("triton", "gluon"):
        lean = default_config("fp8", 128, 128, backend).replace(
            softmax="lean", rowsum="rounded" if backend == "triton" else "mma"
        )
        plain, centered = emit(lean).source, emit(lean.replace(lean_fold="centered")).source
        assert plain != centered and ("0.4375" in centered) and ("0.4375" not in plain)


@pytest.mark.parametrize("bad", [("fma2", "imax", "prmt"), ("fma", "max", "prmt"), ("fma", "imax", "shf")])
def test_lean_asm_rejects_unknown_variant(bad):
    with pytest.raises(ValueError, match="unknown lean"):
        lean_p_asm(*bad)


def test_config_json_in_docstring_cannot_close_it():
    """The docstring holds the config JSON; validated values never contain quotes or newlines,
    so the docstring cannot be terminated early."""
    for cfg in SAMPLE:
        doc_json = cfg.to_json()
        assert '"""' not in doc_json and "\n" not in doc_json and "\\" not in doc_json
        assert json.loads(doc_json) == cfg.to_dict()
