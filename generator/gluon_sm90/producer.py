"""The TMA producer: one warp (a warpgroup when it also transposes V, V_NATURAL) that loads Q, K and
V^T tiles into shared-memory rings for the consumer warpgroups, in the order they use them.
"""
# The config's constants (BLOCK_N, LEAN, ...) are defined only in the emitted module, by
# generator/gluon_sm90/emit.py:
# ruff: noqa: F821

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from .schedule import _block_range, _ragged_loop, _ragged_tile, _tile_at, _tile_coords, _tile_loop, _window_range

# ---- emitted below this line ----


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs,
              q_ready, q_empty, k_ready, k_empty, v_ready, v_empty,
              H, GROUP, Hkv, Sq, Sk, n_m, n_tiles, tile_table,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
              STAGES: gl.constexpr, Q_STAGES: gl.constexpr, CAUSAL: gl.constexpr, HEAVY_FIRST: gl.constexpr,
              HEAD_QK: gl.constexpr, QK_PARTS: gl.constexpr, v_raw, v_raw_ready, kb_desc, vb_desc, kb_bufs, vb_bufs,
              vc_desc, vc_bufs, cu_q, cu_k, win_l=None, win_r=None, page_table=None, page_stride=0, page_size=0):
    """One warp: TMA loads of Q (ring of Q_STAGES) and of K, V^T blocks (ring of STAGES, separate
    K and V barriers so that QK^T can start before V has landed). Q and K tiles come in QK_PARTS
    column parts of QK_W (tensor shapes must be powers of two: 192 = 3 x 64; a head dim not of 32s
    zero-padded to one, 80 -> 3 x 32: _qk_load), a 192-row Q tile (three consumers) in Q_BOXES = 3
    row boxes of 64.
    V_NATURAL: a warpgroup; V's (BLOCK_N, D) tiles are loaded into two raw slots and the producer
    writes their transposes into the V^T ring (_transpose_v) one block behind the loads: K(j) and
    V(j) are issued, then V^T(j-1) written while V(j) is in flight, so the consumers get K(j) and
    V^T(j-1) in the order they use them (QK^T(j) beside PV(j-1)).
    SPLIT (two key parts, BN_A + BN_B: 128 + 64, or 128 + 128 with pv_defer): K and V^T of a block
    come as one box per part each (kb_*, vb_*), on the same barriers. O_SPLIT: V^T's rows come as two
    boxes, O_W and O_C rows (vc_*), on the same barrier.
    VARLEN: packed sequences (one batch entry of their rows): each tile's loads start at its sequence's
    first Q / K row (and V^T column: the launcher's copy starts each sequence at a 32-key boundary, its
    column in the tile table after the n_tiles entries); key blocks past the sequence's keys are not
    visited (_block_range on its lengths).
    win_l, win_r (the window kernel only): the blocks of _window_range, the consumers' (same tile, same
    bounds), so that every stage loaded is one a consumer waits for.
    page_table, page_stride, page_size (the paged twin only): K and V rows come from a paged cache (_key_row);
    a block never straddles pages (page_size a multiple of BLOCK_N), so one page number serves its boxes. The
    slots past a sequence's keys in its last page hold whatever the cache held (NaN too): the consumers mask
    their scores, and the transpose writes zeros for their V (P = 0 times NaN would still be NaN)."""
    n_bh = n_tiles // n_m
    kv_it = 0
    q_it = 0
    if VARLEN:
        lo, hi, step = _ragged_loop(tile_table, H)
    else:
        lo, hi, step = _tile_loop(tile_table, n_tiles)
    for i in range(lo, hi, step):
        if VARLEN:
            b, h, mb, q_row, seq_q, k_row, seq_k = _ragged_tile(tile_table, i, H, GROUP, Sk, n_m, cu_q, cu_k)
        else:
            b, h, mb = _tile_coords(_tile_at(tile_table, i), n_bh, H, n_m, HEAVY_FIRST)
            seq_q = Sq
            seq_k = Sk
        hk = h // GROUP
        m0 = mb * BLOCK_M
        qs = q_it % Q_STAGES
        mbarrier.wait(q_empty.index(qs), ((q_it // Q_STAGES) & 1) ^ 1)
        mbarrier.expect(q_ready.index(qs), QK_PARTS * Q_BOXES * q_desc.block_type.nbytes)
        if not VARLEN:
            q_row = b * Sq
        for p in gl.static_range(QK_PARTS):
            if Q_BOXES == 1:
                _qk_load(q_desc, q_row + m0, h, p * QK_W, q_ready.index(qs), q_bufs.index(qs * QK_PARTS + p))
            else:  # 192 rows: TMA boxes are powers of two, so one 64-row box per consumer
                for r in gl.static_range(Q_BOXES):
                    _qk_load(q_desc, q_row + m0 + r * 64, h, p * QK_W, q_ready.index(qs),
                             q_bufs.index((qs * QK_PARTS + p) * Q_BOXES + r))
        q_it += 1
        if win_l is None:  # blocks [n_blocks - n_visit, n_blocks), from the top down
            n_blocks, n_masked = _block_range(m0, seq_q, seq_k, BLOCK_M, BLOCK_N, CAUSAL)
            n_visit = n_blocks
        else:
            n_blocks, n_masked, n_visit, n_open = _window_range(m0, seq_q, seq_k, win_l, win_r, BLOCK_M, BLOCK_N)
        if VARLEN:  # (V^T: one batch entry, the sequence from its column in the table)
            v_row = hk * HEAD_D
            v_key0 = 0 if V_NATURAL else gl.load(tile_table + 1 + n_tiles + b)
        else:
            k_row = b * Sk
            v_row = (b * Hkv + hk) * HEAD_D
            v_key0 = 0
        for j in range(n_visit):
            n0 = (n_blocks - 1 - j) * BLOCK_N
            s = kv_it % STAGES
            ph = ((kv_it // STAGES) & 1) ^ 1
            mbarrier.wait(k_empty.index(s), ph)
            if SPLIT:  # both key parts' boxes on one barrier
                mbarrier.expect(k_ready.index(s), QK_PARTS * (k_desc.block_type.nbytes + kb_desc.block_type.nbytes))
            else:
                mbarrier.expect(k_ready.index(s), QK_PARTS * k_desc.block_type.nbytes)
            for p in gl.static_range(QK_PARTS):
                _k_load(k_desc, _key_row(k_row, n0, b, page_table, page_stride, page_size), hk, p * QK_W,
                        k_ready.index(s), k_bufs.index(s * QK_PARTS + p))
                if SPLIT:
                    _k_load(kb_desc, _key_row(k_row, n0, b, page_table, page_stride, page_size) + BN_A, hk, p * QK_W,
                            k_ready.index(s), kb_bufs.index(s * QK_PARTS + p))
            if V_NATURAL:  # V(j) into raw slot j % 2 (its last reader, V^T(j-2), is written), then V^T(j-1)
                raw_slot = kv_it % 2
                mbarrier.expect(v_raw_ready.index(raw_slot), v_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(v_desc, [_key_row(k_row, n0, b, page_table, page_stride, page_size),
                                                         hk * HEAD_D], v_raw_ready.index(raw_slot), v_raw.index(raw_slot))
                if j > 0:
                    _transpose_v(v_raw, v_raw_ready, v_bufs, v_ready, v_empty, kv_it - 1, STAGES, BLOCK_N, O_W,
                                 page_table, seq_k - n0 - BLOCK_N)
            elif K_AHEAD:  # V(j-1) after K(j): K(j) does not wait for V(j-2)'s release (step j's QK^T)
                if j > 0:
                    _load_v(v_desc, vb_desc, v_bufs, vb_bufs, v_ready, v_empty, kv_it - 1, v_row, v_key0 + n0 + BLOCK_N,
                            STAGES, vc_desc, vc_bufs)
            else:
                _load_v(v_desc, vb_desc, v_bufs, vb_bufs, v_ready, v_empty, kv_it, v_row, v_key0 + n0, STAGES, vc_desc,
                        vc_bufs)
            kv_it += 1
        if n_visit > 0:
            if win_l is not None:  # V of the last block visited
                v_key0 += (n_blocks - n_visit) * BLOCK_N
            if V_NATURAL:
                _transpose_v(v_raw, v_raw_ready, v_bufs, v_ready, v_empty, kv_it - 1, STAGES, BLOCK_N, O_W,
                             page_table, seq_k - (n_blocks - n_visit) * BLOCK_N)
            elif K_AHEAD:
                _load_v(v_desc, vb_desc, v_bufs, vb_bufs, v_ready, v_empty, kv_it - 1, v_row, v_key0, STAGES, vc_desc,
                        vc_bufs)


@gluon.jit
def _key_row(k_row, n0, b, page_table, page_stride, page_size):
    """The K / V row of key n0 of the tile's sequence: k_row + n0, or in a paged cache (page_table given) row
    page_table[b, n0 // page_size] * page_size + n0 % page_size of the (pages * page_size, Hkv*D) view."""
    if page_table is None:
        return k_row + n0
    else:
        return gl.load(page_table + b * page_stride + n0 // page_size) * page_size + n0 % page_size


@gluon.jit
def _k_load(k_desc, row, head, col, bar, buf):
    """TMA load of K rows row.. (columns col.. of kv head `head`) into the K tile buf. K_PERM: as the
    5-D box of emit.k_box (row a multiple of 16: Sk % 16 == 0), which fills the 2-D tile with its rows
    relabelled as V_PERM wants (_key_of_column)."""
    if K_PERM:
        tma.async_copy_global_to_shared(k_desc, [row // 16, 0, 0, 0, head * HEAD_QK + col], bar,
                                        buf._reinterpret(buf.dtype, k_desc.block_type.shape, k_desc.layout))
    else:
        _qk_load(k_desc, row, head, col, bar, buf)


@gluon.jit
def _qk_load(desc, row, head, col, bar, buf):
    """TMA load of Q or K rows row.. (columns col.. of head `head`) into the tile buf. A head dim that is
    not a multiple of 32 (FP8 wgmma's reduction) is read through the (rows, heads, dims) view in
    QK_PARTS boxes of QK_W columns that run past it: TMA fills the columns past the head dim with
    zeros, which add nothing to the scores (the 3-D box fills the 2-D tile: the same swizzle, rows
    of QK_W); other head dims through the (rows, heads x dims) view."""
    if QK_PARTS * QK_W > HEAD_QK:
        tma.async_copy_global_to_shared(desc, [row, head, col], bar,
                                        buf._reinterpret(buf.dtype, desc.block_type.shape, desc.layout))
    else:
        tma.async_copy_global_to_shared(desc, [row, head * HEAD_QK + col], bar, buf)


@gluon.jit
def _load_v(v_desc, vb_desc, v_bufs, vb_bufs, v_ready, v_empty, it, v_row, n0, STAGES: gl.constexpr, vc_desc, vc_bufs):
    """TMA load of KV block `it`'s V^T (keys n0 ..) into its stage, once the stage's V is released."""
    s = it % STAGES
    mbarrier.wait(v_empty.index(s), ((it // STAGES) & 1) ^ 1)
    if SPLIT:
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes + vb_desc.block_type.nbytes)
    elif O_SPLIT:
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes + vc_desc.block_type.nbytes)
    else:
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(v_desc, [v_row, n0], v_ready.index(s), v_bufs.index(s))
    if SPLIT:
        tma.async_copy_global_to_shared(vb_desc, [v_row, n0 + BN_A], v_ready.index(s), vb_bufs.index(s))
    if O_SPLIT:  # the second O part's V^T rows
        tma.async_copy_global_to_shared(vc_desc, [v_row + O_W, n0], v_ready.index(s), vc_bufs.index(s))


@gluon.jit
def _transpose_v(v_raw, v_raw_ready, v_bufs, v_ready, v_empty, it, STAGES: gl.constexpr, BLOCK_N: gl.constexpr,
                 HEAD_D: gl.constexpr, page_table=None, keys=0):
    """V^T of KV block `it` (V_NATURAL): wait for its (BLOCK_N, D) tile in raw slot it % 2 and for its V^T
    stage to be free, then write the transpose in 32-key chunks. Each thread reads 4 keys x D/16
    dims (one vector per key row), so the transpose is a byte permute inside its registers and the
    writes are vectors along keys (LDS / PRMT / STS, no shuffles, no scratch). The warpgroup's
    writes are fenced for the async proxy (wgmma reads V^T) and joined before one arrive. page_table given (the
    paged twin): `keys` is the block's keys of its sequence, and the rows past them are written as zeros."""
    s = it % STAGES
    r = it % 2
    mbarrier.wait(v_raw_ready.index(r), (it // 2) & 1)
    mbarrier.wait(v_empty.index(s), ((it // STAGES) & 1) ^ 1)
    rows: gl.constexpr = gl.BlockedLayout([4, HEAD_D // 16], [8, 4], [1, 4], [1, 0])  # (keys, dims)
    vt = v_bufs.index(s)
    raw = v_raw.index(r)
    for c in gl.static_range(BLOCK_N // 32):
        x = raw.slice(c * 32, 32, dim=0).load(rows)
        if page_table is not None:
            if keys < (c + 1) * 32:  # (a chunk on the key end: stale slots past it become zeros)
                keep = gl.arange(0, 32, layout=gl.SliceLayout(1, rows)) < keys - c * 32
                x = gl.where(gl.expand_dims(keep, 1), x, gl.zeros_like(x))
        vt.slice(c * 32, 32, dim=1).store(x.permute((1, 0)))
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(v_ready.index(s), count=1)
