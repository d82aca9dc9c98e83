"""Issue rates of the instructions the exact softmax is made of, on this GPU (the numbers behind the
timeline reading in docs/BACKENDS.md): cycles per warp instruction per SM sub-partition, and whether
the e4m3 conversion shares the MUFU pipe with the exponential.

Each kernel runs a loop of one inline-PTX body over four independent chains per thread, 32 warps per
SM on every SM; a body's time per warp iteration per sub-partition, divided by its instruction count,
is the rate. The SM clock is read from NVML, so run it on an idle GPU.

    python3 benchmarks/pipe_rates.py            # GPU
"""

from __future__ import annotations

import argparse
import sys

import triton
import triton.language as tl

#: four exponentials, $4..$7 into $0..$3
_EX2 = ("ex2.approx.ftz.f32 $0, $4;\nex2.approx.ftz.f32 $1, $5;\n"
        "ex2.approx.ftz.f32 $2, $6;\nex2.approx.ftz.f32 $3, $7;\n")
#: four e4m3x2 conversions of $4..$7, their pairs joined into w0, w1
_CVT = ("cvt.rn.satfinite.e4m3x2.f32 h0, $5, $4;\ncvt.rn.satfinite.e4m3x2.f32 h1, $7, $6;\n"
        "cvt.rn.satfinite.e4m3x2.f32 h2, $4, $5;\ncvt.rn.satfinite.e4m3x2.f32 h3, $6, $7;\n"
        "mov.b32 w0, {h0, h1};\nmov.b32 w1, {h2, h3};\n")
_CVT_REGS = "{ .reg .b16 h0, h1, h2, h3; .reg .b32 w0, w1;\n"

#: scratch registers of the two-kind bodies: t0..t3, one per chain
_T32 = "{ .reg .b32 t0, t1, t2, t3;\n"
#: the low 16 bits of $4..$7 as l0..l3 (mov to a .b16 pair is a register view), scratch t0..t3
_B16 = ("{ .reg .b16 l0, h0, l1, h1, l2, h2, l3, h3; .reg .b32 t0, t1, t2, t3;\n"
        + "".join(f"mov.b32 {{l{k}, h{k}}}, ${4 + k};\n" for k in range(4)))


def _each(line: str) -> str:
    """`line` for each chain k = 0..3: {o} its output $k, {i} its input $(4+k), {n} the next chain's
    input (for two-input instructions), {k} its index (scratch registers)."""
    return "".join(line.format(o=f"${k}", i=f"${4 + k}", n=f"${4 + (k + 1) % 4}", k=k) + "\n" for k in range(4))


#: name -> (PTX body over $4..$7 into $0..$3, instructions of the measured kind per iteration, that
#: kind); a rate is the body's time per instruction of that kind, its other instructions included
BODIES = {
    "ex2": (_EX2, 4, "MUFU.EX2"),
    "ffma": ("fma.rn.f32 $0, $4, 0f3F000000, 0fBE000000;\nfma.rn.f32 $1, $5, 0f3F000000, 0fBE000000;\n"
             "fma.rn.f32 $2, $6, 0f3F000000, 0fBE000000;\nfma.rn.f32 $3, $7, 0f3F000000, 0fBE000000;", 4, "FFMA"),
    "fmnmx": ("max.f32 $0, $4, 0f3F000000;\nmax.f32 $1, $5, 0f3F000000;\n"
              "max.f32 $2, $6, 0f3F000000;\nmax.f32 $3, $7, 0f3F000000;", 4, "FMNMX"),
    "prmt": ("prmt.b32 $0, $4, $5, 0x5140;\nprmt.b32 $1, $5, $6, 0x5140;\n"
             "prmt.b32 $2, $6, $7, 0x5140;\nprmt.b32 $3, $7, $4, 0x5140;", 4, "PRMT"),
    # the conversions folded back into the chains (LOP3)
    "cvt": (_CVT_REGS + _CVT + "xor.b32 $0, w0, $4;\nxor.b32 $1, w1, $5;\nxor.b32 $2, w0, $6;\nxor.b32 $3, w1, $7; }",
            4, "F2FP"),
    # ex2's four exponentials and cvt's four conversions in one body: if the conversion used the MUFU
    # pipe, this would take ex2 + cvt; it takes ex2 alone
    "ex2+cvt": (_CVT_REGS + _EX2 + _CVT + "xor.b32 $0, $0, w0;\nxor.b32 $1, $1, w1; }", 4, "MUFU.EX2"),
    # lean P's instructions (session 26): its clamp as a saturating FMA or an integer max, the code
    # sums' e4m3 -> f16x2 unpack and f16x2 add, and bf16x2 packing / max (a halved row-maximum tree)
    "ffma.sat": (_each("fma.rn.sat.f32 {o}, {i}, 0f3F000000, 0f3E000000;"), 4, "FFMA.SAT"),
    # (ptxas fuses this body's max.s32 pairs into VIMNMX3: its rate is per PTX max; imnmx3 times the
    # instruction)
    "imnmx": (_each("max.s32 {o}, {i}, 1262485504;"), 4, "VIMNMX"),
    # a three-input integer max (two max.s32 that ptxas fuses), and with FMNMX: one pipe or two
    # (session 27: the row maximum over the scores' bits)
    "imnmx3": (_T32 + _each("max.s32 t{k}, {i}, {n};\nmax.s32 {o}, t{k}, 1262485504;") + "}", 4, "VIMNMX3"),
    "fmnmx+imnmx3": (_T32 + _each("max.f32 t{k}, {i}, 0f3F000000;\nmax.s32 {o}, t{k}, {n};\nmax.s32 {o}, {o}, 7;")
                     + "}", 4, "FMNMX"),
    "unpack": (_B16 + _each("cvt.rn.f16x2.e4m3x2 {o}, l{k};") + "}", 4, "F2FP.F16.E4M3.UNPACK_B"),
    "hadd2": (_each("add.rn.f16x2 {o}, {i}, {i};"), 4, "HADD2"),
    "bf16pack": (_each("cvt.rn.bf16x2.f32 {o}, {i}, {n};"), 4, "F2FP.BF16.F32.PACK_AB"),
    "hmnmx2": (_each("max.bf16x2 {o}, {i}, {n};"), 4, "HMNMX2"),
    # two kinds per chain: as fast as the slower alone where they issue to different pipes, their sum
    # where they share one
    "unpack+fmnmx": (_B16 + _each("cvt.rn.f16x2.e4m3x2 t{k}, l{k};\nmax.f32 {o}, t{k}, 0f3F000000;") + "}",
                     4, "F2FP.F16.E4M3.UNPACK_B"),
    "fmnmx+ffma": (_T32 + _each("max.f32 t{k}, {i}, 0f3F000000;\nfma.rn.f32 {o}, t{k}, 0f3F000000, 0fBE000000;") + "}",
                   4, "FMNMX"),
    "fmnmx+prmt": (_T32 + _each("max.f32 t{k}, {i}, 0f3F000000;\nprmt.b32 {o}, t{k}, {n}, 0x5140;") + "}",
                   4, "FMNMX"),
}
ITERS = 2048
WARPS = 8  # per program; 4 programs per SM


