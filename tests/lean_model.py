"""A model of lean P on the CPU, for the lean numerics tests: float32 and f16 arithmetic with PTX's
rounding, written from the PTX ISA semantics (fma.rn.f32 = exact product and sum, one
round-to-nearest-even; max.s32 on the bit pattern; max.f32; prmt; bfi), not from the generator, and an
interpreter of the inline PTX the generator emits (generator/asm/lean.py), so that the tests run the
project's own PTX text on chosen scores.

- `fma_f32` is an exact FMA (rational arithmetic, then one round-to-nearest-even to float32).
  Emulating it as float32(float64(s*a) + b) is not exact in general: s*a has up to 48
  significant bits and b is about 2^23, so the float64 sum can need more than 53 bits and round
  a second time.
- `run_lean_asm`, `run_code_sum_asm`, `run_f16_asm` interpret the generator's PTX text, instruction by
  instruction; `asm_codes` runs lean_p_asm over a row of scores.
- `f16_row`, `f16_codes` and `f16_mufu_codes` model what the Gluon kernel's tensor code
  (generator/gluon_sm90/softmax.py `_f16_fold`) hands that PTX.
"""

from __future__ import annotations

import math
import re
import struct
from fractions import Fraction

import numpy as np
import torch

from zyfa_tune.generator.asm.lean import (
    E4M3_ONE_CODE,
    LEAN_CORRECTION,
    LEAN_FLOOR_AT,
    LEAN_FLOOR_SLOPE,
    MAGIC,
    MAGIC_BITS,
    MUFU_GROUP,
    ONE_FMA_FOLDS,
    SAT_SCALE,
    f16_fold_asm,
    f16_mufu_asm,
    f16_pack_asm,
    f16_reversed,
    fold_center,
    lean_p_asm,
)

LOG2E = 1.4426950408889634


def f32(v: float) -> float:
    """Round a Python float to the nearest float32 (returned as a Python float)."""
    return struct.unpack("<f", struct.pack("<f", v))[0]


def bits(v: float) -> int:
    """float32 bit pattern as a signed 32-bit integer."""
    return struct.unpack("<i", struct.pack("<f", v))[0]


def from_bits(i: int) -> float:
    return struct.unpack("<f", struct.pack("<I", i & 0xFFFFFFFF))[0]


def round_f32(v: Fraction) -> float:
    """Round an exact rational to float32, nearest-even (normal and subnormal range)."""
    if v == 0:
        return 0.0
    sign = -1 if v < 0 else 1
    v = abs(v)
    e = v.numerator.bit_length() - v.denominator.bit_length()  # 2^e <= v < 2^(e+2)
    if Fraction(2) ** (e + 1) <= v:
        e += 1
    if Fraction(2) ** e > v:
        e -= 1
    assert Fraction(2) ** e <= v < Fraction(2) ** (e + 1)
    ulp = Fraction(2) ** (max(e, -126) - 23)
    n = round(v / ulp)  # Fraction rounds half to even
    out = float(sign * n * ulp)  # exact: n has at most 25 bits
    assert abs(out) < 2.0**128
    return out


def round_down_f32(v: Fraction) -> float:
    """Round an exact rational toward -inf to float32 (normal range), as PTX .rm does."""
    if v == 0:
        return 0.0
    lo = round_f32(v)
    if Fraction(lo) > v:  # nearest was above: step one float32 down
        lo = float(np.nextafter(np.float32(lo), np.float32(-np.inf)))
    return lo


def fma_f32(s: float, a: float, b: float) -> float:
    """PTX fma.rn.f32 on float32 operands: exact s*a + b, one rounding to nearest even."""
    if not (math.isfinite(s) and math.isfinite(a) and math.isfinite(b)):
        return f32(s * a + b)  # infinities propagate exactly like this
    return round_f32(Fraction(s) * Fraction(a) + Fraction(b))


