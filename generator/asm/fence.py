"""ex2_fence's PTX: a barrier, right before the PV wait, that cannot issue before the step's last
exponential, so that neither can the wait (ptxas keeps the wait after a preceding barrier).

Why: in the overlapped step ptxas hoists the PV wait (WARPGROUP.DEPBAR) above the softmax's
exponentials, with rowsum="mma" above every one of them (docs/design.md), and PV(j-1) then
overlaps nothing inside the warpgroup. The barrier is a bar.red over the warpgroup's 128 threads on a
named barrier of its own (`fence_barrier`: Triton's partitions use 0-3, the named turns 8-10), and
its predicate needs every exponential:
- rowsum="fp32": the thread's two row sums (`row_sum_fence_asm`);
- rowsum="mma" (no row sums) and lean P: the OR of all of the thread's probability registers of a
  key part (`p_fence_asm`; LOP3, three at a time, about n / 2 instructions). A barrier that merely
  lists them as tied operands does not work: ptxas sees only the registers an instruction reads.
Operands pass through tied or copied: nothing changes value; the barrier's result is unused.
(A bar.warp.sync on a mask computed from the row sums orders the wait as well but makes ptxas spill
on the non-causal kernel.)
"""

from __future__ import annotations


def fence_barrier(consumer: int) -> int:
    """Named barrier of consumer warpgroup `consumer` (0..2): 15, 14, 13."""
    if type(consumer) is not int or not 0 <= consumer <= 2:
        raise ValueError(f"consumer must be 0, 1 or 2, got {consumer!r}")
    return 15 - consumer


def row_sum_fence_asm(barrier: int) -> str:
    """PTX over a thread's two row sums ($2, $3, copied to $0, $1): bar.red.and on `barrier`."""
    _check_barrier(barrier)
    return (
        "{ .reg .pred p, q;\n"
        "setp.geu.f32 p, $2, 0f00000000;\n"
        "setp.geu.and.f32 p, $3, 0f00000000, p;\n"
        f"bar.red.and.pred q, {barrier}, 128, p;\n"
        "mov.b32 $0, $2;\n"
        "mov.b32 $1, $3; }"
    )


#: row_sum_fence_asm's operands: two outputs, two inputs
ROW_SUM_FENCE_CONSTRAINTS = "=r,=r,r,r"


def p_fence_asm(n: int, barrier: int) -> str:
    """PTX over one thread's n probability registers ($0..$n-1 tied to inputs $n..$2n-1): OR them
    all, then bar.red.and on named barrier `barrier` (128 threads)."""
    if type(n) is not int or n < 4 or n % 2:
        raise ValueError(f"n must be an even number of registers >= 4, got {n!r}")
    _check_barrier(barrier)
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


def _check_barrier(barrier: object) -> None:
    if type(barrier) is not int or not 13 <= barrier <= 15:
        raise ValueError(f"barrier must be one of ex2_fence's named barriers 13..15, got {barrier!r}")
