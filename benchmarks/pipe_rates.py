"""Issue rates of the instructions the exact softmax is made of, on this GPU (the MUFU rates in
docs/design.md): cycles per warp instruction per SM sub-partition, and whether
the e4m3 conversion shares the MUFU pipe with the exponential.

Each kernel runs a loop of one inline-PTX body over four independent chains per thread, 32 warps per
SM on every SM; a body's time per warp iteration per sub-partition, divided by its instruction count,
is the rate. The SM clock is read from NVML, so run it on an idle GPU.

`--per-smsp N` asks what N warps on a sub-partition get, which is what the softmax of one or two consumer
warpgroups sees (one program of 4N warps per SM, 32 chains per sub-partition so that latency does not
bound it): the rate per sub-partition and the interval between one warp's own instructions. `--beside
NAME` puts one warp running NAME next to each timed warp (two programs of 4 warps per SM): how much a
neighbour busy on other pipes slows it, i.e. whether one consumer's exponentials run at the MUFU's rate
while the other consumer computes its row maximum. Only SMs where the block scheduler put one timed
program and one neighbour, the neighbour running beside at least 95% of the timed loop, are counted.
The timed program is the older one, and the warp scheduler is not fair across programs: a neighbour on
the same pipe does not halve it (ex2 beside ex2 8.06 cycles on the H100), and one that issues every
cycle starves it (beside fmnmx+ffma 52.3 on the H100). Read the figures as what a
neighbour's issue costs, not as a fair share.

    python3 benchmarks/pipe_rates.py                                   # GPU: every body, saturated
    python3 benchmarks/pipe_rates.py --bodies ex2,ex2.f16x2 --per-smsp 1
    python3 benchmarks/pipe_rates.py --bodies ex2 --per-smsp 1 --beside fmnmx+ffma
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict

import triton
import triton.language as tl

#: four exponentials, $4..$7 into $0..$3
_EX2 = (
    "ex2.approx.ftz.f32 $0, $4;\nex2.approx.ftz.f32 $1, $5;\nex2.approx.ftz.f32 $2, $6;\nex2.approx.ftz.f32 $3, $7;\n"
)
#: four e4m3x2 conversions of $4..$7, their pairs joined into w0, w1
_CVT = (
    "cvt.rn.satfinite.e4m3x2.f32 h0, $5, $4;\ncvt.rn.satfinite.e4m3x2.f32 h1, $7, $6;\n"
    "cvt.rn.satfinite.e4m3x2.f32 h2, $4, $5;\ncvt.rn.satfinite.e4m3x2.f32 h3, $6, $7;\n"
    "mov.b32 w0, {h0, h1};\nmov.b32 w1, {h2, h3};\n"
)
_CVT_REGS = "{ .reg .b16 h0, h1, h2, h3; .reg .b32 w0, w1;\n"

#: scratch registers of the two-kind bodies: t0..t3, one per chain
_T32 = "{ .reg .b32 t0, t1, t2, t3;\n"
#: the low 16 bits of $4..$7 as l0..l3 (mov to a .b16 pair is a register view), scratch t0..t3
_B16 = "{ .reg .b16 l0, h0, l1, h1, l2, h2, l3, h3; .reg .b32 t0, t1, t2, t3;\n" + "".join(
    f"mov.b32 {{l{k}, h{k}}}, ${4 + k};\n" for k in range(4)
)


def _each(line: str) -> str:
    """`line` for each chain k = 0..3: {o} its output $k, {i} its input $(4+k), {n} the next chain's
    input (for two-input instructions), {k} its index (scratch registers)."""
    return "".join(line.format(o=f"${k}", i=f"${4 + k}", n=f"${4 + (k + 1) % 4}", k=k) + "\n" for k in range(4))


#: name -> (PTX body over $4..$7 into $0..$3, instructions of the measured kind per iteration, that
#: kind); a rate is the body's time per instruction of that kind, its other instructions included
BODIES = {
    "ex2": (_EX2, 4, "MUFU.EX2"),
    # the packed f16 exponential (two MUFU.EX2.F16 per instruction on sm_90a): per PTX instruction, i.e.
    # per two exponentials (16.0 cycles on the H100: two f32 exponentials' worth)
    "ex2.f16x2": (_each("ex2.approx.f16x2 {o}, {i};"), 4, "MUFU.EX2.F16"),
    "ffma": (
        "fma.rn.f32 $0, $4, 0f3F000000, 0fBE000000;\nfma.rn.f32 $1, $5, 0f3F000000, 0fBE000000;\n"
        "fma.rn.f32 $2, $6, 0f3F000000, 0fBE000000;\nfma.rn.f32 $3, $7, 0f3F000000, 0fBE000000;",
        4,
        "FFMA",
    ),
    "fmnmx": (
        "max.f32 $0, $4, 0f3F000000;\nmax.f32 $1, $5, 0f3F000000;\n"
        "max.f32 $2, $6, 0f3F000000;\nmax.f32 $3, $7, 0f3F000000;",
        4,
        "FMNMX",
    ),
    "prmt": (
        "prmt.b32 $0, $4, $5, 0x5140;\nprmt.b32 $1, $5, $6, 0x5140;\n"
        "prmt.b32 $2, $6, $7, 0x5140;\nprmt.b32 $3, $7, $4, 0x5140;",
        4,
        "PRMT",
    ),
    # the conversions folded back into the chains (LOP3)
    "cvt": (
        _CVT_REGS + _CVT + "xor.b32 $0, w0, $4;\nxor.b32 $1, w1, $5;\nxor.b32 $2, w0, $6;\nxor.b32 $3, w1, $7; }",
        4,
        "F2FP",
    ),
    # ex2's four exponentials and cvt's four conversions in one body: if the conversion used the MUFU
    # pipe, this would take ex2 + cvt; it takes ex2 alone
    "ex2+cvt": (_CVT_REGS + _EX2 + _CVT + "xor.b32 $0, $0, w0;\nxor.b32 $1, $1, w1; }", 4, "MUFU.EX2"),
    # the exact softmax's work per score: the FMA into x, the exponential, an FADD (the row sum's) and half
    # an e4m3x2 conversion (its codes kept live in one bit); each chain stays in [-1, 0)
    "softmax": (
        "{ .reg .b32 t0, t1, t2, t3, w0, w1; .reg .b16 h0, h1, h2, h3;\n"
        + _each("fma.rn.f32 t{k}, {i}, 0f3F000000, 0fBF800000;\nex2.approx.ftz.f32 t{k}, t{k};")
        + "cvt.rn.satfinite.e4m3x2.f32 h0, t1, t0;\ncvt.rn.satfinite.e4m3x2.f32 h1, t3, t2;\n"
        + "mov.b32 w0, {h0, h1};\nand.b32 w0, w0, 1;\n"
        + _each("add.f32 {o}, t{k}, 0fBF000000;")
        + "xor.b32 $0, $0, w0; }",
        4,
        "MUFU.EX2",
    ),
    # lean P's instructions: its clamp as a saturating FMA or an integer max, the code
    # sums' e4m3 -> f16x2 unpack and f16x2 add, and bf16x2 packing / max (a halved row-maximum tree)
    "ffma.sat": (_each("fma.rn.sat.f32 {o}, {i}, 0f3F000000, 0f3E000000;"), 4, "FFMA.SAT"),
    # (ptxas fuses this body's max.s32 pairs into VIMNMX3: its rate is per PTX max; imnmx3 times the
    # instruction)
    "imnmx": (_each("max.s32 {o}, {i}, 1262485504;"), 4, "VIMNMX"),
    # a three-input integer max (two max.s32 that ptxas fuses), and with FMNMX: one pipe or two
    # (the row maximum over the scores' bits)
    "imnmx3": (_T32 + _each("max.s32 t{k}, {i}, {n};\nmax.s32 {o}, t{k}, 1262485504;") + "}", 4, "VIMNMX3"),
    "fmnmx+imnmx3": (
        _T32 + _each("max.f32 t{k}, {i}, 0f3F000000;\nmax.s32 {o}, t{k}, {n};\nmax.s32 {o}, {o}, 7;") + "}",
        4,
        "FMNMX",
    ),
    "unpack": (_B16 + _each("cvt.rn.f16x2.e4m3x2 {o}, l{k};") + "}", 4, "F2FP.F16.E4M3.UNPACK_B"),
    "hadd2": (_each("add.rn.f16x2 {o}, {i}, {i};"), 4, "HADD2"),
    "bf16pack": (_each("cvt.rn.bf16x2.f32 {o}, {i}, {n};"), 4, "F2FP.BF16.F32.PACK_AB"),
    "hmnmx2": (_each("max.bf16x2 {o}, {i}, {n};"), 4, "HMNMX2"),
    # two kinds per chain: as fast as the slower alone where they issue to different pipes, their sum
    # where they share one
    "unpack+fmnmx": (
        _B16 + _each("cvt.rn.f16x2.e4m3x2 t{k}, l{k};\nmax.f32 {o}, t{k}, 0f3F000000;") + "}",
        4,
        "F2FP.F16.E4M3.UNPACK_B",
    ),
    "fmnmx+ffma": (
        _T32 + _each("max.f32 t{k}, {i}, 0f3F000000;\nfma.rn.f32 {o}, t{k}, 0f3F000000, 0fBE000000;") + "}",
        4,
        "FMNMX",
    ),
    "fmnmx+prmt": (_T32 + _each("max.f32 t{k}, {i}, 0f3F000000;\nprmt.b32 {o}, t{k}, {n}, 0x5140;") + "}", 4, "FMNMX"),
}
ITERS = 2048
WARPS = 8  # per program; 4 programs per SM
#: chains per thread of a lone warp, in groups of four (one body per group); N warps per sub-partition
#: take FEW_WARP_GROUPS / N groups each, so a sub-partition always has 32 chains to hide latency with
FEW_WARP_GROUPS = 8
#: the neighbour's rounds: enough that a one-instruction FMNMX body outlasts the slowest timed body (at 4x
#: ITERS most fmnmx neighbours ended first on the H100, at 16x the ffma ones)
NEIGHBOUR_ITERS = 64 * ITERS


@triton.jit
def _loop(
    x_ptr,
    out_ptr,
    cycles_ptr,
    sm_ptr,
    ITERS: tl.constexpr,
    BODY: tl.constexpr,
    ELEMS: tl.constexpr,
    OTHER: tl.constexpr,
    OTHER_ITERS: tl.constexpr,
):
    """ITERS rounds of BODY over each thread's ELEMS / 32 / num_warps groups of four chains; with OTHER,
    the grid's second half runs OTHER_ITERS rounds of it instead (a neighbour, where the block scheduler
    puts one on a timed program's SM). Writes each thread's %clock64 at its loop's start and end to
    cycles_ptr (one clock per SM: comparable between programs on one SM) and its SM's id to sm_ptr."""
    offs = tl.program_id(0) * ELEMS + tl.arange(0, ELEMS)
    a = tl.load(x_ptr + offs)
    b = a + 0.25
    c = a + 0.5
    d = a + 0.75
    t0 = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [offs], dtype=tl.int64, is_pure=False, pack=1)
    if OTHER != "" and tl.program_id(0) >= tl.num_programs(0) // 2:
        for _ in range(OTHER_ITERS):
            a, b, c, d = tl.inline_asm_elementwise(
                OTHER,
                "=r,=r,=r,=r,r,r,r,r",
                [a, b, c, d],
                dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
                is_pure=True,
                pack=1,
            )
    else:
        for _ in range(ITERS):
            a, b, c, d = tl.inline_asm_elementwise(
                BODY,
                "=r,=r,=r,=r,r,r,r,r",
                [a, b, c, d],
                dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
                is_pure=True,
                pack=1,
            )
    t1 = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [offs], dtype=tl.int64, is_pure=False, pack=1)
    tl.store(out_ptr + offs, a + b + c + d)
    tl.store(cycles_ptr + 2 * offs, t0)
    tl.store(cycles_ptr + 2 * offs + 1, t1)
    tl.store(
        sm_ptr + offs,
        tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [offs], dtype=tl.int32, is_pure=False, pack=1),
    )


