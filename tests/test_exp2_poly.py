"""The FMA-pipe exponential (generator/asm/exp2_poly.py), modelled on the CPU.

`run_exp2_asm` interprets the emitted PTX instruction by instruction from the PTX ISA semantics
(the exact FMA and roundings of tests/lean_model.py); the tests check it against 2^x and
measure how often its e4m3 rounding is the correctly rounded e4m3 of 2^x, which is what decides the
kernel's error (the GPU tests compare the kernels: tests/test_gpu_gluon.py::test_exp2_poly).
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

import numpy as np
import pytest
from lean_model import bits, f32, fma_f32, from_bits, operand, rne_e4m3_codes, round_down_f32, round_f32, x_grid

from zyfa_tune.generator.asm.exp2_poly import COEFFICIENTS, EXP2_CONSTRAINTS, PACK, X_FLOOR, exp2_asm


def run_exp2_asm(text: str, xs: list[float]) -> list[float]:
    """Interpret exp2_asm's PTX: $8..$15 float32 inputs -> $0..$7 float32 outputs. MUFU's
    ex2.approx is modelled as 2^x rounded to float32 (its own ~2 ulp error is not the point)."""
    assert len(xs) == PACK
    regs = {f"${PACK + i}": bits(v) & 0xFFFFFFFF for i, v in enumerate(xs)}
    body = text.strip().splitlines()
    assert body[0] == "{" and body[-1] == "}" and body[1] == ".reg .b32 x, j, f, p;"
    for name in ("x", "j", "f", "p"):
        regs[name] = 0
    for line in body[2:-1]:
        m = re.fullmatch(r"([a-z0-9.]+)\s+(.*);", line.strip())
        assert m, line
        op, args = m.group(1), [t.strip() for t in m.group(2).split(",")]
        dst, srcs = args[0], [operand(t, regs) for t in args[1:]]
        fl = [from_bits(v) for v in srcs]
        if op == "max.f32":
            val = bits(max(fl))
        elif op == "add.rm.f32":
            val = bits(round_down_f32(Fraction(fl[0]) + Fraction(fl[1])))
        elif op == "sub.f32":
            val = bits(round_f32(Fraction(fl[0]) - Fraction(fl[1])))
        elif op == "fma.rn.f32":
            val = bits(fma_f32(*fl))
        elif op == "shl.b32":
            val = srcs[0] << srcs[1]
        elif op == "add.s32":
            val = srcs[0] + srcs[1]
        elif op == "ex2.approx.ftz.f32":
            val = bits(f32(2.0 ** fl[0]) if fl[0] >= -126 else 0.0)  # .ftz: subnormal results are 0
        else:
            raise AssertionError(f"unexpected instruction {op}")
        regs[dst] = val & 0xFFFFFFFF
    return [from_bits(regs[f"${i}"]) for i in range(PACK)]


@pytest.mark.parametrize("degree", sorted(COEFFICIENTS))
def test_polynomial_lanes_compute_2_to_the_x(degree):
    """Every emulated lane: within the polynomial's relative error of 2^x on the normal range,
    exactly 2^x at integers (p(0) = 1), +0 at and below -127 and for -inf (masked scores)."""
    text = exp2_asm(PACK, degree)
    bound = {2: 2.1e-3, 3: 9e-5}[degree]
    rng = np.random.default_rng(degree)
    xs = [f32(float(v)) for v in rng.uniform(-126.0, 9.0, size=8 * 40)]
    xs += [float(v) for v in range(-126, 9)] + [0.5, -0.5, 8.0 - 2**-20]
    xs += [0.0] * (-len(xs) % PACK)
    worst = 0.0
    for i in range(0, len(xs), PACK):
        chunk = xs[i : i + PACK]
        for x, y in zip(chunk, run_exp2_asm(text, chunk)):
            rel = abs(y / 2.0**x - 1.0)
            worst = max(worst, rel)
            assert rel <= bound, (x, y)
            if x == int(x):
                assert y == 2.0**x
    print(f"\ndegree {degree}: max relative error {worst:.3e} over {len(xs)} x")
    out = run_exp2_asm(text, [-math.inf, X_FLOOR, -127.5, -1e30, -200.0, -126.0, 0.0, 8.0])
    assert out[:5] == [0.0] * 5 and all(bits(v) == 0 for v in out[:5])  # +0, no NaN or garbage bits
    assert out[5:] == [2.0**-126, 1.0, 256.0]


@pytest.mark.parametrize("share", range(PACK + 1))
def test_share_splits_the_pack_between_the_polynomial_and_mufu(share):
    text = exp2_asm(share, 3)
    assert text.count("ex2.approx.ftz.f32") == PACK - share
    assert text.count("add.rm.f32") == share and text.count("shl.b32") == share
    assert EXP2_CONSTRAINTS.count("=r") == PACK and EXP2_CONSTRAINTS.count(",r") == PACK
    xs = [-3.3, 0.0, 7.9, -0.01, -20.25, 1.5, -126.0, -math.inf]
    for x, y in zip(xs, run_exp2_asm(text, xs)):
        assert (y == 0.0) if x == -math.inf else abs(y / 2.0**x - 1.0) <= 9e-5


def test_bad_arguments():
    for share in (-1, 9, 2.0, True):
        with pytest.raises(ValueError, match="share"):
            exp2_asm(share, 3)
    with pytest.raises(ValueError, match="degree"):
        exp2_asm(4, 4)


def poly_values(x: np.ndarray, degree: int) -> np.ndarray:
    """2^floor(x) * p(frac x) in float64 from the float32 coefficients (the PTX's formula)."""
    fl = np.floor(x)
    f = x - fl
    p = np.zeros_like(x)
    for c in reversed(COEFFICIENTS[degree]):
        p = (p + np.float32(c)) * f
    return np.ldexp(1.0 + p, fl.astype(np.int64))


@pytest.mark.parametrize("degree,least", [(3, 0.995), (2, 0.95)])
def test_share_of_correctly_rounded_e4m3_codes(degree, least):
    """What decides the kernel's error: the e4m3 rounding of the polynomial's value equals that of
    2^x for nearly every x (lean P's linear fold: 45%, tests/test_lean_numerics.py); where it differs
    it is the neighbouring code (x within the polynomial's error of a rounding midpoint)."""
    x = x_grid(-9.0, 8.0, 1 / 1024)
    got, want = rne_e4m3_codes(poly_values(x, degree)), rne_e4m3_codes(2.0**x)
    share = float(np.mean(got == want))
    print(f"\ndegree {degree}: e4m3(poly) == e4m3(2^x) for {share:.3%} of x in [-9, 8] (step 1/1024)")
    assert share >= least
    assert np.abs(got.astype(int) - want.astype(int)).max() <= 1