def max_f32(a: float, b: float) -> float:
    """PTX max.f32: a NaN operand gives the other one."""
    return b if math.isnan(a) else a if math.isnan(b) else max(a, b)


def sat_f32(v: float) -> float:
    """The .sat modifier: clamp to [0, 1], NaN to 0."""
    return 0.0 if math.isnan(v) else min(max(v, 0.0), 1.0)


def code_from_y(y: float, clamp: str) -> int:
    """The lean code from the FMA result: clamp against the magic constant ("sat": y is never below
    it), keep the low byte."""
    if clamp == "sat":
        assert y >= MAGIC
        c = bits(y)
    elif clamp == "imax":
        c = max(bits(y), MAGIC_BITS)  # max.s32 on the bit patterns
    else:
        c = bits(max(y, MAGIC))  # max.f32 against 1.5 * 2^23
    return c & 0xFF


def intended_code(x: Fraction, fold: str = "fma") -> int:
    """round(8x + 56 - center) (nearest-even), clamped at 0, for an exact x (center 0 but for the
    "centered" fold)."""
    return max(round(8 * x + E4M3_ONE_CODE - Fraction(fold_center(fold))), 0)


def on_grid(fold: str, ref: float) -> float:
    """A reference on the 1/8 grid moved onto `fold`'s grid (n - center) / 8, as the kernel keeps it."""
    return ref - fold_center(fold) / 8


def fold_operands(fold: str, scale: float, ref: float, clamp: str = "imax") -> tuple[float, float]:
    """The per-row (a, b) the kernel passes to the asm (generator/triton/emit.py, generator/gluon_sm90/softmax.py): under clamp
    "sat" a one-FMA fold's both divided by 128, b without the magic constant."""
    if fold in ONE_FMA_FOLDS and clamp == "sat":
        return f32(scale * 8.0 / 128), f32((E4M3_ONE_CODE - (8.0 * ref + fold_center(fold))) / 128)
    if fold in ONE_FMA_FOLDS:
        return f32(scale * 8.0), f32(MAGIC + E4M3_ONE_CODE - (8.0 * ref + fold_center(fold)))
    return f32(scale), f32(-ref)


def folded(fold: str, s: float, a: float, b: float, clamp: str = "imax") -> float:
    """What the Gluon kernel's tensor code hands lean_tail_asm: the fold's FMA (saturated under a
    one-FMA fold with clamp "sat")."""
    v = fma_f32(s, a, b)
    return sat_f32(v) if fold in ONE_FMA_FOLDS and clamp == "sat" else v


def lean_y(fold: str, s: float, a: float, b: float, clamp: str = "imax") -> float:
    """y, whose low byte is the code once clamped; clamp "sat": t = sat((8x + 56 - center) / 128),
    then y = 128 t + magic."""
    if fold in ONE_FMA_FOLDS:
        v = folded(fold, s, a, b, clamp)
        return fma_f32(v, 128.0, MAGIC) if clamp == "sat" else v
    t = fma_f32(s, a, b)
    if fold == "corrected":  # x - c*frac(x)*(1-frac(x)), written from the PTX semantics
        x = max_f32(t, -64.0)
        floor_magic = round_down_f32(Fraction(x) + Fraction(MAGIC))  # add.rm.f32
        neg_frac = round_f32(Fraction(f32(floor_magic - MAGIC)) - Fraction(x))  # sub.f32 twice
        u = fma_f32(neg_frac, neg_frac, neg_frac)
        t = fma_f32(u, f32(LEAN_CORRECTION), x)
    if clamp == "sat":
        return fma_f32(sat_f32(fma_f32(t, 1 / 16, E4M3_ONE_CODE / 128)), 128.0, MAGIC)
    return fma_f32(t, 8.0, f32(MAGIC + E4M3_ONE_CODE))


def x_grid(lo: float, hi: float, step: float = 1 / 64) -> np.ndarray:
    n = int(round((hi - lo) / step))
    return lo + step * np.arange(n + 1)