def _layout(per_smsp: int | None, beside: str | None) -> tuple[int, int, int]:
    """(programs per SM, warps per program, elements per program) of a run: the saturated default (4
    programs of WARPS warps, one group of chains a thread), N warps per sub-partition (one program of
    4N warps, 32 chains per sub-partition), or a timed program and a neighbour of 4 warps each."""
    if beside is not None:
        return 2, 4, 4 * 32 * FEW_WARP_GROUPS
    if per_smsp is not None:
        return 1, 4 * per_smsp, 4 * 32 * FEW_WARP_GROUPS
    return 4, WARPS, WARPS * 32


def _constexprs(name: str, per_smsp: int | None, beside: str | None) -> dict:
    """_loop's compile-time arguments for a run (ELEMS from _layout; OTHER empty without a neighbour)."""
    return {
        "ITERS": ITERS,
        "BODY": BODIES[name][0],
        "ELEMS": _layout(per_smsp, beside)[2],
        "OTHER": BODIES[beside][0] if beside else "",
        "OTHER_ITERS": NEIGHBOUR_ITERS,
    }


def _check(per_smsp: int | None, beside: str | None) -> None:
    if per_smsp is not None and per_smsp not in (1, 2, 4, 8):
        raise ValueError(
            f"per_smsp={per_smsp}: 1, 2, 4 or 8 warps per sub-partition (a program's warps are a "
            "power of two, at most 32)"
        )
    if beside is not None and beside not in BODIES:
        raise ValueError(f"beside={beside!r}: not a body; one of {', '.join(BODIES)}")
    if beside is not None and per_smsp not in (None, 1):
        raise ValueError("beside: one timed warp and one neighbour per sub-partition (per_smsp 1)")


