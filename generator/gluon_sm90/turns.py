"""Ping-pong turns: the consumer warpgroups issue their wgmmas in turn (a token passed round robin
on an mbarrier, or a hardware named barrier), so that one warpgroup's softmax overlaps another's
matrix products.
"""
# The config's constants (BLOCK_N, LEAN, ...) are defined only in the emitted module, by
# generator/gluon_sm90/emit.py:
# ruff: noqa: F821

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

# ---- emitted below this line ----


@gluon.jit
def _turn_wait(turn_bars, turn_it, CID: gl.constexpr, PINGPONG: gl.constexpr):
    """Ping-pong: wait for this warpgroup's turn to issue wgmmas, a token passed round robin: an
    mbarrier (warpgroup 0 starts on the already complete phase), or with NAMED_TURNS a hardware
    named barrier as FA3 uses (_named_turn)."""
    if PINGPONG:
        if NAMED_TURNS:
            _named_turn(CID, False)
        elif CID == 0:
            mbarrier.wait(turn_bars.index(0), (turn_it & 1) ^ 1)
        else:
            mbarrier.wait(turn_bars.index(CID), turn_it & 1)


@gluon.jit
def _turn_pass(turn_bars, CID: gl.constexpr, NUM_CONSUMERS: gl.constexpr, PINGPONG: gl.constexpr):
    if PINGPONG:
        if NAMED_TURNS:
            _named_turn((CID + 1) % NUM_CONSUMERS, True)
        else:
            mbarrier.arrive(turn_bars.index((CID + 1) % NUM_CONSUMERS), count=1)


@gluon.jit
def _named_turn(WG: gl.constexpr, ARRIVE: gl.constexpr):
    """NAMED_TURNS: consumer warpgroup WG's turn is named barrier 8 + WG over 256 threads: its own 128
    bar.sync on it, the warpgroup before it in the ring bar.arrives on it (128 more). The last
    warpgroup arrives once before the first tile (_turns_start), so warpgroup 0 goes first. Barriers
    8-10: Triton's partitions use 0-3 and ex2_fence 13-15. The asm runs once per thread (one element
    of a 128-element, one-per-thread tensor holding the barrier's number); its result is unused, its
    side effect is the point."""
    one: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    barrier = gl.full([128], 8 + WG, gl.int32, layout=one)
    if ARRIVE:
        gl.inline_asm_elementwise("bar.arrive $1, 256;\nmov.b32 $0, $1;", "=r,r", [barrier], dtype=gl.int32,
                                  is_pure=False, pack=1)
    else:
        gl.inline_asm_elementwise("bar.sync $1, 256;\nmov.b32 $0, $1;", "=r,r", [barrier], dtype=gl.int32,
                                  is_pure=False, pack=1)


@gluon.jit
def _turns_start(CID: gl.constexpr, NUM_CONSUMERS: gl.constexpr, PINGPONG: gl.constexpr):
    """NAMED_TURNS: the last consumer warpgroup hands warpgroup 0 its first turn."""
    if PINGPONG:
        if NAMED_TURNS:
            if CID == NUM_CONSUMERS - 1:
                _named_turn(0, True)
