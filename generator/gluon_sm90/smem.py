"""Shared-memory tile views and fills the steps and the consumer use: a tile's first HALF keys, and
the row-sum wgmma's tile of ones.
"""
# The config's constants (BLOCK_N, LEAN, ...) are defined only in the emitted module, by
# generator/gluon_sm90/emit.py:
# ruff: noqa: F821

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

# ---- emitted below this line ----


@gluon.jit
def _keys(smem, HALF: gl.constexpr, DIM: gl.constexpr):
    """A K (DIM 0) or V^T / ones (DIM 1) tile, or with HALF > 0 its first HALF keys."""
    if HALF > 0:
        return smem.slice(0, HALF, dim=DIM)
    else:
        return smem


@gluon.jit
def _ones(smem, N: gl.constexpr):
    """Fill an (8, N) e4m3 tile with ones and return it. Every byte is 1.0 (0x38), so the swizzle
    does not matter: the tile is written as a flat run of 32-bit words. (A 2-D e4m3 store of the tile
    is lowered to stmatrix.b16 and leaves half the bytes unwritten: rows would be summed over half their
    keys.)"""
    fill: gl.constexpr = gl.BlockedLayout([2], [32], [4], [0])
    words = smem._reinterpret(gl.int32, [2 * N], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    words.store(gl.full([2 * N], 0x38383838, gl.int32, layout=fill))
    return smem
