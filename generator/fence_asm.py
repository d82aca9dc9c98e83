"""A barrier that waits for every probability of a step: PTX for ex2_fence under rowsum="mma".

Why: in the overlapped step ptxas hoists the PV wait (WARPGROUP.DEPBAR) above the softmax: with
rowsum="mma" above every exponential (docs/BACKENDS.md), so PV(j-1) overlaps nothing inside the
warpgroup. ex2_fence puts a barrier right before the wait whose predicate needs every exponential:
with rowsum="fp32" the row sums do (`gluon_device._ex2_fence`); with rowsum="mma" there are none,
and a barrier that merely lists the probabilities as tied operands does not work (ptxas sees only
the registers an instruction reads). So the asm ORs all of a thread's probability registers
together (LOP3, three at a time: about n / 2 instructions) and feeds that to the predicate of a
bar.red over the warpgroup's 128 threads, on a named barrier of its own (15 - consumer). The
registers are tied in/out operands: nothing is moved, the result is unused.
"""

from __future__ import annotations


def p_fence_asm(n: int, barrier: int) -> str:
    """PTX over one thread's n probability registers ($0..$n-1 tied to inputs $n..$2n-1): OR them
    all, then bar.red.and on named barrier `barrier` (128 threads)."""
    if type(n) is not int or n < 4 or n % 2:
        raise ValueError(f"n must be an even number of registers >= 4, got {n!r}")
    if type(barrier) is not int or not 13 <= barrier <= 15:
        raise ValueError(f"barrier must be one of ex2_fence's named barriers 13..15, got {barrier!r}")
    regs = [f"${n + k}" for k in range(n)]
    lines = ["{", ".reg .b32 acc;", ".reg .pred p, q;", f"lop3.b32 acc, {regs[0]}, {regs[1]}, {regs[2]}, 0xFE;"]
    rest = regs[3:]
    while rest:
        pair, rest = rest[:2], rest[2:]
        if len(pair) == 2:
            lines.append(f"lop3.b32 acc, acc, {pair[0]}, {pair[1]}, 0xFE;")
        else:
            lines.append(f"or.b32 acc, acc, {pair[0]};")
    lines += ["setp.ne.b32 p, acc, 0;", f"bar.red.and.pred q, {barrier}, 128, p;", "}"]
    return "\n".join(lines)


def p_fence_constraints(n: int) -> str:
    """n outputs and the same n registers as inputs (tied: "0".."n-1")."""
    return ",".join(["=r"] * n + [str(k) for k in range(n)])