def operand(tok: str, regs: dict[str, int]) -> int:
    tok = tok.strip()
    if tok in regs:
        return regs[tok]
    if tok.startswith("0f"):
        return int(tok[2:], 16)
    return int(tok, 0) & 0xFFFFFFFF


def _prmt(a: int, b: int, sel: int) -> int:
    src = a | (b << 32)  # bytes 0..3 from a, 4..7 from b
    out = 0
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        byte = (src >> (8 * (nib & 7))) & 0xFF
        if nib & 8:  # sign-replicate mode
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def _bfi(a: int, b: int, pos: int, length: int) -> int:
    pos, length = pos & 0xFF, length & 0xFF
    out = b
    for i in range(length):
        if pos + i > 31:
            break
        out = (out & ~(1 << (pos + i))) | (((a >> i) & 1) << (pos + i))
    return out & 0xFFFFFFFF


def run_lean_asm(text: str, inputs: list[float]) -> int:
    """Interpret the lean asm: $1..$12 (lean_p_asm) or $1..$4 (lean_tail_asm) float32 inputs,
    returns the 32-bit $0."""
    assert len(inputs) in (4, 12)
    return _execute(text, {f"${i + 1}": bits(v) & 0xFFFFFFFF for i, v in enumerate(inputs)})


def _execute(text: str, regs: dict[str, int]) -> int:
    """Run an inline-asm block ({, .reg lines, instructions, }) on 32-bit (or 16-bit) register values; $0
    (every register written stays in regs)."""
    body = text.strip().splitlines()
    assert body[0] == "{" and body[-1] == "}"
    while body[1].startswith(".reg "):
        body.pop(1)
    for line in body[1:-1]:
        m = re.fullmatch(r"([a-z0-9.]+)\s+(.*);", line.strip())
        assert m, line
        op, operands = m.group(1), m.group(2)
        if op == "mov.b32" and "{" in operands:  # two 16-bit halves into one register: d, {lo, hi}
            dst, pair = (t.strip() for t in operands.split(",", 1))
            lo, hi = (regs[t.strip()] & 0xFFFF for t in pair.strip("{}").split(","))
            regs[dst] = lo | (hi << 16)
            continue
        args = [t.strip() for t in operands.split(",")]
        dst, srcs = args[0], [operand(t, regs) for t in args[1:]]
        if op == "mov.b32":
            val = srcs[0]
        elif op == "fma.rn.f32":
            val = bits(fma_f32(*(from_bits(v) for v in srcs)))
        elif op == "fma.rn.sat.f32":
            val = bits(sat_f32(fma_f32(*(from_bits(v) for v in srcs))))
        elif op in ("fma.rn.f16x2", "fma.rn.sat.f16x2"):  # per half: exact s a + b, one rounding to f16
            val = 0
            for half in (0, 16):
                s_, a_, b_ = (f16_from_bits((v >> half) & 0xFFFF) for v in srcs)
                r = f16(s_ * a_ + b_)  # (exact in float64: a product of two f16 plus an f16)
                val |= f16_bits(sat_f32(r) if op == "fma.rn.sat.f16x2" else r) << half
        elif op in ("sub.f16x2", "neg.f16x2"):  # per half, exact then one rounding
            val = 0
            for half in (0, 16):
                a_, *b_ = (f16_from_bits((v >> half) & 0xFFFF) for v in srcs)
                val |= f16_bits(f16(a_ - b_[0]) if op == "sub.f16x2" else -a_) << half
        elif op == "max.f16x2":  # per half (the floor's -inf loses to any t)
            val = 0
            for half in (0, 16):
                a_, b_ = (f16_from_bits((v >> half) & 0xFFFF) for v in srcs)
                val |= f16_bits(max(a_, b_)) << half
        elif op == "ex2.approx.f16x2":  # per half: 2^x rounded to f16 (the MUFU's own error, ~2^-9.9, not modelled)
            val = 0
            for half in (0, 16):
                x_ = f16_from_bits((srcs[0] >> half) & 0xFFFF)
                val |= f16_bits(f16(2.0**x_) if x_ < 16 else math.inf) << half
        elif op == "add.u32":
            val = srcs[0] + srcs[1]
        elif op == "shr.b32":
            val = srcs[0] >> srcs[1]
        elif op == "add.rm.f32":
            val = bits(round_down_f32(sum(Fraction(from_bits(v)) for v in srcs)))
        elif op == "sub.f32":
            a_, b_ = (from_bits(v) for v in srcs)
            val = bits(
                f32(a_ - b_)
                if not (math.isfinite(a_) and math.isfinite(b_))
                else round_f32(Fraction(a_) - Fraction(b_))
            )
        elif op == "max.s32":
            val = max(from_bits_s32(v) for v in srcs)
        elif op == "max.f32":
            val = bits(max_f32(*(from_bits(v) for v in srcs)))
        elif op == "prmt.b32":
            val = _prmt(*srcs)
        elif op == "bfi.b32":
            val = _bfi(*srcs)
        else:
            raise AssertionError(f"unexpected instruction {op}")
        regs[dst] = val & 0xFFFFFFFF
    return regs["$0"]


