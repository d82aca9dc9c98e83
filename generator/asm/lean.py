"""Lean P in hand-written PTX: four scores -> one 32-bit register holding four e4m3 codes.

The e4m3 bit pattern of 2^x, read as an integer, is about 8x + 56 (exponent bias 7, three
mantissa bits, linear in between). One FMA computes y = s*a + b with b holding the row reference,
the scale, the bias 56 and the magic constant 1.5 * 2^23: the FMA's own round-to-nearest then
leaves round(8x + 56) in the low mantissa bits of y, with no exponential and no conversion. An
integer (or float) max against the magic constant clamps negative codes (probabilities below the
smallest subnormal, masked -inf scores) to code 0, and byte moves pack the low bytes of four such
registers into one.

Accuracy (pinned by tests/test_lean_numerics.py): on the normal range the code is the e4m3 rounding
of the straight-line interpolation of 2^x between powers of two; the interpolation is within 6.15%
of 2^x and, with the half-code rounding, the decoded value is within 10.8% (never more than 4.3%
low); 45% of codes over x in [-9, 8] equal the correctly rounded e4m3 of 2^x.

Every variant computes the same codes; they differ only in the instruction sequence, which is what
the tuner searches:

- fold:  "fma"     one FMA, s*a + b, a = 8*scale and b = magic + 56 - 8*reference (needs the
                   reference quantised to 1/8 so that b is exact, which the kernel does);
         "sub_fma" t = s*a - b (the exact path's scale-and-subtract), then y = 8t + magic + 56.
         "centered" the "fma" FMA with its line moved down by LEAN_CENTER code units: y = 8x + magic
                   + 56 - 7/16, so the code is round(8x + 56 - 7/16). The straight line lies above
                   2^x between powers of two by 0 to 0.69 codes (0.46 on average); lowering it
                   centres the error: 82% of codes equal the correctly rounded e4m3 of 2^x (53%
                   for "fma"), rms relative error 3.1% (5.2%; correct rounding 2.6%), no mean bias
                   (+4% for "fma"). Same instruction, same cost: the kernel keeps 8*ref + 7/16 an
                   integer (the reference on the grid (n - 7/16)/8) so that b stays exact.
         "corrected" x = s*a - b, then a second-order mantissa correction with FMA-pipe ops only:
                   z = x - c*f*(1-f) with f = frac(x) (floor by a round-down add of the magic
                   constant), y = 8z + magic + 56. Makes the code equal the correctly rounded e4m3
                   of 2^x for ~97% of x in the normal range (53% without), at 8 FP ops per score.
- clamp: "imax"    max.s32 on the bit pattern; "fmax" max.f32 against the magic float;
         "sat"     no max: the fold's last FMA saturates t = (8x + 56 - center) / 128 to [0, 1]
                   (FFMA.SAT; -inf and NaN give 0), then y = 128 t + magic (one more FMA): one
                   VIMNMX per score becomes an FFMA, and ptxas schedules the Gluon step ~6% shorter
                   (docs/results.md). t is rounded to float32 first, so a code can differ
                   from round(8x + 56) only where 8x + 56 is within 2^-18 of a half-integer.
- pack:  "prmt"    three byte permutes; "bfi" three bit-field inserts.
"""

from __future__ import annotations

#: 1.5 * 2^23: adding it to a float in [-2^22, 2^22) leaves the rounded integer in the low bits.
MAGIC = 12582912.0
MAGIC_BITS = 0x4B400000
#: e4m3 code of 1.0 = (0 + bias 7) << 3.
E4M3_ONE_CODE = 56


def _f32_hex(value: float) -> str:
    import struct

    return struct.pack(">f", value).hex().upper()


#: code units the "centered" fold lowers the linear interpolant by (a dyadic 7/16, so that the
#: reference grid (n - 7/16) / 8 and 8*ref + 7/16 are exact in float32); see tests/test_lean_numerics.py
LEAN_CENTER = 0.4375
#: folds that are one FMA s*a + b with a = 8*scale (b = magic + 56 - 8*ref - center): the whole fold
#: happens in the softmax and the reference must sit on its grid
ONE_FMA_FOLDS = ("fma", "centered")


