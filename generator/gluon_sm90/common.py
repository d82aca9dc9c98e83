"""Imports of every emitted Gluon kernel, the e4m3 pack asm and the timeline marks.

The marks (`_mark`, `_marked`) stamp the SM clock at a consumer step's events into the buffer of a
traced twin (TRACE, generator/gluon_sm90/trace.py); in every other kernel they compile to nothing.
"""
# The config's constants (BLOCK_N, LEAN, ...) are defined only in the emitted module, by
# generator/gluon_sm90/emit.py; the imports below the marker are those of the whole emitted kernel:
# ruff: noqa: F821, F401

# ---- emitted below this line ----


from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                               warpgroup_mma, warpgroup_mma_wait)

#: four float32 probabilities ($1..$4, key order) -> one register of four e4m3 ($0), as the wgmma A
#: operand holds them
E4M3X4_ASM = gl.constexpr("{ .reg .b16 lo, hi;\n"
                          "cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;\n"
                          "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;\n"
                          "mov.b32 $0, {lo, hi}; }")


@gluon.jit
def _slot(kv_it, EVENT: gl.constexpr, CID):
    """The timeline buffer's word for (consumer warpgroup CID, step kv_it, EVENT); -1 (no store) for
    steps past the warpgroup's TRACE_STEPS."""
    return gl.where(kv_it < TRACE_STEPS, (CID * TRACE_STEPS + kv_it) * TRACE_EVENTS + EVENT, -1)


@gluon.jit
def _mark(kv_it, EVENT: gl.constexpr, CID):
    """TRACE only (generator/gluon_sm90/trace.py): CTA 0 stores the SM clock for consumer warpgroup CID,
    step kv_it, EVENT; nothing otherwise. One element per thread, so each thread runs the asm once."""
    if TRACE:
        one: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        slot = gl.full([128], 0, gl.int32, layout=one) + _slot(kv_it, EVENT, CID)
        gl.inline_asm_elementwise(TRACE_ASM, "=r,r", [slot], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _marked(x, kv_it, EVENT: gl.constexpr, CID):
    """_mark once the float32 row vector x is computed (x passes through the asm, so the clock is
    read after it); returns x."""
    if TRACE:
        slot = gl.full(x.shape, 0, gl.int32, x.type.layout) + _slot(kv_it, EVENT, CID)
        x = gl.inline_asm_elementwise(TRACE_AFTER_ASM, "=r,r,r", [x, slot], dtype=gl.float32, is_pure=False, pack=1)
    return x