def from_bits_s32(v: int) -> int:
    return v - (1 << 32) if v & 0x80000000 else v


def lean_codes(x: np.ndarray) -> np.ndarray:
    """The codes lean P gives 2^x ("fma" fold, scale 1, reference 0: the score is x): the generator's
    PTX, interpreted (asm_codes)."""
    return asm_codes("fma", x)


def rne_e4m3_codes(values: np.ndarray) -> np.ndarray:
    t = torch.tensor(values, dtype=torch.float32).to(torch.float8_e4m3fn)
    return t.view(torch.uint8).numpy()


def run_code_sum_asm(text: str, words: list[int]) -> float:
    """Interpret code_sum_asm's PTX on four 32-bit words of codes: mov.b32 {lo, hi} splits a word into
    .b16 halves; cvt.rn.f16x2.e4m3x2 widens a half's two e4m3 bytes (low byte -> low half) exactly;
    add.rn.f16x2 adds per half with one round-to-nearest-even to f16 (the float64 sum of two f16 is
    exact); cvt.f32.f16 is exact; add.rn.f32 rounds once to float32."""
    regs: dict[str, object] = {}
    for line in (ln.strip() for ln in text.splitlines()):
        if m := re.fullmatch(r"mov\.b32 \{(\w+), (\w+)\}, \$(\d);", line):
            w = words[int(m[3]) - 1]
            regs[m[1]], regs[m[2]] = w & 0xFFFF, w >> 16
        elif m := re.fullmatch(r"cvt\.rn\.f16x2\.e4m3x2 (\w+), (\w+);", line):
            half = regs[m[2]]
            regs[m[1]] = tuple(np.float16(e4m3_values(np.array([(half >> (8 * i)) & 0xFF]))[0]) for i in (0, 1))
        elif m := re.fullmatch(r"add\.rn\.f16x2 (\w+), (\w+), (\w+);", line):
            regs[m[1]] = tuple(np.float16(float(a) + float(b)) for a, b in zip(regs[m[2]], regs[m[3]]))
        elif m := re.fullmatch(r"mov\.b32 \{(\w+), (\w+)\}, (h\d);", line):
            regs[m[1]], regs[m[2]] = regs[m[3]]
        elif m := re.fullmatch(r"cvt\.f32\.f16 (\w+), (\w+);", line):
            regs[m[1]] = float(regs[m[2]])
        elif m := re.fullmatch(r"add\.rn\.f32 \$0, (\w+), (\w+);", line):
            return f32(regs[m[1]] + regs[m[2]])
        elif line and not line.startswith((".reg", "{", "}")):
            raise AssertionError(f"unmodelled PTX: {line}")
    raise AssertionError("no result")