#: code units the f16 "fma" fold lowers its line by when the row's reference is its maximum itself
#: (lean_ref="max"). With the lowering _f16_fold adds against f16 rounding (1/16 code + |b|/8, b ~ 0.5 on
#: ordinary rows) the line sits ~0.45 codes down: every score rounds about half a code down from the line,
#: against its overestimate of 2^x, while the maximum (at 2^P - 0.45 codes) keeps its exact code. Past half a
#: code the maximum drops a code and the error rises (float64 emulation, docs/results.md).
LEAN_MAX_CENTER = 0.3125


def fold_center(fold: str, ref: str = "grid") -> float:
    """The code offset a one-FMA fold subtracts (0 for "fma" on the grid reference)."""
    if ref == "max":
        return LEAN_MAX_CENTER
    return LEAN_CENTER if fold == "centered" else 0.0


#: c of the correction 2^f - 1 ~ f - c*f*(1-f), chosen for the largest share of correctly rounded codes
LEAN_CORRECTION = 0.346
#: scores below 2^-64 of the row maximum give code 0 anyway; clamping x there keeps -inf out of
#: the fraction arithmetic (inf - inf would be NaN)
_X_FLOOR = -64.0


#: clamp "sat": a one-FMA fold's a = 8*scale and b = 56 - 8*ref - center (no magic) are divided by this,
#: so that the FMA gives t = (8x + 56 - center) / SAT_SCALE, saturated to [0, 1] (powers of two and small
#: integers: a and b stay exact); codes stay below 128 (P <= 2^8)
SAT_SCALE = 128.0


def _code_line(i: int, clamp: str) -> str:
    """The fold's last FMA, from x (log2 units) in r{i}: y = 8x + magic + 56, or under "sat"
    t = sat((8x + 56) / SAT_SCALE)."""
    if clamp == "sat":
        return f"fma.rn.sat.f32 r{i}, r{i}, 0f{_f32_hex(8.0 / SAT_SCALE)}, 0f{_f32_hex(E4M3_ONE_CODE / SAT_SCALE)};"
    return f"fma.rn.f32 r{i}, r{i}, 0f41000000, 0f{_f32_hex(MAGIC + E4M3_ONE_CODE)};"


def _fold_lines(fold: str, clamp: str) -> list[str]:
    if fold in ONE_FMA_FOLDS:
        # $1..$4 scores, $5..$8 a = 8*scale, $9..$12 b = magic + 56 - 8*ref (- LEAN_CENTER); "sat": SAT_SCALE
        sat = ".sat" if clamp == "sat" else ""
        return [f"fma.rn{sat}.f32 r{i}, ${1 + i}, ${5 + i}, ${9 + i};" for i in range(4)]
    if fold == "sub_fma":
        # $5..$8 a = scale, $9..$12 b = -ref; then y = 8*t + (magic + 56)
        return [
            line for i in range(4) for line in (f"fma.rn.f32 r{i}, ${1 + i}, ${5 + i}, ${9 + i};", _code_line(i, clamp))
        ]
    if fold == "corrected":
        # $5..$8 a = scale, $9..$12 b = -ref (as sub_fma); t, u are scratch registers
        return [
            line
            for i in range(4)
            for line in (f"fma.rn.f32 r{i}, ${1 + i}, ${5 + i}, ${9 + i};", *_correction_lines(i, clamp))
        ]
    raise ValueError(f"unknown lean fold {fold!r}")


def _correction_lines(i: int, clamp: str) -> list[str]:
    """x in r{i} -> y = 8z + magic + 56 with z = x - c*f*(1-f), f = frac(x) (the corrected fold)."""
    magic = _f32_hex(MAGIC)
    return [
        f"max.f32 r{i}, r{i}, 0f{_f32_hex(_X_FLOOR)};",
        f"add.rm.f32 t, r{i}, 0f{magic};",  # magic + floor(x)
        f"sub.f32 t, t, 0f{magic};",  # floor(x), exact
        f"sub.f32 t, t, r{i};",  # -f
        "fma.rn.f32 u, t, t, t;",  # f*f - f = -f(1-f)
        f"fma.rn.f32 r{i}, u, 0f{_f32_hex(LEAN_CORRECTION)}, r{i};",  # z = x - c f(1-f)
        _code_line(i, clamp),
    ]  # y = 8z + magic + 56


def _clamp_lines(clamp: str) -> list[str]:
    if clamp == "imax":
        return [f"max.s32 r{i}, r{i}, {MAGIC_BITS};" for i in range(4)]
    if clamp == "fmax":
        return [f"max.f32 r{i}, r{i}, 0f{_f32_hex(MAGIC)};" for i in range(4)]
    if clamp == "sat":  # t in [0, 1] -> y = SAT_SCALE t + magic: the code in the low byte
        return [f"fma.rn.f32 r{i}, r{i}, 0f{_f32_hex(SAT_SCALE)}, 0f{_f32_hex(MAGIC)};" for i in range(4)]
    raise ValueError(f"unknown lean clamp {clamp!r}")


