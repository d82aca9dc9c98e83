"""Exponentials on the FMA pipe: 2^x by a polynomial for a share of the scores, in hand-written PTX.

Why: MUFU.EX2 gives 16 results per clock per SM, the FP32 pipe 128. At head dim 128 one MUFU
exponential per score takes as long as both FP8 MMAs of the score (docs/design.md), so the exact
kernel waits on MUFU. Computing k of every 8 exponentials on the FMA pipe instead (FlashAttention-4's
software exp2 on Blackwell) splits the work between the two pipes. Unlike lean P the result is a
float32 within 2e-3 (degree 2) or 9e-5 (degree 3) of 2^x, so its e4m3 rounding is the correct one for
almost every score (tests/test_exp2_poly.py measures the share) and the error stays the exact kernel's;
the row sum and the P operand are computed as for MUFU exponentials.

One emulated exponential, x in (-inf, 2^22):
    max.f32    x, x, -127          2^-127 gives 0 below; keeps -inf (masked scores) out of what follows
    add.rm.f32 j, x, MAGIC         MAGIC + floor(x): floor(x) in the low bits of j
    sub.f32    fl, j, MAGIC        floor(x), exact
    sub.f32    f, x, fl            f = frac(x) in [0, 1)
    fma.rn.f32 ...                 p = 1 + c1 f + c2 f^2 (+ c3 f^3) ~ 2^f in [1, 2), Horner
    shl.b32    j, j, 23            floor(x) << 23: MAGIC's own bits (all at bit 22 and up) shift out
    add.s32    p, p, j             exponent field += floor(x): p = 2^floor(x) * 2^f
8 instructions (degree 3) against one MUFU.EX2; at x = -127 the result is exactly +0.
"""

from __future__ import annotations

import struct

#: 1.5 * 2^23: a float in [-2^22, 2^22) added to it leaves its rounded integer in the low bits.
MAGIC = 12582912.0
#: 2^x below 2^-127 is taken as 0 (the kernels' probabilities are rounded to e4m3 anyway).
X_FLOOR = -127.0
#: p(f) = 1 + c1 f + c2 f^2 (+ c3 f^3): weighted least-squares (Lawson) minimax of the relative error to
#: 2^f on [0, 1) with p(0) = 1 exactly (a row's maximum stays exact), rounded to float32. Max relative
#: error 2.06e-3 (degree 2), 8.6e-5 (degree 3); tests/test_exp2_poly.py re-measures both.
COEFFICIENTS: dict[int, tuple[float, ...]] = {
    2: (0.6659714579582214, 0.3299137055873871),
    3: (0.6951162219047546, 0.2276475876569748, 0.07706467062234879),
}
#: Scores handled per asm block; a config moves `share` of each 8 to the FMA pipe.
PACK = 8


def f32_hex(value: float) -> str:
    """PTX float literal (0f + 8 hex digits) of the float32 nearest to `value`."""
    return "0f" + struct.pack(">f", value).hex().upper()


def _poly_lines(out: str, x: str, degree: int) -> list[str]:
    c = COEFFICIENTS[degree]
    lines = [
        f"max.f32 x, {x}, {f32_hex(X_FLOOR)};",
        f"add.rm.f32 j, x, {f32_hex(MAGIC)};",
        f"sub.f32 f, j, {f32_hex(MAGIC)};",
        "sub.f32 f, x, f;",
        f"fma.rn.f32 p, f, {f32_hex(c[-1])}, {f32_hex(c[-2])};",
    ]
    lines += [f"fma.rn.f32 p, p, f, {f32_hex(ck)};" for ck in reversed(c[:-2])]
    lines += [f"fma.rn.f32 p, p, f, {f32_hex(1.0)};", "shl.b32 j, j, 23;", f"add.s32 {out}, p, j;"]
    return lines


def exp2_asm(share: int, degree: int) -> str:
    """PTX for 8 float32 exponents ($8..$15) -> 8 float32 2^x ($0..$7): the first `share` by the
    polynomial of `degree`, the rest by ex2.approx.ftz.f32 (MUFU)."""
    if type(share) is not int or not 0 <= share <= PACK:
        raise ValueError(f"share must be an int in [0, {PACK}], got {share!r}")
    if degree not in COEFFICIENTS:
        raise ValueError(f"degree must be one of {sorted(COEFFICIENTS)}, got {degree!r}")
    body: list[str] = []
    for i in range(PACK):
        if i < share:
            body += _poly_lines(f"${i}", f"${PACK + i}", degree)
        else:
            body.append(f"ex2.approx.ftz.f32 ${i}, ${PACK + i};")
    return "{\n.reg .b32 x, j, f, p;\n" + "\n".join(body) + "\n}"


#: Inline-asm constraints of `exp2_asm`: 8 float32 results, 8 float32 exponents.
EXP2_CONSTRAINTS = ",".join(["=r"] * PACK + ["r"] * PACK)
