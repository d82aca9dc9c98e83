"""Ahead-of-time compilation for sm_90a on the CPU: every default config and every softmax,
rowsum and lean P variant compiles without spills, fits shared memory, uses the Hopper MMA of its
dtype, and lean P really replaces the exponentials and conversions.

Each config is compiled once per module (the `compiled` fixture memoises on (config, causal)).
Measured numbers are printed (pytest -s shows them).
"""

from __future__ import annotations

import itertools
import re

import pytest

from zyfa_tune.generator import CHOICES, KernelConfig, emit
from zyfa_tune.generator.asm.lean import lean_p_asm
from zyfa_tune.generator.build import CompiledArtifacts, compile_for_target
from zyfa_tune.generator.defaults import default_config

#: sm_90 maximum dynamic shared memory per block: 227 KiB
SM90_SMEM_LIMIT = 232448
HEAD_PAIRS = [(64, 64), (96, 96), (128, 128), (192, 128), (256, 256)]
BASE = default_config("fp8", 128, 128)
SOFTMAX_ROWSUM = [("exact", "fp32"), ("exact", "rounded"), ("exact", "mma"), ("lean", "rounded"), ("lean", "mma")]
LEAN_VARIANTS = list(itertools.product(CHOICES["lean_fold"], CHOICES["lean_clamp"], CHOICES["lean_pack"]))
#: SASS of the fp32 -> e4m3 conversion of P (the exact path's cvt.rn.satfinite.e4m3x2.f32)
E4M3_CVT = "F2FP.SATFINITE.E4M3"
LEAN_BLOCK_RE = re.compile(
    r"// begin inline asm\s*\{\s*\.reg \.b32 r0, r1, r2, r3[^;]*;(.*?)\}\s*// end inline asm", re.S
)


def lean(fold="fma", clamp="imax", pack="prmt", rowsum="rounded") -> KernelConfig:
    return BASE.replace(softmax="lean", rowsum=rowsum, lean_fold=fold, lean_clamp=clamp, lean_pack=pack)


def per_thread(cfg: KernelConfig) -> tuple[int, int]:
    """(probabilities, rows) a thread holds per key tile in the wgmma accumulator layout:
    each warp owns 16 rows (2 per thread) of a 64-row warpgroup slice (warps all along M, as
    for the block_m=128, 8-warp configs checked here)."""
    threads = 32 * cfg.num_warps
    return cfg.block_m * cfg.block_n // threads, cfg.block_m // (8 * cfg.num_warps)


@pytest.fixture(scope="module")
def compiled():
    cache: dict[tuple[KernelConfig, bool], CompiledArtifacts] = {}

    def get(cfg: KernelConfig, causal: bool = True) -> CompiledArtifacts:
        key = (cfg, causal)
        if key not in cache:
            art = compile_for_target(emit(cfg), causal=causal)
            cache[key] = art
            print(
                f"\n  {describe(cfg, causal)}: regs={art.registers} spill={art.spill_bytes}"
                f" smem={art.shared_bytes} MUFU.EX2={art.count('MUFU.EX2')}"
                f" QGMMA={art.count('QGMMA')} HGMMA={art.count('HGMMA')}",
                end="",
            )
        return cache[key]

    return get


def describe(cfg: KernelConfig, causal: bool = True) -> str:
    text = (
        f"{cfg.dtype} {cfg.head_dim_qk}/{cfg.head_dim_v} bm{cfg.block_m} bn{cfg.block_n}"
        f" w{cfg.num_warps} s{cfg.num_stages} {cfg.softmax}/{cfg.rowsum}"
    )
    if cfg.softmax == "lean":
        text += f" {cfg.lean_fold}/{cfg.lean_clamp}/{cfg.lean_pack}"
    if cfg.scale_block:
        text += f" sb{cfg.scale_block}"
    if (cfg.loads, cfg.v_layout) != ("pointer", "natural"):
        text += f" {cfg.loads}/{cfg.v_layout}"
    return text + ("" if causal else " non-causal")