def _pack_lines(pack: str) -> list[str]:
    if pack == "prmt":
        # {b,a} bytes are numbered 7..0 (a = 0..3): 0x0040 puts a.b0 in byte 0 and b.b0 in byte 1.
        return ["prmt.b32 r0, r0, r1, 0x0040;", "prmt.b32 r2, r2, r3, 0x0040;", "prmt.b32 $0, r0, r2, 0x5410;"]
    if pack == "bfi":
        return ["bfi.b32 r0, r1, r0, 8, 8;", "bfi.b32 r0, r2, r0, 16, 8;", "bfi.b32 $0, r3, r0, 24, 8;"]
    raise ValueError(f"unknown lean pack {pack!r}")


def lean_p_asm(fold: str, clamp: str, pack: str) -> str:
    """PTX for one pack of four scores ($1..$4) with per-element a ($5..$8) and b ($9..$12)."""
    body = _fold_lines(fold, clamp) + _clamp_lines(clamp) + _pack_lines(pack)
    regs = "r0, r1, r2, r3, t, u" if fold == "corrected" else "r0, r1, r2, r3"
    return "{\n.reg .b32 " + regs + ";\n" + "\n".join(body) + "\n}"


def lean_tail_asm(fold: str, clamp: str, pack: str) -> str:
    """PTX for the Gluon backend, which folds in tensor code (one FMA per score, where the row's
    constants are at hand) and rounds next to the PV wgmma: four folded values ($1..$4) -> one
    register of four e4m3 codes. fold "fma": $i is already y = 8x + magic + 56 (clamp "sat": the
    saturated t); "sub_fma": $i is x = s*scale - ref, one more FMA makes y; "corrected": $i is x,
    corrected as in `lean_p_asm`; "centered" as "fma" (its offset is in b)."""
    if fold in ONE_FMA_FOLDS:
        body = [f"mov.b32 r{i}, ${1 + i};" for i in range(4)]
    elif fold == "sub_fma":
        body = [line for i in range(4) for line in (f"mov.b32 r{i}, ${1 + i};", _code_line(i, clamp))]
    elif fold == "corrected":
        body = [line for i in range(4) for line in (f"mov.b32 r{i}, ${1 + i};", *_correction_lines(i, clamp))]
    else:
        raise ValueError(f"unknown lean fold {fold!r}")
    body += _clamp_lines(clamp) + _pack_lines(pack)
    regs = "r0, r1, r2, r3, t, u" if fold == "corrected" else "r0, r1, r2, r3"
    return "{\n.reg .b32 " + regs + ";\n" + "\n".join(body) + "\n}"


#: Inline-asm constraints: one packed output register, then 3 x 4 float inputs.
LEAN_P_CONSTRAINTS = "=r," + ",".join(["f"] * 12)


def code_sum_asm() -> str:
    """PTX for lean P's rounded row sum without an MMA (Gluon, rowsum="rounded"): four registers of
    four e4m3 codes each ($1..$4) -> the float32 sum of the 16 probabilities they encode ($0). Each
    pair of codes becomes an f16x2 by the hardware conversion (exact: every e4m3 value is an f16),
    the eight pairs are added as f16x2 (16 codes of at most 448 sum to at most 7168, well inside f16;
    each add rounds to 11 bits, so a sum is within ~2^-10 of the exact one), and the two halves are
    added in float32. 8 conversions, 7 f16x2 adds, 3 more: 18 instructions per 16 scores."""
    body = [f"mov.b32 {{c{2 * i}, c{2 * i + 1}}}, ${1 + i};" for i in range(4)]
    body += [f"cvt.rn.f16x2.e4m3x2 h{i}, c{i};" for i in range(8)]
    body += [f"add.rn.f16x2 h{a}, h{a}, h{b};" for a, b in ((0, 1), (2, 3), (4, 5), (6, 7), (0, 2), (4, 6), (0, 4))]
    body += ["mov.b32 {lo, hi}, h0;", "cvt.f32.f16 flo, lo;", "cvt.f32.f16 fhi, hi;", "add.rn.f32 $0, flo, fhi;"]
    regs = (
        ".reg .b16 "
        + ", ".join(f"c{i}" for i in range(8))
        + ", lo, hi;\n.reg .b32 "
        + ", ".join(f"h{i}" for i in range(8))
        + ";\n.reg .f32 flo, fhi;"
    )
    return "{\n" + regs + "\n" + "\n".join(body) + "\n}"