def f16(v) -> float:
    """Round to float16, nearest even (v exact in float64: a product of two f16 plus an f16 is)."""
    return float(np.float16(v))


def f16_bits(v: float) -> int:
    return int(np.array(v, dtype=np.float16).view(np.uint16))


def f16_from_bits(h: int) -> float:
    return float(np.array(h, dtype=np.uint16).view(np.float16))


def run_f16_asm(text: str, inputs: list[int]) -> int:
    """Interpret f16_fold_asm / f16_pack_asm: $1.. are 32-bit registers (f16x2) or, for the pack, 16-bit
    halves; returns the 32-bit $0 (f16x2 ops act on each half; .sat clamps to [0, 1], NaN to 0)."""
    return _execute(text, {f"${i + 1}": v for i, v in enumerate(inputs)})


def f16_row(
    scale: float, n: float, p_offset: int = 7, fold: str = "fma", ref: str = "grid"
) -> tuple[float, float, float]:
    """A row's f16 a and b as the kernel makes them (gluon_sm90/softmax.py `_f16_fold`), with f32 scale (qk_scale 2^e)
    and its maximum m as n: the grid index ceil(8 m + center) for the one-FMA folds, 8 m itself for
    "corrected" and for ref "max" (no grid; the line lowered by LEAN_MAX_CENTER). a = f16(scale 8/128); b = t_top - m / 16 - 2^-11 in float32, lowered by |b| 2^-10,
    rounded to the nearest f16 (reversed folds: -a, and 1 - b, raised by 2^-11 + |1 - b| 2^-10 less the room
    to code 125, if positive). Also returns the row's shift in codes at its maximum, 128 (t(max) - t_top): the
    row's codes as if x were x + shift / 8 (common to the row, which the normalisation cancels; a's rounding
    scales x by (1 + <2^-11) besides)."""
    a_mul = 8.0 / SAT_SCALE
    a = f16(f32(scale * a_mul))
    center = fold_center(fold, ref)
    t_top = Fraction(E4M3_ONE_CODE + 8 * p_offset) / SAT_SCALE - Fraction(center) / SAT_SCALE
    m = f32((n - center) / 8 if fold in ONE_FMA_FOLDS and ref == "grid" else n / 8)
    t_max_ab = Fraction(m) / Fraction(scale) * Fraction(a)  # the maximum's s a
    if f16_reversed(fold):
        room = (125 - E4M3_ONE_CODE - 8 * p_offset) / SAT_SCALE - 2.0**-11
        v = fma_f32(m, a_mul, f32(float(1 - t_top)))
        b = f16(max(v, fma_f32(abs(v), 2.0**-10, fma_f32(m, a_mul, f32(float(1 - t_top) - room)))))
        return -a, b, float(128 * (t_max_ab + 1 - Fraction(b) - t_top))
    v = fma_f32(m, -a_mul, f32(float(t_top) - 2.0**-11))
    b = f16(fma_f32(abs(v), -(2.0**-10), v))
    return a, b, float(128 * (t_max_ab + Fraction(b) - t_top))