def check_resources(art: CompiledArtifacts, cfg: KernelConfig, spills_ok: bool = False) -> None:
    if not spills_ok:
        assert art.spill_bytes == 0, f"{describe(cfg)} spills {art.spill_bytes} bytes"
    assert 0 < art.shared_bytes <= SM90_SMEM_LIMIT, f"{describe(cfg)} needs {art.shared_bytes} B shared"
    assert 0 < art.registers <= 255
    if cfg.dtype == "fp8":
        assert art.count("QGMMA") > 0 and art.count("HGMMA") == 0
    else:
        assert art.count("HGMMA") > 0 and art.count("QGMMA") == 0
    assert ".target sm_90a" in art.ptx


def check_exact_softmax(art: CompiledArtifacts, cfg: KernelConfig) -> None:
    probs, _ = per_thread(cfg)
    # one exp2 per probability in each of the two key loops (plus the rescale factors)
    assert art.count("MUFU.EX2") >= 2 * probs
    if cfg.dtype == "fp8":
        assert art.count(E4M3_CVT) > 0


def check_lean_softmax(art: CompiledArtifacts, cfg: KernelConfig) -> None:
    probs, rows = per_thread(cfg)
    # only the row rescale factor alpha: one exp2 per row per key loop
    assert 0 < art.count("MUFU.EX2") <= 2 * rows
    # no conversion of P: the codes come out of the FMA (rowsum="mma" converts its ones tile,
    # a constant, once before the loops)
    ones_cvt = 1 if cfg.rowsum == "mma" else 0
    assert art.count(E4M3_CVT) <= ones_cvt
    assert art.ptx.count("cvt.rn.satfinite.e4m3x2.f32") == ones_cvt
    # the asm is present once per pack of four probabilities per key loop, as emitted
    blocks = LEAN_BLOCK_RE.findall(art.ptx)
    assert len(blocks) == 2 * probs // 4
    want = [ln.split()[0] for ln in lean_p_asm(cfg.lean_fold, cfg.lean_clamp, cfg.lean_pack).splitlines()[2:-1]]
    for body in blocks:
        assert [ln.split()[0] for ln in body.strip().splitlines()] == want


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
@pytest.mark.parametrize("dqk,dv", HEAD_PAIRS)
def test_default_configs(compiled, dtype, dqk, dv):
    cfg = default_config(dtype, dqk, dv)
    art = compiled(cfg)
    check_resources(art, cfg)
    check_exact_softmax(art, cfg)


@pytest.mark.parametrize("softmax,rowsum", SOFTMAX_ROWSUM)
def test_softmax_rowsum_variants(compiled, softmax, rowsum):
    cfg = BASE.replace(softmax=softmax, rowsum=rowsum)
    art = compiled(cfg)
    check_resources(art, cfg)
    if softmax == "exact":
        check_exact_softmax(art, cfg)
    else:
        check_lean_softmax(art, cfg)
    plain = compiled(BASE.replace(softmax=softmax, rowsum="rounded"))
    if rowsum == "mma":  # the row sum is an extra MMA of P against a ones tile
        assert art.count("QGMMA") > plain.count("QGMMA")
    else:
        assert art.count("QGMMA") == plain.count("QGMMA")


def test_lean_has_far_fewer_exponentials(compiled):
    exact, fast = compiled(BASE.replace(rowsum="rounded")), compiled(lean())
    probs, rows = per_thread(BASE)
    print(f"\n  MUFU.EX2 exact={exact.count('MUFU.EX2')} lean={fast.count('MUFU.EX2')}", end="")
    assert exact.count("MUFU.EX2") - fast.count("MUFU.EX2") >= 2 * probs