@triton.jit
def _loop(x_ptr, out_ptr, ITERS: tl.constexpr, BODY: tl.constexpr):
    offs = tl.program_id(0) * 256 + tl.arange(0, 256)
    a = tl.load(x_ptr + offs)
    b = a + 0.25
    c = a + 0.5
    d = a + 0.75
    for _ in range(ITERS):
        a, b, c, d = tl.inline_asm_elementwise(BODY, "=r,=r,=r,=r,r,r,r,r", [a, b, c, d],
                                               dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
                                               is_pure=True, pack=1)
    tl.store(out_ptr + offs, a + b + c + d)


def compile_sm90(name: str):
    """The loop kernel of BODIES[name] compiled for sm_90a without a GPU (CompiledArtifacts: the CPU
    test reads its SASS)."""
    from triton.backends.compiler import GPUTarget

    from zyfa_tune.generator.build import artifacts

    src = triton.compiler.ASTSource(fn=_loop, signature={"x_ptr": "*fp32", "out_ptr": "*fp32", "ITERS": "constexpr",
                                                         "BODY": "constexpr"},
                                    constexprs={"ITERS": ITERS, "BODY": BODIES[name][0]})
    return artifacts(triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": WARPS}))


def measure(name: str, reps: int = 5) -> tuple[float, float]:
    """(cycles per warp instruction per sub-partition, instructions per clock per SM) of BODIES[name]."""
    import torch

    from zyfa_tune.kernels.timing import gpu_state

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    programs = sms * 4
    x = torch.rand(programs * 256, device="cuda") - 1.0
    out = torch.empty_like(x)
    body, count, _ = BODIES[name]
    _loop[(programs,)](x, out, ITERS=ITERS, BODY=body, num_warps=WARPS)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(reps):
        _loop[(programs,)](x, out, ITERS=ITERS, BODY=body, num_warps=WARPS)
    e1.record()
    torch.cuda.synchronize()
    seconds = e0.elapsed_time(e1) / reps / 1e3
    clock_hz = (gpu_state().get("sm_clock_mhz") or 1980) * 1e6
    warp_iterations_per_smsp = programs * WARPS * ITERS / (sms * 4)
    cycles = seconds * clock_hz / warp_iterations_per_smsp / count
    return cycles, 4 * 32 / cycles


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bodies", default=",".join(BODIES), help="comma list of " + ", ".join(BODIES))
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("pipe_rates: needs a CUDA GPU", file=sys.stderr)
        return 2
    for name in args.bodies.split(","):
        cycles, per_clock = measure(name)
        print(f"{name:8s} {BODIES[name][2]:9s} {cycles:5.2f} cycles per warp instruction per SMSP "
              f"({per_clock:6.1f} per clock per SM)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