#: the share of a timed loop its neighbour must run beside (it is launched a little later, so not all)
COVER = 0.95


def _paired(sm: list[int], start: list[int], end: list[int]) -> list[int]:
    """The timed programs (the grid's first half) that shared their SM (sm[p]: program p's) with exactly
    one other program, a neighbour (second half), running beside at least COVER of the timed loop (start /
    end: %clock64, one clock per SM): the block scheduler decides where and when programs run."""
    half = len(sm) // 2
    on = defaultdict(list)
    for p, s in enumerate(sm):
        on[s].append(p)
    return sorted(
        t
        for t, n in (sorted(ps) for ps in on.values() if len(ps) == 2)
        if t < half <= n and min(end[t], end[n]) - max(start[t], start[n]) >= COVER * (end[t] - start[t])
    )


def compile_sm90(name: str, per_smsp: int | None = None, beside: str | None = None):
    """The loop kernel of BODIES[name] (with its neighbour's branch where `beside`) compiled for sm_90a
    without a GPU (CompiledArtifacts: the CPU test reads its SASS)."""
    from triton.backends.compiler import GPUTarget

    from zyfa_tune.generator.build import artifacts

    _check(per_smsp, beside)
    constexprs = _constexprs(name, per_smsp, beside)
    signature = {
        "x_ptr": "*fp32",
        "out_ptr": "*fp32",
        "cycles_ptr": "*i64",
        "sm_ptr": "*i32",
        **dict.fromkeys(constexprs, "constexpr"),
    }
    src = triton.compiler.ASTSource(fn=_loop, signature=signature, constexprs=constexprs)
    warps = _layout(per_smsp, beside)[1]
    return artifacts(triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}))