#: Inline-asm constraints of `code_sum_asm`: one float output, four code registers.
CODE_SUM_CONSTRAINTS = "=f,r,r,r,r"


# ---- lean P on f16 scores (qk_acc="f16", Gluon; docs/design.md) -------------------------------------

#: 1024 = 2^10: f16 values in [1024, 2048) are the integers, so y = 1024 + code holds the code in its low byte
F16_BASE = 1024.0
#: the bound the f16 scores are kept under (half the f16 maximum 65504, so that no partial sum rounds past it)
F16_SCORE_BOUND = 32768.0
#: largest e4m3 magnitude: |q . k| <= E4M3_MAX * sum|q| for any e4m3 K
E4M3_MAX = 448.0


def _f16x2_hex(value: float) -> str:
    """Both halves of an f16x2 immediate (value rounded to f16), as _f32_hex does for float32."""
    import struct

    half = struct.pack(">e", value).hex().upper()
    return f"0x{half}{half}"


#: lean_floor's second line: codes per octave below 2^-6, where e4m3's codes are subnormal (linear in the
#: value: code m is m 2^-9). The fold's own line, 8 codes an octave, reaches code 0 at x + P = -7; this one
#: meets it at code 8 (x + P = -6) and reaches 0 at -8.7 (correct rounding: at -10), 3 an octave keeping it
#: within a code of round(2^(x + P + 9)) (float64 emulation, docs/results.md).
LEAN_FLOOR_SLOPE = 3.0
#: x + P where the two lines meet (code 8 - center, e4m3's smallest normal 2^-6)
LEAN_FLOOR_AT = -6.0


def f16_fold_asm(fold: str = "fma", floor: bool = False) -> str:
    """PTX for two f16 scores ($1, packed) with the row's a ($2) and b ($3) (f16 pairs): t = sat(s a + b),
    the fold of clamp "sat" in f16 (HFMA2.SAT), then y = SAT_SCALE t + 1024 (HFMA2), the code in each
    half's low byte.

    fold "corrected" folds the reversed line u = 1 - t instead (a and b of `f16_reversed`: u = sat(s a + b)),
    so that the top codes, the largest probabilities, sit where f16 is finest (u near 0: 1/256 code at the
    row maximum's code against t's 1/16), then adds the second-order mantissa correction of the float32
    "corrected" fold (c = LEAN_CORRECTION), u += (c / 16) frac (1 - frac), frac the position of the code
    within its octave (16 u mod 1; frac (1 - frac) is the same for t and u), in five f16x2 operations:
    k + 1/2 = round(16 u + 1023.5) - 1023.5 (the f16 integers of [1024, 2048) round it), f = 16 u - k - 1/2
    in [-1/2, 1/2], frac (1 - frac) = 1/4 - f^2; y = 1152 - 128 u. Masked and far scores saturate to u = 1,
    where the correction is 0 (f = -1/2): code 0. Codes equal the correctly rounded e4m3 of 2^x for ~97%
    of x in the normal range.

    floor (one-FMA folds): t = max(t, s a2 + b2) ($4, $5: LEAN_FLOOR_SLOPE codes an octave, unsaturated: a masked
    score's -inf gives -inf there), so that scores 2^-6 to 2^-9 of 2^P get e4m3's subnormal codes instead of 0
    (two more f16x2 operations)."""
    _check_f16_fold(fold, floor)
    if fold in ONE_FMA_FOLDS:
        lines = _f16_linear_lines("$0", "$1", "$2", "$3", ("$4", "$5") if floor else None)
    else:
        lines = _f16_corrected_lines("$0", "$1", "$2", "$3")
    return "{\n.reg .b32 t, c, m, r, f;\n" + "\n".join(lines) + "\n}"


def _check_f16_fold(fold: str, floor: bool) -> None:
    """f16 scores fold one-FMA or "corrected"; the floor's second line goes only beside a one-FMA fold."""
    if fold != "corrected" and fold not in ONE_FMA_FOLDS:
        raise ValueError(f"f16 scores fold as {ONE_FMA_FOLDS} or 'corrected', not {fold!r}")
    if floor and fold not in ONE_FMA_FOLDS:
        raise ValueError(f"floor is a second line beside the one-FMA folds {ONE_FMA_FOLDS}, not {fold!r}'s")