def f16_codes(
    s: list[float], scale: float, n: float, p_offset: int = 7, fold: str = "fma", ref: str = "grid", floor: bool = False
) -> list[int]:
    """The kernel's codes of f16 scores s of a row (f16_row's a and b; with floor, gluon_sm90/softmax.py `_f16_fold`'s
    a2 = f16(scale slope / 128) and b2 = f16(k2 - m slope / 128) of the second line): f16_fold_asm on each pair
    and f16_pack_asm on each four."""
    a, b, _ = f16_row(scale, n, p_offset, fold, ref)
    pair = lambda x, y: f16_bits(x) | (f16_bits(y) << 16)
    fold_text, codes = f16_fold_asm(fold, floor), []
    extra = []
    if floor:
        center = fold_center(fold, ref)
        m = f32((n - center) / 8 if ref == "grid" else n / 8)
        k2 = f32((LEAN_FLOOR_SLOPE * (p_offset - LEAN_FLOOR_AT) + 8.0 - center) / SAT_SCALE)
        a2 = f16(f32(scale * f32(LEAN_FLOOR_SLOPE / SAT_SCALE)))
        b2 = f16(fma_f32(m, -LEAN_FLOOR_SLOPE / SAT_SCALE, k2))
        extra = [pair(a2, a2), pair(b2, b2)]
    for i in range(0, len(s), 4):
        y0 = run_f16_asm(fold_text, [pair(s[i], s[i + 1]), pair(a, a), pair(b, b), *extra])
        y1 = run_f16_asm(fold_text, [pair(s[i + 2], s[i + 3]), pair(a, a), pair(b, b), *extra])
        word = run_f16_asm(f16_pack_asm(), [y0 & 0xFFFF, y0 >> 16, y1 & 0xFFFF, y1 >> 16])
        codes += [(word >> (8 * k)) & 0xFF for k in range(4)]
    return codes


def e4m3_code(v: float) -> int:
    return int(torch.tensor(v, dtype=torch.float64).to(torch.float8_e4m3fn).view(torch.uint8))


def ref_row(rng, ref: str, p_offset: int, lo: float = -6.0, floor: bool = False):
    """One row of f16 scores (x in [lo, 0] below a maximum m in [2, 40] log2 units), its codes by the f16 fold with
    reference `ref`, the scores' x + P (against the kernel's float32 maximum) and the row's offset in codes
    (LEAN_MAX_CENTER or 0, and b's margin: the line sits `offset` codes under 8 (x + P) + 56 at the maximum)."""
    m, scale = rng.uniform(2.0, 40.0), f32(LOG2E / math.sqrt(128) * 2.0 ** int(rng.integers(-3, 4)))
    s = [f16((x + m) / scale) for x in (0.0, *rng.uniform(lo, 0.0, size=63))]
    row_max = f32(max(s) * scale)  # the kernel's maximum: max(s) * qk_scale in float32
    n = 8.0 * row_max if ref == "max" else math.ceil(8 * row_max)
    codes = f16_codes(s, scale, n, p_offset, "fma", ref, floor)
    shift = f16_row(scale, n, p_offset, "fma", ref)[2]
    xp = [float(Fraction(si) * Fraction(scale) - Fraction(row_max)) + p_offset for si in s]
    return codes, xp, fold_center("fma", ref) - shift