def measure(
    name: str, reps: int = 5, per_smsp: int | None = None, beside: str | None = None
) -> tuple[float, float, int]:
    """(cycles per warp instruction per sub-partition, cycles between one warp's own instructions, timed
    programs counted) of BODIES[name]: saturated (32 warps per SM, timed by events at NVML's clock), or with
    per_smsp / beside (timed by each thread's %clock64, median over the timed programs; beside, only those
    whose neighbour ran beside COVER of their loop, the fewest of any rep). The neighbour runs NEIGHBOUR_ITERS
    rounds, so that it can."""
    import torch

    from zyfa_tune.tuning.timing import gpu_state

    _check(per_smsp, beside)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    per_sm, warps, elems = _layout(per_smsp, beside)
    programs = sms * per_sm
    x = torch.rand(programs * elems, device="cuda") - 1.0
    out = torch.empty_like(x)
    cycles = torch.empty(programs * elems * 2, device="cuda", dtype=torch.int64)
    sm_of = torch.empty(programs * elems, device="cuda", dtype=torch.int32)
    count = BODIES[name][1]
    constexprs = _constexprs(name, per_smsp, beside)

    def launch():
        _loop[(programs,)](x, out, cycles, sm_of, **constexprs, num_warps=warps)

    launch()
    torch.cuda.synchronize()
    groups = elems // (warps * 32)  # bodies per thread per round
    if per_smsp is None and beside is None:
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(reps):
            launch()
        e1.record()
        torch.cuda.synchronize()
        seconds = e0.elapsed_time(e1) / reps / 1e3
        clock_hz = (gpu_state().get("sm_clock_mhz") or 1980) * 1e6
        warp_iterations_per_smsp = programs * warps * ITERS * groups / (sms * 4)
        per_smsp_cycles = seconds * clock_hz / warp_iterations_per_smsp / count
        return per_smsp_cycles, per_smsp_cycles * warps * per_sm / 4, programs
    spans, counted = [], []
    for _ in range(reps):
        launch()
        torch.cuda.synchronize()
        start, end = cycles.view(programs, elems, 2)[:, 0].T.tolist()
        span = [e - s for s, e in zip(start, end)]
        sm = sm_of.view(programs, elems)[:, 0].tolist()
        timed = list(range(programs)) if beside is None else _paired(sm, start, end)
        if not timed:
            raise RuntimeError("beside: the block scheduler ran no timed program on an SM beside a running neighbour")
        spans.append(sorted(span[p] for p in timed)[len(timed) // 2])
        counted.append(len(timed))
    own = sorted(spans)[len(spans) // 2] / (ITERS * groups * count)
    timed_warps_per_smsp = warps // 4
    return own / timed_warps_per_smsp, own, min(counted)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bodies", default=",".join(BODIES), help="comma list of " + ", ".join(BODIES))
    ap.add_argument(
        "--per-smsp", type=int, choices=(1, 2, 4, 8), help="warps per sub-partition (default: 8, timed by events)"
    )
    ap.add_argument("--beside", choices=list(BODIES), help="a neighbour warp running this body (per-smsp 1)")
    args = ap.parse_args(argv)
    names = args.bodies.split(",")
    for name in names:
        if name not in BODIES:
            ap.error(f"--bodies: {name!r} is not a body; one of {', '.join(BODIES)}")
    per_smsp = 1 if args.beside and args.per_smsp is None else args.per_smsp
    try:
        _check(per_smsp, args.beside)
    except ValueError as e:
        ap.error(str(e))
    import torch

    if not torch.cuda.is_available():
        print("pipe_rates: needs a CUDA GPU", file=sys.stderr)
        return 2
    where = f"{per_smsp or 8} warp(s) per SMSP" + (f", each beside one running {args.beside}" if args.beside else "")
    for name in names:
        cycles, own, timed = measure(name, per_smsp=per_smsp, beside=args.beside)
        print(
            f"{name:12s} {BODIES[name][2]:14s} {cycles:5.2f} cycles per warp instruction per SMSP "
            f"({4 * 32 / cycles:6.1f} per clock per SM); one warp's own every {own:5.2f} cycles; {where}"
            + (f" ({timed} SMs with a pair, at least)" if args.beside else "")
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
