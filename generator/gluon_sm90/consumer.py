"""A consumer warpgroup: its layouts and buffers, the tile loop (overlapped or plain schedule over
the key blocks of each tile) and the epilogue (O / l, bf16, TMA store).
"""
# The config's constants (BLOCK_N, LEAN, ...) are defined only in the emitted module, by
# generator/gluon_sm90/emit.py:
# ruff: noqa: F821

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from .mma import _pass_blocks, _pv_done, _pv_issue, _qk_waited
from .p_carry import _p_tile, _pv_prologue
from .schedule import _block_range, _ragged_loop, _ragged_tile, _tile_at, _tile_coords, _tile_loop, _window_range
from .smem import _ones
from .softmax import _lane_sums, _q_headroom
from .steps import (_column_halves, _first_softmax, _lse_store, _o_chunk_store, _o_rows_store, _ov_step,
                    _plain_step, _upper_half_unseen)
from .turns import _turn_pass, _turn_wait, _turns_start

# ---- emitted below this line ----


@gluon.jit
def _consumer(CID: gl.constexpr, o_desc, oc_desc, q_bufs, k_bufs, v_bufs, vc_bufs, o_bufs, oc_bufs,
              q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turn_bars,
              QD, KD, VD, ds0, ds1, scale_log2,
              H, GROUP, Sq, Sk, n_m, n_tiles, tile_table,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
              STAGES: gl.constexpr, Q_STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr,
              CAUSAL: gl.constexpr, HEAVY_FIRST: gl.constexpr,
              OVERLAP: gl.constexpr, PINGPONG: gl.constexpr, V_PERM: gl.constexpr, P_OFFSET: gl.constexpr,
              EX2_FENCE: gl.constexpr, LEAN: gl.constexpr, ones_bufs, QK_PARTS: gl.constexpr,
              kb_bufs, vb_bufs, onesb_bufs, p_bufs, cu_q, cu_k, o_ptr, lse_ptr=None, lse_stride=0,
              win_l=None, win_r=None):
    """Consumer warpgroup CID: rows [64 CID, 64 CID + 64) of every tile it visits. Key blocks from
    the diagonal downwards; only the first n_masked (diagonal / key end) pay for the mask.
    VARLEN: each tile's rows and keys are its sequence's (lengths, causal offset, descales of sequence b);
    rows past the sequence's end are computed but never stored: a warpgroup whose 64 rows cross the end
    stores its rows by pointer (_o_rows_store), the others by TMA at the sequence's rows.
    lse_ptr (the LSE kernel only; None compiles no LSE code): each stored row's log-sum-exp at word
    (batch * H + head) * lse_stride + row (VARLEN: batch 0, the packed row), beside O's store.
    win_l, win_r (the window kernel only; None compiles none of it): each row's keys from win_l before to
    win_r after its diagonal; the tile visits only the blocks inside its rows' windows (_window_range), the
    ones crossing the left edge (the last visited) masked as well."""
    qk_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BN_A, 32])
    # SPLIT: the second key part's scores (otherwise an unused twin of qk_layout)
    qkb_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BN_B if SPLIT else BN_A, 32])
    # HALF_BLOCK: the scores of a step on half a block
    qkh_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BN_A // 2, 32])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, O_W, 32])
    # O_SPLIT: O's second part (else an unused stand-in O_C columns wide)
    oc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, O_C, 32])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    row_oc: gl.constexpr = gl.SliceLayout(1, oc_layout)
    row_s: gl.constexpr = gl.SliceLayout(1, qk_layout)

    o_smem = o_bufs.index(CID)
    oc_smem = oc_bufs.index(CID)
    if P_DOUBLE:  # two tiles per warpgroup, indexed by _p_tile
        p_smem = p_bufs
    elif P_SMEM:  # P's way from one step's softmax to the next step's PV wgmma (the A operand's tile)
        p_smem = p_bufs.index(CID)
    else:
        p_smem = None
    if ROWSUM_MMA:  # B operand of the row-sum wgmma: this warpgroup's (8, BLOCK_N) tile of e4m3 ones
        ones_smem = _ones(ones_bufs.index(CID), BN_A)
        onesb_smem = _ones(onesb_bufs.index(CID), BN_B) if SPLIT else ones_smem
        fence_async_shared()
        gl.thread_barrier()
        l_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, 8, 32])
        l_zero = gl.zeros([64, 8], gl.float32, layout=l_layout)
    else:
        ones_smem = None
        onesb_smem = None
        l_zero = None
    n_bh = n_tiles // n_m
    off = Sk - Sq
    kv_it = 0
    q_it = 0
    turn_it = 0
    _turns_start(CID, NUM_CONSUMERS, PINGPONG)
    if VARLEN:
        lo, hi, step = _ragged_loop(tile_table, H)
    else:
        lo, hi, step = _tile_loop(tile_table, n_tiles)
    for i in range(lo, hi, step):
        if VARLEN:
            b, h, mb, q_row, seq_q, k_row, seq_k = _ragged_tile(tile_table, i, H, GROUP, Sk, n_m, cu_q, cu_k)
            off = seq_k - seq_q
        else:
            b, h, mb = _tile_coords(_tile_at(tile_table, i), n_bh, H, n_m, HEAVY_FIRST)
            seq_q = Sq
            seq_k = Sk
        hk = h // GROUP
        m0 = mb * BLOCK_M
        row0 = m0 + CID * 64
        if VARLEN:  # TMA stores: one batch entry of packed rows
            o_b = 0
            o_row = q_row + row0
        else:
            o_b = b
            o_row = row0
        if QD is None:  # no descales: a compile-time constant, nothing to load
            qk_scale = scale_log2
            v_scale = 1.0
        else:
            dsc = b * ds0 + hk * ds1
            qk_scale = scale_log2 * gl.load(QD + dsc) * gl.load(KD + dsc)
            v_scale = gl.load(VD + dsc)
        if win_l is None:  # n_blocks: the top block + 1; n_visit blocks from it down, unmasked from n_masked
            n_blocks, n_masked = _block_range(m0, seq_q, seq_k, BLOCK_M, BLOCK_N, CAUSAL)
            n_visit = n_blocks
            n_open = n_blocks
            win_lo = None
            win_hi = None
        else:  # ... to n_open; row r keeps keys r + win_lo .. r + win_hi (off itself is then dead: one register)
            n_blocks, n_masked, n_visit, n_open = _window_range(m0, seq_q, seq_k, win_l, win_r, BLOCK_M, BLOCK_N)
            win_lo = off - win_l
            win_hi = off + win_r

        qs = q_it % Q_STAGES
        mbarrier.wait(q_ready.index(qs), (q_it // Q_STAGES) & 1)
        qb = qs * QK_PARTS  # this tile's Q: slots qb .. qb + QK_PARTS - 1
        if F16_S:  # scores accumulate in f16: Q's rows scaled into range, the scale per row
            qk_scale = qk_scale * _q_headroom(q_bufs, qb, CID, row_s)

        m_i = gl.full([64], float("-inf"), gl.float32, layout=row_s)
        if LANE_SUMS:  # (64, 4) partial sums, laid out as _lane_sums makes them
            l_i = _lane_sums(gl.zeros([64, BN_A], gl.float32, layout=qk_layout))
        else:
            l_i = gl.full([64], 0.0, gl.float32, layout=row_s)
        acc = gl.zeros([64, O_W], gl.float32, layout=o_layout)
        accc = gl.zeros([64, O_C], gl.float32, layout=oc_layout)
        s_zero = gl.zeros([64, BN_A], gl.float16 if F16_S else gl.float32, layout=qk_layout)
        sb_zero = gl.zeros([64, BN_B], gl.float32, layout=qkb_layout) if SPLIT else s_zero

        # rows past the queries' end (a partial last query block, e.g. 4096 = 21 x 192 + 64): no work but
        # passing the tile's K/V stages on; with ping-pong the turns need every consumer's wgmmas
        skip = (row0 >= seq_q) & (not PINGPONG)
        if skip:
            kv_it = _pass_blocks(kv_it, n_visit, k_ready, k_empty, v_ready, v_empty, STAGES)
        elif n_visit > 0:
            if OVERLAP or PV_DEFER:  # (PV_DEFER: the overlapped step's issue order, softmax after both waits)
                # ---- block 0 (the diagonal / tail block whenever any block is masked); HALF_BLOCK (overlapped:
                # P in shared memory, half_block_conflict): its softmax on the lower half when no row sees the
                # upper one (the whole block's QK^T either way: one wgmma turn, and a half-width accumulator
                # in a second copy of the block makes ptxas spill in the step loops)
                s, sb = _qk_waited(q_bufs, qb, k_bufs, k_ready, k_empty, turn_bars, s_zero, kv_it, turn_it,
                                   CID, NUM_CONSUMERS, PINGPONG, STAGES, QK_PARTS, kb_bufs, sb_zero)
                if HALF_BLOCK and CAUSAL:
                    if _upper_half_unseen(n_blocks, row0, seq_q, seq_k, BLOCK_N):
                        pP, m_i, l_i, alpha, pPb = _first_softmax(
                            s, sb, n_blocks, kv_it, m_i, l_i, qk_scale, row0, seq_k, off, p_smem, CID, CAUSAL,
                            BLOCK_N, qk_layout, p_layout, row_s, V_PERM, P_OFFSET, LEAN, qkb_layout, BLOCK_N // 2,
                            win_lo, win_hi)
                    else:
                        pP, m_i, l_i, alpha, pPb = _first_softmax(
                            s, sb, n_blocks, kv_it, m_i, l_i, qk_scale, row0, seq_k, off, p_smem, CID, CAUSAL,
                            BLOCK_N, qk_layout, p_layout, row_s, V_PERM, P_OFFSET, LEAN, qkb_layout, 0,
                            win_lo, win_hi)
                else:
                    pP, m_i, l_i, alpha, pPb = _first_softmax(
                        s, sb, n_blocks, kv_it, m_i, l_i, qk_scale, row0, seq_k, off, p_smem, CID, CAUSAL,
                        BLOCK_N, qk_layout, p_layout, row_s, V_PERM, P_OFFSET, LEAN, qkb_layout, 0, win_lo, win_hi)
                turn_it += 1
                kv_it += 1
                # ---- masked blocks (phase 0), then unmasked blocks (phase 1), then (window) those crossing
                # its left edge (phase 2): a loop each, MASK constant in each
                PHASES: gl.constexpr = 2 if win_l is None else 3
                for phase in gl.static_range(PHASES):
                    lo = 1 if phase == 0 else gl.maximum(n_masked, 1) if phase == 1 else gl.maximum(n_open, 1)
                    hi = n_masked if phase == 0 else n_open if phase == 1 else n_visit
                    for j in range(lo, hi):
                        pP, acc, alpha, m_i, l_i, pPb, accc = _ov_step(
                            j, n_blocks, kv_it, turn_it, pP, acc, alpha, m_i, l_i, q_bufs, qb, k_bufs, v_bufs, s_zero,
                            k_ready, k_empty, v_ready, v_empty, turn_bars, qk_scale, row0, seq_k, off,
                            phase != 1, CID, NUM_CONSUMERS, PINGPONG, STAGES, CAUSAL, BLOCK_N,
                            qk_layout, p_layout, row_o, V_PERM, P_OFFSET, EX2_FENCE, LEAN, ones_smem, l_zero,
                            QK_PARTS, pPb, kb_bufs, vb_bufs, sb_zero, onesb_smem, qkb_layout, p_smem, accc, vc_bufs,
                            row_oc, win_lo, win_hi)
                        turn_it += 1
                        kv_it += 1
                # ---- PV of the last block
                pst = (kv_it + STAGES - 1) % STAGES
                p8, p8b, acc, l_i, accc = _pv_prologue(pP, pPb, acc, l_i, alpha, row_o, V_PERM, LEAN, p_layout,
                                                       _p_tile(p_smem, kv_it - 1, CID) if P_DOUBLE else p_smem,
                                                       accc, row_oc)
                mbarrier.wait(v_ready.index(pst), ((kv_it - 1) // STAGES) & 1)
                _turn_wait(turn_bars, turn_it, CID, PINGPONG)
                o_tok, r_tok, oc_tok = _pv_issue(p8, v_bufs.index(pst), acc, ones_smem, l_zero, p8b, vb_bufs.index(pst),
                                                 onesb_smem, accc, vc_bufs.index(pst))
                _turn_pass(turn_bars, CID, NUM_CONSUMERS, PINGPONG)
                turn_it += 1
                acc, l_i, accc = _pv_done(o_tok, r_tok, l_i, row_s, oc_tok, accc)
                if not (PV_DEFER or P_SMEM):  # (they released each V stage in its own step)
                    mbarrier.arrive(v_empty.index((kv_it + STAGES - 2) % STAGES), count=1, pred=n_visit >= 2)
                mbarrier.arrive(v_empty.index(pst), count=1)
            else:
                # ---- plain schedule: S = QK^T; wait; softmax; O += PV; wait
                j0 = 0
                # a causal tile's first block whose upper half no row of this warpgroup sees: BLOCK_N / 2 keys
                # (not compiled into the non-causal kernel: there only a key end could leave half a block
                # empty, and the second step body costs it 16 bytes of spills)
                if HALF_BLOCK and CAUSAL:
                    if _upper_half_unseen(n_blocks, row0, seq_q, seq_k, BLOCK_N):
                        acc, m_i, l_i, accc = _plain_step(
                            0, n_blocks, 1, kv_it, turn_it, acc, m_i, l_i, accc, q_bufs, qb, k_bufs, v_bufs, vc_bufs,
                            kb_bufs, vb_bufs, k_ready, k_empty, v_ready, v_empty, turn_bars, qk_scale, row0, seq_k,
                            off, ones_smem, onesb_smem, l_zero, CID, NUM_CONSUMERS, PINGPONG, STAGES, QK_PARTS,
                            CAUSAL, BLOCK_N, p_layout, row_o, row_oc, row_s, V_PERM, P_OFFSET, qkb_layout,
                            gl.zeros([64, BLOCK_N // 2], gl.float32, layout=qkh_layout), sb_zero, BLOCK_N // 2,
                            None if win_l is None else n_open, win_lo, win_hi)
                        turn_it += 2
                        kv_it += 1
                        j0 = 1
                for j in range(j0, n_visit):
                    acc, m_i, l_i, accc = _plain_step(
                        j, n_blocks, n_masked, kv_it, turn_it, acc, m_i, l_i, accc, q_bufs, qb, k_bufs, v_bufs,
                        vc_bufs, kb_bufs, vb_bufs, k_ready, k_empty, v_ready, v_empty, turn_bars, qk_scale, row0, seq_k,
                        off, ones_smem, onesb_smem, l_zero, CID, NUM_CONSUMERS, PINGPONG, STAGES, QK_PARTS,
                        CAUSAL, BLOCK_N, p_layout, row_o, row_oc, row_s, V_PERM, P_OFFSET, qkb_layout,
                        s_zero, sb_zero, 0, None if win_l is None else n_open, win_lo, win_hi)
                    turn_it += 2
                    kv_it += 1
        # Q of this tile is no longer read by this warpgroup
        mbarrier.arrive(q_empty.index(qs), count=1)
        q_it += 1

        if not skip:
            # ---- epilogue: O / l * v_descale -> bf16 -> smem -> TMA store (3-D: clipped per batch)
            if LANE_SUMS:  # the four lanes of each row add their sums once per tile
                l_o = gl.convert_layout(gl.sum(l_i, axis=1), row_o)
            else:
                l_o = gl.convert_layout(l_i, row_o)
            if lse_ptr is not None:
                _lse_store(m_i, l_o, lse_ptr, (o_b * H + h) * lse_stride + o_row, seq_q - row0, P_OFFSET)
            inv = gl.where(l_o > 0.0, v_scale / l_o, 0.0)
            o = (acc * inv[:, None]).to(gl.bfloat16)
            if VARLEN:  # 64 rows crossing the sequence's end: only its rows, by pointer stores
                edge = row0 + 64 > seq_q
            else:  # (a constant: the branch below is not compiled)
                edge: gl.constexpr = False
            if edge:
                _o_rows_store(o, o_ptr, o_row, seq_q - row0, h * HEAD_D, H * HEAD_D, HEAD_D)
                if O_SPLIT:
                    _o_rows_store((accc * gl.convert_layout(inv, row_oc)[:, None]).to(gl.bfloat16), o_ptr, o_row,
                                  seq_q - row0, h * HEAD_D + O_W, H * HEAD_D, O_C)
            else:
                tma.store_wait(0)
                if O_CHUNKS > 1:  # o_through_p: chunks through the two P tiles (O_CHUNKS 2 or 4)
                    o_left, o_right = _column_halves(o)
                    if O_CHUNKS == 2:
                        _o_chunk_store(o_left, 0, o_bufs, o_desc, o_b, o_row, h * HEAD_D, CID)
                        _o_chunk_store(o_right, 1, o_bufs, o_desc, o_b, o_row, h * HEAD_D, CID)
                    else:
                        o_0, o_1 = _column_halves(o_left)
                        o_2, o_3 = _column_halves(o_right)
                        _o_chunk_store(o_0, 0, o_bufs, o_desc, o_b, o_row, h * HEAD_D, CID)
                        _o_chunk_store(o_1, 1, o_bufs, o_desc, o_b, o_row, h * HEAD_D, CID)
                        _o_chunk_store(o_2, 2, o_bufs, o_desc, o_b, o_row, h * HEAD_D, CID)
                        _o_chunk_store(o_3, 3, o_bufs, o_desc, o_b, o_row, h * HEAD_D, CID)
                else:
                    o_smem.store(o)
                    if O_SPLIT:
                        oc_smem.store((accc * gl.convert_layout(inv, row_oc)[:, None]).to(gl.bfloat16))
                    fence_async_shared()
                    if O_W <= HEAD_D:  # O's first (or only) O_W columns
                        tma.async_copy_shared_to_global(o_desc, [o_b, o_row, h * HEAD_D], o_smem.reshape([1, 64, O_W]))
                    else:  # (B, Sq, H, D) view: the box's columns past D (the padding of O_W) are clipped
                        tma.async_copy_shared_to_global(o_desc, [o_b, o_row, h, 0], o_smem.reshape([1, 64, 1, O_W]))
                    if O_SPLIT:
                        tma.async_copy_shared_to_global(oc_desc, [o_b, o_row, h * HEAD_D + O_W],
                                                        oc_smem.reshape([1, 64, O_C]))
    tma.store_wait(0)
