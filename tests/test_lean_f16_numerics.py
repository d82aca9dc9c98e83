"""Lean P on f16 scores (qk_acc="f16"), on the CPU: the generator's f16 fold, pack and MUFU PTX
(generator/asm/lean.py), interpreted on rows of f16 scores as the Gluon kernel folds them
(tests/lean_model.py), against the float32 fold, correct rounding and e4m3's range.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from lean_model import (
    LOG2E,
    e4m3_code,
    f16,
    f16_bits,
    f16_codes,
    f16_mufu_codes,
    f16_row,
    f32,
    intended_code,
    mufu_share,
    ref_row,
    run_f16_asm,
)

from zyfa_tune.generator.asm.lean import (
    E4M3_ONE_CODE,
    LEAN_CENTER,
    LEAN_MAX_CENTER,
    MUFU_GROUP,
    ONE_FMA_FOLDS,
    f16_fold_asm,
    f16_mufu_asm,
    f16_mufu_constraints,
    f16_pack_asm,
    fold_center,
)


@pytest.mark.parametrize("fold", ONE_FMA_FOLDS)
def test_f16_fold_codes_match_the_float32_fold(fold):
    """qk_acc="f16": on the same (f16) scores, the f16 fold's codes equal round(8x + 56 + 8P - center) of x
    moved by the row's shift (b lowered by 2^-11 + |b| 2^-10, then rounded: < 1/16 + 3/16 |b| + |m| / 256
    codes down, 1/4 code at |b| < 1, 3.7 codes at a row maximum of 200 log2 units) but where a's f16 rounding, which scales x by (1 + <2^-11),
    moves a score across a rounding boundary: never more than one code apart, the same code for ~97% (96.7% fma, 97.9% centered)."""
    rng = np.random.default_rng(7)
    p_offset, total, equal = 7, 0, 0
    for scale in (f32(LOG2E / math.sqrt(128)), f32(LOG2E / math.sqrt(128) * 2.0**7 / 3.0), 0.37):
        for ref in (*rng.uniform(-20.0, 20.0, size=6), *rng.uniform(-200.0, 200.0, size=2)):
            n = math.ceil(8 * ref + fold_center(fold))  # the grid index of a row maximum ref (log2 units)
            ref_g = (n - fold_center(fold)) / 8
            _, b, shift = f16_row(scale, n, p_offset, fold)
            assert -(1 / 16 + 3 / 16 * abs(b) + abs(ref_g) / 256) < shift <= 2.0**-12, (scale, ref, b, shift)
            x = rng.uniform(-14.0, 0.0, size=64)
            s = [f16((xi + ref_g) / scale) for xi in x]
            got = f16_codes(s, scale, n, p_offset, fold)
            for si, c in zip(s, got):
                want = intended_code(
                    Fraction(si) * Fraction(scale) - Fraction(ref_g) + p_offset + Fraction(shift) / 8, fold
                )
                assert abs(c - min(want, 255)) <= 1, (scale, ref, si, c, want)
                total, equal = total + 1, equal + (c == want)
    assert equal / total >= 0.96, equal / total


def test_f16_fold_never_codes_past_e4m3s_maximum():
    """Rows with logits of thousands (the "llm" and "outliers" families reach ~1200 log2 units at 16K): the row
    maximum's code is never past 125 (e4m3's largest finite is 126, 0x7f its NaN), whatever the maximum, up to
    f16's headroom, at p_scale_log2 = 7 and 8 (2^8, code 120, is 7 codes below NaN). The one-FMA folds keep it
    at or below 56 + 8P; the corrected fold lets it rise (by a and b's roundings) only to 125, so that b moves
    only on such rows and rows of ordinary logits keep their maximum on its exact code. (b rounded to nearest
    with a's rounding left in gives 0x7f on those families: its f16 step is 4-8 codes at
    |b| ~ 64-128.)"""
    rng = np.random.default_rng(11)
    for fold in (*ONE_FMA_FOLDS, "corrected"):
        for p_offset in (7, 8):
            top = E4M3_ONE_CODE + 8 * p_offset
            ceiling, lowest = (125 if fold == "corrected" else top), top
            for ref in (*rng.uniform(-3000.0, 3000.0, size=24), 1999.96, -1999.96, 4000.3):
                scale = f32(LOG2E / math.sqrt(128) * 2.0 ** int(rng.integers(-2, 6)))
                if abs(ref / scale) >= 65504.0:  # (past f16: _q_headroom keeps scores within 2^15)
                    continue
                s_max = f16(ref / scale)
                row_max = f32(s_max * scale)  # the kernel's maximum, max(s) qk_scale in float32
                n = math.ceil(8 * row_max + fold_center(fold)) if fold in ONE_FMA_FOLDS else 8.0 * row_max
                code = f16_codes([s_max, s_max, s_max, s_max], scale, n, p_offset, fold)[0]
                assert code <= ceiling, (fold, p_offset, ref, scale, code)
                lowest = min(lowest, code)
            assert lowest >= top - 64  # (< 1/16 + 3/16 |b| + |m| / 256 codes: ~59 at |m| = 4000)


def test_f16_corrected_fold_matches_correct_rounding():
    """qk_acc="f16" with lean_fold="corrected": the f16 PTX's codes (interpreted) equal the correctly rounded
    e4m3 of 2^(x + P) (x moved by the row's shift, f16_row) for ~95.5% of x in the normal range (x + P >= -6),
    never more than one code away, over rows of several maxima (the float32 "corrected" fold: ~97%, the
    linear fold: 54%). u's own f16 rounding costs the 1.5%: b is a long f16 but for few maxima (97% where it
    is short, as at a maximum of 12 without b's margin)."""
    p_offset, scale = 7, 0.125
    xs = [i / 256 + 1 / 512 for i in range(-13 * 256, 0)]
    normal = [i for i, x in enumerate(xs) if x + p_offset >= -6]

    def share(fold: str, m: float) -> float:
        s = [f16((x + m) / scale) for x in xs]
        got, shift = f16_codes(s, scale, 8 * m, p_offset, fold), f16_row(scale, 8 * m, p_offset, fold)[2]
        want = [
            int(
                torch.tensor(2.0 ** (si * scale - m + p_offset + shift / 8), dtype=torch.float64)
                .to(torch.float8_e4m3fn)
                .view(torch.uint8)
            )
            for si in s
        ]
        assert fold != "corrected" or max(abs(got[i] - want[i]) for i in normal) <= 1
        return sum(got[i] == want[i] for i in normal) / len(normal)

    maxima = (12.0, 12.3, 3.7, -5.2, 40.1)
    shares = [share("corrected", m) for m in maxima]
    assert min(shares) >= 0.94 and sum(shares) / len(shares) >= 0.95, shares
    assert share("fma", 12.3) < 0.6


def test_f16_corrected_fold_is_exact_at_the_top_of_a_row():
    """The corrected f16 fold folds the reversed line u = 1 - t, and its row maximum is no grid point: the
    row's largest score gets the code of 2^P exactly (56 + 8P) whatever the maximum, and the top two octaves,
    the probabilities that weigh most, match the correctly rounded e4m3 (of x moved by the row's shift,
    f16_row) for >= 97% of scores (folding t, f16's 1/16-code steps near t = 1 made it ~95%;
    tests/test_gpu_gluon.py has the error)."""
    rng = np.random.default_rng(3)
    p_offset, total, equal = 7, 0, 0
    for _ in range(40):
        m, scale = rng.uniform(-12.0, 12.0), f32(LOG2E / math.sqrt(128) * 2.0 ** int(rng.integers(-3, 4)))
        s = [f16((x + m) / scale) for x in rng.uniform(-2.0, 0.0, size=64)]
        row_max = f32(max(s) * scale)  # the kernel's maximum: max(s) * qk_scale in float32
        got = f16_codes(s, scale, 8.0 * row_max, p_offset, "corrected")
        shift = f16_row(scale, 8.0 * row_max, p_offset, "corrected")[2]
        want = [
            int(
                torch.tensor(2.0 ** (si * scale - row_max + p_offset + shift / 8), dtype=torch.float64)
                .to(torch.float8_e4m3fn)
                .view(torch.uint8)
            )
            for si in s
        ]
        assert got[s.index(max(s))] == E4M3_ONE_CODE + 8 * p_offset
        total, equal = total + len(s), equal + sum(g == w for g, w in zip(got, want))
    assert equal / total >= 0.97, equal / total


def test_f16_max_reference_keeps_the_maximum_on_its_code_and_unbiased():
    """lean_ref="max": the f16 fold's line on the row's own maximum, lowered by LEAN_MAX_CENTER and b's f16
    margin (1/16 + |b| / 8 codes, b = t_top - m / 16), sits 0.34-0.49 code under 8 (x + P) + 56 at the maximum
    of a row whose maximum m is 2-40 log2 units (Gaussian scores at hd128: ~6; a sink's: ~14), so the
    maximum's code is 56 + 8P exactly (from m <= 1 or m >= ~48 on the margin passes half a code and the
    maximum drops one, as on the grid) and every other score rounds about half a code down from a line
    that lies 0-0.69 code above 2^x's code coordinate. Relative to the row's maximum, as the normalisation sees
    them, the weights are within 1% of 2^x on average (measured +0.5%) where the grid reference's are ~2% high
    (+1.9%), with a smaller spread (3.2% against 3.8%; the attention error: tests/test_gpu_gluon_lean.py)."""
    rng = np.random.default_rng(5)
    stats = {}
    for ref in ("max", "grid"):
        ratios = []
        for _ in range(30):
            codes, xp, offset = ref_row(rng, ref, 8)
            if ref == "max":
                assert 0.33 <= offset < 0.5, offset
                assert codes[0] == E4M3_ONE_CODE + 8 * 8
            values = np.array([float(torch.tensor(c, dtype=torch.uint8).view(torch.float8_e4m3fn)) for c in codes])
            # each score's weight relative to the row's maximum's, as the normalisation sees it
            ratios += list(values[1:] / values[0] / 2.0 ** (np.array(xp[1:]) - xp[0]))
        stats[ref] = (np.mean(ratios), np.std(ratios))
    assert abs(stats["max"][0] - 1) < 0.01 and stats["grid"][0] > 1.015, stats
    assert stats["max"][1] < stats["grid"][1], stats


@pytest.mark.parametrize("ref", ["grid", "max"])
def test_f16_floor_codes_e4m3s_subnormals(ref):
    """lean_floor: x + P in [-9, -6), where e4m3's codes are subnormal (m 2^-9), get codes within one of the
    correctly rounded e4m3 of 2^(x + P) from the second line (the linear line alone: 0 below -7, 4 codes short at
    -7); from -6 up the codes are the linear fold's (within a code of where the lines meet); masked scores 0."""
    rng = np.random.default_rng(9)
    for _ in range(12):
        seed = int(rng.integers(1 << 30))
        codes, xp, offset = ref_row(np.random.default_rng(seed), ref, 8, lo=-17.0, floor=True)
        plain, _, _ = ref_row(np.random.default_rng(seed), ref, 8, lo=-17.0)
        for c, p, x in zip(codes, plain, xp):
            want = e4m3_code(2.0 ** (x - offset / 8))
            if -9.0 <= x < -6.0:
                assert abs(c - want) <= 1 and c >= p, (x, c, want, p)
            elif x >= -5.75:
                assert c == p, (x, c, p)
            elif x < -10.0:
                assert c == 0
    a, b, _ = f16_row(0.125, 8.0, 8, "fma", ref)
    assert f16_codes([-math.inf] * 4, 0.125, 8.0, 8, "fma", ref, floor=True) == [0, 0, 0, 0]


@pytest.mark.parametrize("fold", [*ONE_FMA_FOLDS, "corrected"])
def test_f16_fold_masked_scores_give_code_zero_and_the_row_maximum_its_code(fold):
    """-inf (masked) f16 scores, and scores far below the row's maximum, give code 0 (.sat takes -inf and NaN
    to 0; "corrected" saturates after its correction, which would otherwise take t below 0 and y's low byte
    to 0xFF, an e4m3 NaN); the row's maximum, x = ref + P, gives 56 + 8P (or one less: the centered and
    corrected folds), far below the 128 that .sat's 1.0 would give (the sign bit of e4m3)."""
    scale, n = 0.25, 8 * 10
    ref_g = n / 8
    far = [f16((ref_g - d) / scale) for d in (15.5, 16.0, 30.0, 100.0, 1000.0, 5000.0)]
    scores = [-math.inf, f16(ref_g / scale), -math.inf, *far, -math.inf, -math.inf, -math.inf]
    codes = f16_codes(scores, scale, n, fold=fold)
    assert codes[0] == codes[2] == 0 and all(c == 0 for c in codes[3:]), codes
    assert codes[1] in (E4M3_ONE_CODE + 8 * 7, E4M3_ONE_CODE + 8 * 7 - 1)


def test_f16_pack_takes_each_low_byte_in_key_order():
    """f16_pack_asm: the low bytes of four f16 values (1024 + code) in key order, one PRMT."""
    ys = [f16_bits(1024.0 + c) for c in (3, 77, 112, 0)]
    word = run_f16_asm(f16_pack_asm(), ys)
    assert [(word >> (8 * k)) & 0xFF for k in range(4)] == [3, 77, 112, 0]
    assert f16_pack_asm().count("prmt") == 1 and "fma.rn.sat.f16x2" in f16_fold_asm()


def test_f16_mufu_asm_shape():
    """Each of the four pairs either folds (seven f16x2 operations) or takes the MUFU (one FMA, ex2, an integer
    add and a shift: no conversion); the constraints name 4 outputs and 5 x 4 inputs."""
    for mufu in range(MUFU_GROUP + 1):
        text = f16_mufu_asm(mufu)
        assert text.count("ex2.approx.f16x2") == mufu and text.count("shr.b32") == mufu and "cvt" not in text
        assert text.count("fma.rn.sat.f16x2 t, $") == MUFU_GROUP - mufu
        linear = f16_mufu_asm(mufu, "fma", floor=True)  # the linear fold: two FMAs a pair and the floor's two
        assert linear.count("ex2.approx.f16x2") == mufu and linear.count("max.f16x2") == MUFU_GROUP - mufu
        assert linear.count("fma.rn.f16x2") == 2 * MUFU_GROUP  # the line t and e = 16 t + k a MUFU pair
        assert ("$16" in linear) == (mufu < MUFU_GROUP)  # the floor line's a3 on the folded pairs only
    assert f16_mufu_constraints("fma", True).count("r") == 4 + 5 * MUFU_GROUP
    assert f16_mufu_constraints().count("r") == 4 + 5 * MUFU_GROUP
    with pytest.raises(ValueError):
        f16_mufu_asm(MUFU_GROUP + 1)
    with pytest.raises(ValueError, match="floor"):
        f16_mufu_asm(1, "corrected", floor=True)


@pytest.mark.parametrize("mufu", range(1, MUFU_GROUP + 1))
def test_f16_mufu_pairs_round_as_correctly_as_the_corrected_fold(mufu):
    """lean_mufu: the MUFU's pairs give the correctly rounded e4m3 of 2^(x + P) (x moved by the row's shift, as
    the fold's pairs: both read the same line, u = s a + b, e = 9 - 16 u), for >= 99% of x in the normal range
    (the rest one code off, where e's f16 rounding crosses a rounding boundary); the fold's pairs are what
    they are without the MUFU (the same codes as f16_codes), at their ~95.5%; masked scores (-inf) give code 0
    on either path, and so does a score 2^-inf, where the fold saturates."""
    p_offset, scale = 7, 0.125
    xs = [i / 256 + 1 / 512 for i in range(-13 * 256, 0)]
    for m in (12.0, 12.3, 3.7, -5.2, 40.1):
        s = [f16((x + m) / scale) for x in xs]
        got = f16_mufu_codes(s, scale, 8 * m, mufu, p_offset)
        folded = f16_codes(s, scale, 8 * m, p_offset, "corrected")
        shift = f16_row(scale, 8 * m, p_offset, "corrected")[2]
        share = mufu_share(got, folded, s, scale, m + shift / -8, xs, mufu, p_offset)
        assert share >= 0.96, (m, share)
    masked = [-math.inf] * 8
    assert f16_mufu_codes(masked, scale, 80.0, mufu) == [0] * 8


@pytest.mark.parametrize("floor", [False, True])
@pytest.mark.parametrize("mufu", [1, 2])
def test_f16_mufu_pairs_beside_the_linear_fold_round_correctly(mufu, floor):
    """lean_mufu on the linear fold with its line on the row maximum (lean_ref="max"): the folded pairs are the
    fold's codes (f16_codes, the floor line too), and the MUFU's pairs the correctly rounded e4m3 of 2^(x + P),
    x moved by the row's shift (b's f16 rounding and lowering, which the fold's pairs share and the row's
    normalisation cancels) and up by LEAN_CENTER - LEAN_MAX_CENTER codes (to where the fold's codes are unbiased),
    for >= 94% of x in the normal range (the rest where e's f16 rounding, up to 2^-7 of an octave, crosses a
    rounding boundary), never more than a code off, logits of hundreds too, subnormal codes (e4m3's and f16's
    line up) included: 2^x from the MUFU for a share of the pairs takes its share of the fold's error away."""
    p_offset, scale = 8, 0.125
    xs = [i / 256 + 1 / 512 for i in range(-16 * 256, 0)]
    for m in (12.0, 12.3, 3.7, -5.2, 20.1, 600.3):
        s = [f16((x + m) / scale) for x in xs]
        got = f16_mufu_codes(s, scale, 8 * m, mufu, p_offset, "fma", "max", floor)
        folded = f16_codes(s, scale, 8 * m, p_offset, "fma", "max", floor)
        shift = f16_row(scale, 8 * m, p_offset, "fma", "max")[2] + LEAN_CENTER - LEAN_MAX_CENTER
        share = mufu_share(got, folded, s, scale, m + shift / -8, xs, mufu, p_offset)
        assert share >= 0.94, (m, share)
    assert f16_mufu_codes([-math.inf] * 8, scale, 80.0, mufu, p_offset, "fma", "max", floor) == [0] * 8