@pytest.mark.parametrize("fold,clamp,pack", LEAN_VARIANTS)
def test_lean_variants(compiled, fold, clamp, pack):
    cfg = lean(fold, clamp, pack)
    art = compiled(cfg)
    check_resources(art, cfg)
    check_lean_softmax(art, cfg)
    probs, _ = per_thread(cfg)
    n_code = 2 * probs  # lean codes computed per thread (two key loops)
    # PTX: the pack instruction of this variant, 3 per 4 codes (the SASS form of both is PRMT,
    # see test_lean_pack_variants_lower_to_prmt, so the source form is checked in the PTX)
    assert art.ptx.count("bfi.b32") == (3 * n_code // 4 if pack == "bfi" else 0)
    if pack == "prmt":
        other = compiled(lean(fold, clamp, "bfi"))
        assert art.ptx.count("prmt.b32") - other.ptx.count("prmt.b32") == 3 * n_code // 4
    # SASS: the clamp survives as one min/max instruction per code ("sat": a saturating FMA instead)
    ref = compiled(lean(fold, "fmax" if clamp == "imax" else "imax", pack))
    if clamp == "sat":
        assert art.count("FFMA.SAT") >= n_code and ref.count("VIMNMX") - art.count("VIMNMX") >= n_code
    else:
        opcode = "VIMNMX" if clamp == "imax" else "FMNMX"
        assert art.count(opcode) - ref.count(opcode) >= n_code
    # SASS: the fold's FMAs survive, one per code ("fma") or two ("sub_fma")
    assert art.count("FFMA") >= (2 if fold == "sub_fma" else 1) * n_code


@pytest.mark.parametrize("fold,clamp", list(itertools.product(CHOICES["lean_fold"], CHOICES["lean_clamp"])))
def test_lean_pack_variants_lower_to_prmt(compiled, fold, clamp):
    """ptxas turns the byte-aligned bfi.b32 into PRMT: both pack variants have the same SASS
    instruction mix (they differ in scheduling only), and no BFI-like opcode appears."""
    a, b = compiled(lean(fold, clamp, "prmt")), compiled(lean(fold, clamp, "bfi"))
    mix = lambda art: sorted(re.findall(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", art.sass, re.M))
    assert mix(a) == mix(b)
    assert b.count("BFI") == b.count("BMSK") == 0


def test_exact_non_causal(compiled):
    art = compiled(BASE, causal=False)
    check_resources(art, BASE)
    check_exact_softmax(art, BASE)
    assert art.cubin != compiled(BASE).cubin


def test_lean_scale_block_forward(compiled):
    cfg = BASE.replace(softmax="lean", rowsum="mma", scale_block=BASE.block_n, q_order="forward")
    art = compiled(cfg)
    check_resources(art, cfg)
    check_lean_softmax(art, cfg)


@pytest.mark.parametrize(
    "loads,v_layout",
    [
        (l, v)
        for l, v in itertools.product(CHOICES["loads"], CHOICES["v_layout"])
        if (l, v) != (BASE.loads, BASE.v_layout)
    ],
)
def test_load_variants(compiled, loads, v_layout):
    """The other load paths of the default FP8 config compile (they are search-space points, not
    defaults: spills are reported by the print, not failed on)."""
    cfg = BASE.replace(loads=loads, v_layout=v_layout)
    art = compiled(cfg)
    check_resources(art, cfg, spills_ok=True)
    check_exact_softmax(art, cfg)
    if loads == "tma":
        assert art.count("UTMALDG") > 0
    if v_layout == "transposed":  # V arrives K-major: no byte-wise transpose through shared memory
        assert art.count("STS.U8") == 0


def test_ptxas_serialisation_verdict_is_kept_per_ptx(tmp_path, monkeypatch):
    """serialised_wgmma runs ptxas once per PTX text and keeps the answer (what the precompile pool
    makes, the worker reads); a memo that does not read as one is redone, never trusted."""
    from zyfa_tune.generator import build

    monkeypatch.setenv("ZYFA_TUNE_CACHE", str(tmp_path))
    runs = []
    warning = "ptxas warning : (C7514) wgmma.mma_async instructions are serialized due to register pressure"

    def fake_log(ptx, capability=90):
        runs.append(ptx)
        return warning if "pressure" in ptx else "ptxas info : 168 registers"

    monkeypatch.setattr(build, "ptxas_log", fake_log)
    assert build.serialised_wgmma("// pressure") == warning and len(runs) == 1
    assert build.serialised_wgmma("// pressure") == warning and len(runs) == 1  # kept
    assert build.serialised_wgmma("// fine") is None and len(runs) == 2
    assert build.serialised_wgmma("// fine") is None and len(runs) == 2
    (kept,) = (tmp_path / "ptxas").glob(f"{build.hashlib.sha256(b'// pressure').hexdigest()[:32]}-triton*.json")
    for damaged in ("{", '{"serialised": 3}', '{"serialised": null, "x": 1}', "null"):
        kept.write_text(damaged)
        assert build.serialised_wgmma("// pressure") == warning
    assert len(runs) == 6
