"""Tile scheduling: which (batch, head, query block) tiles a program visits, in what order, and
which key blocks of a tile are visited and masked. Shared by the producer and the consumers, so both
walk the same tiles and blocks in the same order (their barrier phases depend on it).
"""
# The config's constants (BLOCK_N, LEAN, ...) are defined only in the emitted module, by
# generator/gluon_sm90/emit.py:
# ruff: noqa: F821

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

# ---- emitted below this line ----


@gluon.jit
def _tile_coords(t, n_bh, H, n_m, HEAVY_FIRST: gl.constexpr):
    """Tile t of the grid -> (batch, head, query block): heavy first = the longest causal rows of
    every (batch, head) before any shorter one."""
    if HEAVY_FIRST:
        mb = n_m - 1 - t // n_bh
        bh = t % n_bh
    else:
        bh = t // n_m
        mb = t % n_m
    return bh // H, bh % H, mb


@gluon.jit
def _tile_loop(tile_table, n_tiles):
    """(lo, hi, step) of this program's tile loop; _tile_at maps its index to a tile. BALANCED: the
    launcher's schedule (kernels/gluon_launch.tile_table, int32): program p takes the tiles
    table[P + 1 + i] for i in [table[p], table[p + 1]); else round robin, tiles pid, pid + P, ..."""
    if BALANCED:
        pid = gl.program_id(0)
        return gl.load(tile_table + pid), gl.load(tile_table + pid + 1), 1
    else:
        return gl.program_id(0), n_tiles, gl.num_programs(0)


@gluon.jit
def _tile_at(tile_table, i):
    """Tile of loop index i (_tile_loop): read from the table (BALANCED; a forward tile number) or i."""
    if BALANCED:
        return gl.load(tile_table + gl.num_programs(0) + 1 + i)
    else:
        return i


@gluon.jit
def _block_range(m0, Sq, Sk, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """(n_blocks, n_masked): key blocks [0, n_blocks) are visited from the top down; the first
    n_masked visited (those crossing the causal diagonal or the key end) need a mask."""
    if CAUSAL:
        off = Sk - Sq
        hi = gl.minimum(Sk, gl.maximum(m0 + BLOCK_M + off, 0))
        n_blocks = gl.cdiv(hi, BLOCK_N)
        lo_vis = gl.maximum(m0 + off + 1, 0)          # keys [0, lo_vis) are visible to every row
        n_full = gl.minimum(lo_vis // BLOCK_N, Sk // BLOCK_N)
    else:
        n_blocks = gl.cdiv(Sk, BLOCK_N)
        n_full = Sk // BLOCK_N
    n_full = gl.minimum(n_full, n_blocks)
    return n_blocks, n_blocks - n_full


@gluon.jit
def _window_range(m0, Sq, Sk, win_l, win_r, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """The window kernel's _block_range: row r sees keys r + off - win_l .. r + off + win_r below Sk (off = Sk -
    Sq; a causal window has win_r = 0). Returns (top, n_masked, n_visit, n_open): blocks [top - n_visit, top)
    are visited from the top down (the others hold no key of any row of the tile); visits [0, n_masked)
    cross the right edge or the key end and [n_open, n_visit) the left edge, so both pay for the mask;
    every row of the tile sees the whole of each block visited between them."""
    off = Sk - Sq
    top = gl.cdiv(gl.minimum(Sk, gl.maximum(m0 + BLOCK_M + off + win_r, 0)), BLOCK_N)
    lo = gl.minimum(gl.maximum(m0 + off - win_l, 0) // BLOCK_N, top)
    right_full = gl.minimum(gl.maximum(m0 + off + win_r + 1, 0) // BLOCK_N, Sk // BLOCK_N)  # first row, key end
    left_full = gl.cdiv(gl.maximum(m0 + BLOCK_M - 1 + off - win_l, 0), BLOCK_N)  # the tile's last row
    n_visit = top - lo
    n_masked = top - gl.maximum(right_full, lo)
    n_open = gl.minimum(gl.maximum(top - left_full, n_masked), n_visit)
    return top, n_masked, n_visit, n_open


@gluon.jit
def _ragged_loop(tile_table, H):
    """VARLEN: (lo, hi, step) of this program's loop over packed sequences' tiles, round robin over the
    tiles in `_ragged_tile`'s order (kernels/gluon_varlen.ragged_tiles: the table's first word counts
    the (sequence, query block) entries that hold rows; each is H tiles, one per head)."""
    return gl.program_id(0), gl.load(tile_table) * H, gl.num_programs(0)


@gluon.jit
def _ragged_tile(tile_table, i, H, GROUP, Sk, n_m, cu_q, cu_k):
    """VARLEN: loop index i -> (sequence, head, query block, the sequence's first Q row, its queries, its
    first K row, its keys). The heads come in groups whose K and V fit in L2 at Sk, the packed keys'
    total (L2_GROUP_KEYS: l2_group_mib's bytes in keys; whole GQA groups, at least one, as the
    rectangular balanced table's groups; the last group the heads left). Group g owns loop indices
    [g count heads, (g + 1) count heads): the table's entries (heaviest first, each sequence * n_m +
    query block) once per head of the group, the heads adjacent. So the tiles running side by side
    read a few heads' K/V from L2 instead of every head's from HBM. The total, not the longest
    sequence: a group's tiles run many sequences side by side (sized by the longest, packed batches
    ran 10% slower at 16 MiB than at 8). (Derived here from the kernel's parameters, not carried
    through the loop: a loop-carried value spilled hd256's consumers.)"""
    group_heads = gl.minimum(gl.maximum(L2_GROUP_KEYS // gl.maximum(Sk, 1), 1) * GROUP, H)
    per_group = gl.load(tile_table) * group_heads
    g = i // per_group
    r = i - g * per_group
    heads = gl.minimum(group_heads, H - g * group_heads)
    e = gl.load(tile_table + 1 + r // heads)
    b = e // n_m
    q0 = gl.load(cu_q + b)
    k0 = gl.load(cu_k + b)
    return b, g * group_heads + r % heads, e % n_m, q0, gl.load(cu_q + b + 1) - q0, k0, gl.load(cu_k + b + 1) - k0