def _f16_linear_lines(out: str, s: str, a: str, b: str, floor: tuple[str, str] | None) -> list[str]:
    """The linear fold of one f16 pair (f16_fold_asm), from operands s, a, b (and the floor line's a2, b2) into
    out; scratch t, c, m, r."""
    lines = [f"fma.rn.sat.f16x2 t, {s}, {a}, {b};"]
    lines += [f"fma.rn.f16x2 r, {s}, {floor[0]}, {floor[1]};", "max.f16x2 t, t, r;"] if floor else []
    return lines + [
        f"mov.b32 c, {_f16x2_hex(SAT_SCALE)};",
        f"mov.b32 m, {_f16x2_hex(F16_BASE)};",
        f"fma.rn.f16x2 {out}, t, c, m;",
    ]


def _f16_corrected_lines(out: str, s: str, a: str, b: str) -> list[str]:
    """The corrected fold of one f16 pair (f16_fold_asm), from operands s, a, b into out; scratch t, c, m, r, f."""
    return [
        f"fma.rn.sat.f16x2 t, {s}, {a}, {b};",  # u
        f"mov.b32 c, {_f16x2_hex(16.0)};",
        f"mov.b32 m, {_f16x2_hex(1023.5)};",
        "fma.rn.f16x2 r, t, c, m;",  # 16 u + 1023.5, rounded to an integer (k + 1024)
        "sub.f16x2 r, m, r;",  # -(k + 1/2), exact
        "fma.rn.f16x2 f, t, c, r;",  # f = 16 u - k - 1/2
        "neg.f16x2 r, f;",
        f"mov.b32 m, {_f16x2_hex(0.25)};",
        "fma.rn.f16x2 r, r, f, m;",  # 1/4 - f^2 = frac (1 - frac)
        f"mov.b32 c, {_f16x2_hex(LEAN_CORRECTION / 16)};",
        "fma.rn.sat.f16x2 t, r, c, t;",  # sat(u + (c / 16) frac (1 - frac))
        f"mov.b32 c, {_f16x2_hex(-SAT_SCALE)};",
        f"mov.b32 m, {_f16x2_hex(F16_BASE + SAT_SCALE)};",
        f"fma.rn.f16x2 {out}, t, c, m;",
    ]


#: P's exponent at u = 0 on the corrected fold's reversed line: x + P = 9 - 16 u (t = (8 (x + P) + 56) / 128)
F16_U_TOP = 9.0
#: f16's exponent bias (15) less e4m3's (7): the f16 of 2^(x + P - 8) holds e4m3's code of 2^(x + P) in its bits 7..14
F16_E4M3_REBIAS = 8
#: f16_mufu_asm's line: e = x + P - F16_E4M3_REBIAS = F16_MUFU_TOP - 16 u, so b2 = F16_MUFU_TOP - 16 b
F16_MUFU_TOP = F16_U_TOP - F16_E4M3_REBIAS
#: f16_mufu_asm's line beside the linear fold: e = x + P - 8 = 16 t + k for the line t lowered by LEAN_CENTER codes,
#: where the fold's codes are unbiased in value (mean over an octave: 0.457 codes down; 7/16 is the nearest k that
#: f16 holds, 1/16 code apart near 15)
F16_MUFU_LINEAR_K = LEAN_CENTER / 8 - 15.0
#: how many f16 score pairs one `f16_mufu_asm` takes (eight scores: pack=8, four 32-bit registers)
MUFU_GROUP = 4


