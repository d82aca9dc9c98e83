"""Gluon kernels compiled for sm_90a on the CPU (generator.build.compile_for_target): the search
space's Gluon seed, every one-field variant of it and a sample of the space compile without
spills, issue FP8 warpgroup MMAs (QGMMA), rebalance registers per role (setmaxnreg), keep their
wgmmas overlapped (no ptxas C7514-style serialisation) and fit the shared-memory estimate; the
register estimate's calibration; the runners' compile check rejects serialised wgmmas.

Each config compiles once per module (the `compiled` fixture); numbers print with pytest -s.
"""

from __future__ import annotations

import dataclasses

import pytest
from gluon_cases import GLUON, SPACE, neighbours, sampled

from zyfa_tune.generator import KernelConfig, emit
from zyfa_tune.generator.build import CompiledArtifacts, compile_for_target
from zyfa_tune.search_spaces import SMEM_LIMIT, gluon_register_estimate, gluon_smem_estimate
from zyfa_tune.search_spaces.base import TMA_SMEM_MARGIN, gluon_infeasibility

CASES = neighbours() + sampled(6)


@pytest.fixture(scope="module")
def compiled():
    cache: dict[tuple, CompiledArtifacts] = {}

    def get(cfg: KernelConfig, causal: bool = True, descales: bool = True) -> CompiledArtifacts:
        key = (cfg, causal, descales)
        if key not in cache:
            art = cache[key] = compile_for_target(emit(cfg), causal=causal, descales=descales)
            changed = {k: v for k, v in cfg.all_fields().items() if v != getattr(GLUON, k)}
            print(f"\n  gluon {changed or 'seed'} causal={causal} descales={descales}: regs={art.registers} "
                  f"spill={art.spill_bytes} smem={art.shared_bytes} QGMMA={art.count('QGMMA')} "
                  f"USETMAXREG={art.count('USETMAXREG')} EX2={art.count('MUFU.EX2')}", end="")
        return cache[key]

    return get


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
    (dict(block_n=256, num_stages=2, block_m=64, ping_pong=False), False),  # 248 <= 256
    (dict(block_n=256, num_stages=2, overlap=False, producer_regs=56), False),  # no P carried: 216
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
    from zyfa_tune import runners

    cfg = GLUON.replace(block_n=256, num_stages=2)
    art = compiled(cfg)
    assert art.serialised_wgmma is not None and "wgmma.mma_async instructions are serialized" in art.serialised_wgmma
    assert compiled(GLUON).serialised_wgmma is None
    no_spill = dataclasses.replace(art, spill_bytes=0)
    monkeypatch.setattr("zyfa_tune.generator.build.compile_for_target", lambda *a, **k: no_spill)
    check = runners.compile_check(cfg, True)
    assert check.error.startswith("ptxas serialises the wgmmas: ") and "serialized" in check.error
