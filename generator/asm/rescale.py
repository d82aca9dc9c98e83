"""The online softmax's rescale of O, skipped by a warp whose rows kept their maxima: PTX.

Why: after the row maximum moves, O is multiplied by alpha = 2^(m_old - m_new), 64 x head_dim_v / 128
FMULs per thread per key block whatever the block's width: at head dim 128 and 128-key blocks one
FMUL per score, as many as the softmax's FMA. Past the first blocks a row's maximum rarely moves
(a new maximum among j blocks comes with probability 1/j), and then alpha is exactly 1. Gluon has no
warp-uniform branch on tensor values, so the rescale is one inline-asm block over all of a thread's O
registers: the thread's two rows' alphas (registers 0 and 2 of the wgmma accumulator layout hold rows
r and r + 8) are tested, `vote.any` makes the decision warp-uniform and `bra.uni` jumps over the
multiplies. The O registers are tied in/out operands, so the skipped path moves nothing.
"""

from __future__ import annotations

#: The wgmma accumulator layout's per-thread registers: per 8 columns, (r, c), (r, c+1), (r+8, c),
#: (r+8, c+1): so operand 0 carries row r's alpha and operand 2 row r + 8's.
ROW_REGISTERS = (0, 2)


def rescale_asm(n: int, skip: bool = True) -> str:
    """PTX for one thread's n O registers ($0..$n-1, tied to inputs $n..$2n-1) times their row's
    alpha ($2n..$3n-1), skipped when no row of the warp has alpha != 1; skip=False: always, still in
    place (a 256-key pv_defer block has no registers for a multiplied copy of O beside its scores)."""
    if type(n) is not int or n < 4 or n % 4:
        raise ValueError(f"n must be a positive multiple of 4 (O registers per thread), got {n!r}")
    a0, a1 = (2 * n + r for r in ROW_REGISTERS)
    lines = ["{"]
    if skip:
        lines += [
            ".reg .pred p, q;",
            f"setp.ne.f32 p, ${a0}, 0f3F800000;",
            f"setp.ne.or.f32 p, ${a1}, 0f3F800000, p;",
            "vote.sync.any.pred q, p, 0xffffffff;",
            "@!q bra.uni SKIP;",
        ]
    lines += [f"mul.f32 ${k}, ${k}, ${2 * n + k};" for k in range(n)]
    lines += ["SKIP:", "}"] if skip else ["}"]
    return "\n".join(lines)


def rescale_constraints(n: int) -> str:
    """n outputs, the same n registers as inputs (tied: "0".."n-1"), n alphas."""
    return ",".join(["=r"] * n + [str(k) for k in range(n)] + ["r"] * n)