def f16_mufu_codes(
    s: list[float],
    scale: float,
    n: float,
    mufu: int,
    p_offset: int = 7,
    fold: str = "corrected",
    ref: str = "grid",
    floor: bool = False,
) -> list[int]:
    """The kernel's codes of f16 scores s of a row (a multiple of 8) with lean_mufu=mufu: f16_mufu_asm on each
    eight (a and b of the fold's row, f16_row, and its other row operands as gluon_sm90/softmax.py `_f16_fold` makes them:
    corrected, a2 = -16 a and b2 = 9 - 8 - 16 b; the linear fold with floor its second line's a3, b3 as
    f16_codes), f16_pack_asm on each four as the kernel pairs them."""
    a, b, _ = f16_row(scale, n, p_offset, fold, ref)
    center = fold_center(fold, ref)
    m = f32((n - center) / 8 if fold in ONE_FMA_FOLDS and ref == "grid" else n / 8)
    if fold == "corrected":
        rows = [f16(-16.0 * a), f16(fma_f32(b, -16.0, 1.0))]
    else:  # e = 16 t' + k, k a constant of the PTX
        rows = []
    if floor:
        k2 = f32((LEAN_FLOOR_SLOPE * (p_offset - LEAN_FLOOR_AT) + 8.0 - center) / SAT_SCALE)
        rows += [
            f16(f32(scale * f32(LEAN_FLOOR_SLOPE / SAT_SCALE))),
            f16(fma_f32(m, -LEAN_FLOOR_SLOPE / SAT_SCALE, k2)),
        ]
    pair = lambda x, y: f16_bits(x) | (f16_bits(y) << 16)
    text, codes = f16_mufu_asm(mufu, fold, floor), []
    for i in range(0, len(s), 2 * MUFU_GROUP):
        regs = {f"${4 + k}": pair(s[i + 2 * k], s[i + 2 * k + 1]) for k in range(MUFU_GROUP)}
        for k in range(MUFU_GROUP):
            regs.update({f"${8 + k}": pair(a, a), f"${12 + k}": pair(b, b)})
            regs.update({f"${16 + 4 * j + k}": pair(r, r) for j, r in enumerate(rows)})
        _execute(text, regs)
        ys, group = [regs[f"${k}"] for k in range(MUFU_GROUP)], [0] * (2 * MUFU_GROUP)
        for r in (0, 1):  # the kernel packs register r (an even 8-key chunk) with r + 2 (the odd one, same row)
            y0, y1 = ys[r], ys[r + 2]
            word = run_f16_asm(f16_pack_asm(), [y0 & 0xFFFF, y0 >> 16, y1 & 0xFFFF, y1 >> 16])
            group[2 * r : 2 * r + 2] = [word & 0xFF, (word >> 8) & 0xFF]
            group[2 * r + 4 : 2 * r + 6] = [(word >> 16) & 0xFF, word >> 24]
        codes += group
    return codes


def mufu_share(
    got: list[int], folded: list[int], s: list[float], scale: float, m: float, xs: list[float], mufu: int, p_offset: int
) -> float:
    """Checks f16_mufu_codes' codes `got` of scores s at x = xs against `folded` (the fold alone) and the correctly
    rounded e4m3 of 2^(s scale - m + P): the folded pairs unchanged, the MUFU's at most a code off; returns the
    MUFU's share of exact codes in the normal range (x + P >= -6), which must beat the fold's."""
    want = [
        int(
            torch.tensor(2.0 ** (si * scale - m + p_offset), dtype=torch.float64)
            .to(torch.float8_e4m3fn)
            .view(torch.uint8)
        )
        for si in s
    ]
    on_mufu = [i for i in range(len(s)) if i % 8 >= 2 * (MUFU_GROUP - mufu)]
    normal = [i for i in on_mufu if xs[i] + p_offset >= -6]
    assert all(got[i] == folded[i] for i in range(len(s)) if i not in set(on_mufu))
    assert max(abs(got[i] - want[i]) for i in on_mufu) <= 1
    share = sum(got[i] == want[i] for i in normal) / len(normal)
    assert share > sum(folded[i] == want[i] for i in normal) / len(normal)
    return share


def e4m3_values(codes) -> np.ndarray:
    """The values of e4m3fn codes (0..126), as torch decodes float8_e4m3fn."""
    return torch.from_numpy(np.asarray(codes, dtype=np.uint8)).view(torch.float8_e4m3fn).double().numpy()


def asm_codes(
    fold: str, scores, scale: float = 1.0, ref: float = 0.0, clamp: str = "imax", pack: str = "prmt"
) -> np.ndarray:
    """The codes the generator's lean PTX (lean_p_asm, interpreted) makes of float32 `scores` of one row
    whose (a, b) are fold_operands(fold, scale, ref, clamp): what the kernel computes for them."""
    text = lean_p_asm(fold, clamp, pack)
    a, b = fold_operands(fold, scale, ref, clamp)
    out: list[int] = []
    for i in range(0, len(scores), 4):
        chunk = [f32(float(v)) for v in scores[i : i + 4]]
        word = run_lean_asm(text, chunk + [-math.inf] * (4 - len(chunk)) + [a] * 4 + [b] * 4)
        out += [(word >> (8 * k)) & 0xFF for k in range(len(chunk))]
    return np.array(out, dtype=np.uint8)