def f16_mufu_asm(mufu: int, fold: str = "corrected", floor: bool = False) -> str:
    """PTX for eight f16 scores ($4..$7, four pairs) -> four registers of `f16_fold_asm` results ($0..$3, the
    code in each half's low byte): the first MUFU_GROUP - mufu pairs by the f16 fold `fold` from the row's a
    ($8..$11) and b ($12..$15), the last mufu pairs by the MUFU on the line e = x + P - 8, 2^e by
    ex2.approx.f16x2, and the code by integer arithmetic on the f16 bits rather than the conversion (F2FP, a
    slow pipe: 2.7x its ncu samples for 25% more of them): f16 and e4m3 differ by 7
    mantissa bits and 8 in exponent bias, so the f16 of 2^(x + P - 8) is e4m3's code of 2^(x + P) in bits
    7..14 (subnormals too: f16's and e4m3's line up), rounded by adding 2^6 (to nearest, ties away from zero:
    one f16 value in 128 is a tie, moved by half a code) and shifting right by 7, both halves at once
    (positive: no carry across). P <= 2^8 by the row maximum, so bit 14 (f16's top exponent bit) is 0 and the
    code stays below e4m3's NaN. Bytes 1 and 3 are left-over bits the pack does not read.

    "corrected": the fold's reversed line u = sat(s a + b); the MUFU's e = s a2 + b2 ($16..$19, $20..$23: a2 =
    -16 a, b2 = 9 - 8 - 16 b, the same line unsaturated, so that a masked score's -inf gives 2^-inf = 0).
    "fma" (the linear fold, t = sat(s a + b), with `floor` its second line from a3 $16..$19, b3 $20..$23): the
    MUFU's e = 16 t' + F16_MUFU_LINEAR_K, two FMAs from the fold's own line unsaturated, t' = s a + b, so that
    e carries whatever the row's b carries (its f16 rounding, and the lowering the kernel gives b against it,
    several codes on logits of hundreds), as the fold's pairs do: both kinds of pair share the row's shift,
    which the row's normalisation cancels. Its constant puts the MUFU's pairs where the fold's codes are
    unbiased in value (the line LEAN_CENTER codes down), not on the exact 2^x: the fold's line on the maximum
    sits 0.42-0.46 codes down on ordinary rows, so the two kinds of pair then agree on average. (e = s 16a + b2
    with b2 = P - 8 - m from the maximum itself rounds b2 by |m| 2^-11 of its own, and leaves out the lowering:
    1.5-1.7x the fold's error on logits of hundreds, measured.)"""
    if not 0 <= mufu <= MUFU_GROUP:
        raise ValueError(f"mufu must be 0..{MUFU_GROUP}, not {mufu!r}")
    _check_f16_fold(fold, floor)
    lines: list[str] = []
    for i in range(MUFU_GROUP):
        out, s, a, b = f"${i}", f"${4 + i}", f"${8 + i}", f"${12 + i}"
        if i >= MUFU_GROUP - mufu:
            if fold == "corrected":
                lines += [f"fma.rn.f16x2 e, {s}, ${16 + i}, ${20 + i};"]
            else:
                lines += [
                    f"fma.rn.f16x2 e, {s}, {a}, {b};",
                    f"mov.b32 c, {_f16x2_hex(16.0)};",
                    f"mov.b32 m, {_f16x2_hex(F16_MUFU_LINEAR_K)};",
                    "fma.rn.f16x2 e, e, c, m;",
                ]
            lines += [
                "ex2.approx.f16x2 e, e;",
                "add.u32 e, e, 0x00400040;",  # + half a code in each half
                f"shr.b32 {out}, e, 7;",
            ]  # bytes 0, 2 <- the codes of keys 0, 1
        elif fold == "corrected":
            lines += _f16_corrected_lines(out, s, a, b)
        else:
            lines += _f16_linear_lines(out, s, a, b, (f"${16 + i}", f"${20 + i}") if floor else None)
    return "{\n.reg .b32 t, c, m, r, f, e;\n" + "\n".join(lines) + "\n}"


def f16_mufu_constraints(fold: str = "corrected", floor: bool = False) -> str:
    """Inline-asm constraints of `f16_mufu_asm`: four registers out; four in for the scores and for each row
    operand (f16 pairs broadcast over the scores): a, b and the corrected fold's a2, b2, or the linear fold's
    floor line's a3, b3."""
    operands = 4 if fold == "corrected" else 2 + 2 * floor
    return ",".join(["=r"] * MUFU_GROUP + ["r"] * ((1 + operands) * MUFU_GROUP))


def f16_reversed(fold: str) -> bool:
    """Whether f16_fold_asm(fold) folds u = 1 - t: its a and b are the negated a and 1 - b of t's."""
    return fold == "corrected"


def f16_pack_asm() -> str:
    """PTX for four `f16_fold_asm` results ($1..$4, keys 4a .. 4a + 3, as 16-bit registers; consecutive
    pairs share a 32-bit register in the accumulator) -> one register of four e4m3 codes: their low
    bytes, one PRMT."""
    return "{\n.reg .b32 a, b;\nmov.b32 a, {$1, $2};\nmov.b32 b, {$3, $4};\nprmt.b32 $0, a, b, 0x6420;\n}"
