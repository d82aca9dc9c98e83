"""The consumer's step bodies: the overlapped step (QK^T(j) beside PV(j-1)), the first block of the
overlapped schedule, the plain step (QK^T; softmax; PV), the half-block steps for a first block whose
upper half no row sees, and the epilogue's chunked output store.
"""
# The config's constants (BLOCK_N, LEAN, ...) are defined only in the emitted module, by
# generator/gluon_sm90/emit.py:
# ruff: noqa: F821

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from .common import _mark, _marked
from .mma import _pv_done, _pv_issue, _qk_issue, _qk_result, _qk_waited
from .p_carry import _p_operand, _p_stage, _p_stage_lower, _p_tile, _prev_p_ready, _pv_prologue, _rescale
from .smem import _keys
from .softmax import _lane_sums, _masked, _softmax
from .turns import _turn_pass, _turn_wait

# ---- emitted below this line ----


@gluon.jit
def _ov_step(j, n_blocks, kv_it, turn_it, pP, acc, alpha, m_i, l_i, q_bufs, qb, k_bufs, v_bufs, s_zero,
             k_ready, k_empty, v_ready, v_empty, turn_bars, qk_scale, row0, Sk, off,
             MASK: gl.constexpr, CID: gl.constexpr, NUM_CONSUMERS: gl.constexpr,
             PINGPONG: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr,
             qk_layout: gl.constexpr, p_layout: gl.constexpr, row_o: gl.constexpr, V_PERM: gl.constexpr,
             P_OFFSET: gl.constexpr, EX2_FENCE: gl.constexpr, LEAN: gl.constexpr, ones_smem, l_zero,
             QK_PARTS: gl.constexpr, pPb, kb_bufs, vb_bufs, sb_zero, onesb_smem, qkb_layout: gl.constexpr,
             p_smem, accc, vc_bufs, row_oc: gl.constexpr, win_lo=None, win_hi=None):
    """Overlapped step j >= 1: issue QK^T(j) and PV(j-1) back to back, wait for QK^T(j) only, run
    softmax(j) while PV(j-1) is on the tensor cores, then wait for PV(j-1). What keeps ptxas from
    undoing the overlap: nothing in flight across the loop back-edge (else every wgmma of the kernel
    is serialised, C7514); O rescaled at the start of the next step and V(j-1) released one step
    later (an instruction right after the PV wait pulls the wait above the exponentials); P carried
    as float32 (see _p_operand). Even so ptxas hoists the PV wait above part of the exponentials;
    EX2_FENCE puts a barrier on the row sums right before the wait (generator/asm/fence.py). ROWSUM_MMA: the
    rounded row sum of P(j-1) is one more wgmma (against ones) issued with PV(j-1), so l is
    rescaled and summed exactly when O is. SPLIT: two key parts, so twice the wgmmas of each kind
    (pPb carries the second part's P). P_SMEM: P(j-1) is read from the warpgroup's P tile (pP and
    pPb are stand-ins), P(j) written there once PV(j-1) is done, and V(j-1) released then; P_DOUBLE
    (two tiles, one key part): QK^T(j) is issued first, P(j-1)'s tile published and O rescaled while it
    runs, PV(j-1) issued behind it, and P(j) stored into the other tile before the PV(j-1) wait. PV_DEFER
    (overlap off): both products are waited for before the softmax and V(j-1) is released in this
    step; with two key parts PV(j-1) is issued first and QK^T(j)'s second part only once PV(j-1) is
    done (below). O_SPLIT: O's second part (accc) goes with O everywhere. win_lo, win_hi: the window kernel's
    bounds (softmax.py _masked)."""
    _mark(kv_it, EV_START, CID)
    st = kv_it % STAGES
    pst = (kv_it + STAGES - 1) % STAGES
    if P_DOUBLE:
        # QK^T(j) first; P(j-1)'s tile is published (proxy fence, warpgroup barrier) and O rescaled while
        # it runs, then PV(j-1) issued behind it
        if F16_S and not QK_ASYNC:  # QK^T(j) is synchronous (_qk_issue): publish and rescale first, PV(j-1)
            # issued right behind it (QK_ASYNC: ptx_pass drops that wait, so they go under QK^T as below)
            p8, acc, l_i, accc = _prev_p_ready(p_smem, kv_it, CID, acc, l_i, alpha, row_o, accc, row_oc)
        mbarrier.wait(k_ready.index(st), (kv_it // STAGES) & 1)
        _turn_wait(turn_bars, turn_it, CID, PINGPONG)
        _mark(kv_it, EV_READY, CID)
        s_tok = _qk_issue(q_bufs, qb, k_bufs, st * QK_PARTS, s_zero, CID, QK_PARTS)
        sb_tok = s_tok
        _mark(kv_it, EV_QK_ISSUED, CID)
        if QK_ASYNC or not F16_S:
            p8, acc, l_i, accc = _prev_p_ready(p_smem, kv_it, CID, acc, l_i, alpha, row_o, accc, row_oc)
        mbarrier.wait(v_ready.index(pst), ((kv_it - 1) // STAGES) & 1)
        o_tok, r_tok, oc_tok = _pv_issue(p8, v_bufs.index(pst), acc, ones_smem, l_zero, p8, vb_bufs.index(pst),
                                         onesb_smem, accc, vc_bufs.index(pst))
    else:
        p8, p8b, acc, l_i, accc = _pv_prologue(pP, pPb, acc, l_i, alpha, row_o, V_PERM, LEAN, p_layout, p_smem, accc,
                                               row_oc)
        mbarrier.wait(k_ready.index(st), (kv_it // STAGES) & 1)
        mbarrier.wait(v_ready.index(pst), ((kv_it - 1) // STAGES) & 1)
        _turn_wait(turn_bars, turn_it, CID, PINGPONG)
        _mark(kv_it, EV_READY, CID)
        if PV_DEFER and SPLIT:
            # PV(j-1), then QK^T(j)'s first key part; once PV(j-1) is done (the P registers it reads are
            # free) the second part, so that the scores of a 256-key block never share the registers
            # with the P in flight (128 + 32 + 64 would spill, 64 + 32 + 64 and 128 + 64 do not)
            o_tok, r_tok, oc_tok = _pv_issue(p8, v_bufs.index(pst), acc, ones_smem, l_zero, p8b, vb_bufs.index(pst),
                                             onesb_smem, accc, vc_bufs.index(pst))
            s_tok = _qk_issue(q_bufs, qb, k_bufs, st * QK_PARTS, s_zero, CID, QK_PARTS)
            _mark(kv_it, EV_QK_ISSUED, CID)
            acc, l_i, accc = _pv_done(o_tok, r_tok, l_i, gl.SliceLayout(1, qk_layout), oc_tok, accc, QK_PARTS)
            sb_tok = _qk_issue(q_bufs, qb, kb_bufs, st * QK_PARTS, sb_zero, CID, QK_PARTS)
        else:
            s_tok = _qk_issue(q_bufs, qb, k_bufs, st * QK_PARTS, s_zero, CID, QK_PARTS)
            sb_tok = _qk_issue(q_bufs, qb, kb_bufs, st * QK_PARTS, sb_zero, CID, QK_PARTS) if SPLIT else s_tok
            _mark(kv_it, EV_QK_ISSUED, CID)
            o_tok, r_tok, oc_tok = _pv_issue(p8, v_bufs.index(pst), acc, ones_smem, l_zero, p8b, vb_bufs.index(pst),
                                             onesb_smem, accc, vc_bufs.index(pst))
    _turn_pass(turn_bars, CID, NUM_CONSUMERS, PINGPONG)
    _mark(kv_it, EV_ISSUED, CID)
    # QK^T(j) done; PV(j-1) may still run, unless PV_DEFER (the plain step with PV(j-1) paired: both
    # products done before the softmax, V(j-1) released at once)
    s, sb = _qk_result(s_tok, sb_tok, not PV_DEFER)
    _mark(kv_it, EV_QK_DONE, CID)
    mbarrier.arrive(k_empty.index(st), count=1)
    if PV_DEFER:
        if not SPLIT:  # retired already: no wait
            acc, l_i, accc = _pv_done(o_tok, r_tok, l_i, gl.SliceLayout(1, qk_layout), oc_tok, accc)
        mbarrier.arrive(v_empty.index(pst), count=1)
    elif not P_SMEM:  # PV(j-2) retired at the end of the previous step: release its V stage now
        mbarrier.arrive(v_empty.index((kv_it + STAGES - 2) % STAGES), count=1, pred=j >= 2)
    pP, m_i, l_i, alpha, pPb = _softmax(s, m_i, l_i, qk_scale, (n_blocks - 1 - j) * BLOCK_N, row0, Sk, off,
                                        MASK, CAUSAL, BLOCK_N, qk_layout, p_layout, V_PERM, P_OFFSET, LEAN,
                                        sb, qkb_layout, kv_it, win_lo, win_hi)
    l_i = _marked(l_i, kv_it, EV_SOFTMAX_DONE, CID)
    if P_DOUBLE:  # the other tile (PV(j-2), its last reader, is done): stored before the PV(j-1) wait
        _p_stage(pP, _p_tile(p_smem, kv_it, CID))
    if EX2_FENCE:
        # a barrier that needs every exponential of step j (the row sums, or the OR of all the
        # probabilities; generator/asm/fence.py), right before the PV wait, which ptxas keeps after it
        if ROWSUM_MMA:
            pP = gl.inline_asm_elementwise(P_FENCE_A_ASM[CID], P_FENCE_A_CONSTRAINTS, [pP], dtype=gl.float32,
                                           is_pure=False, pack=BN_A // 2)
            if SPLIT:
                pPb = gl.inline_asm_elementwise(P_FENCE_B_ASM[CID], P_FENCE_B_CONSTRAINTS, [pPb], dtype=gl.float32,
                                                is_pure=False, pack=BN_B // 2)
        else:
            l_i = gl.inline_asm_elementwise(ROW_SUM_FENCE_ASM[CID], ROW_SUM_FENCE_CONSTRAINTS, [l_i], dtype=gl.float32,
                                            is_pure=False, pack=2)
    if not PV_DEFER:
        acc, l_i, accc = _pv_done(o_tok, r_tok, l_i, gl.SliceLayout(1, qk_layout), oc_tok, accc)  # PV(j-1) done
        _mark(kv_it, EV_PV_DONE, CID)
        if LATE_RESCALE:
            acc, l_i, accc = _rescale(acc, l_i, alpha, row_o, accc, row_oc)
    if P_SMEM:  # the P tile is free: P(j) goes there for the next step's PV; V(j-1) is released
        if not P_DOUBLE:
            _p_stage(pP, p_smem)
        mbarrier.arrive(v_empty.index(pst), count=1)
        pP = alpha
        pPb = alpha
    return pP, acc, alpha, m_i, l_i, pPb, accc


@gluon.jit
def _first_softmax(s, sb, n_blocks, kv_it, m_i, l_i, qk_scale, row0, Sk, off, p_smem, CID: gl.constexpr,
                   CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr, p_layout: gl.constexpr,
                   row_s: gl.constexpr, V_PERM: gl.constexpr, P_OFFSET: gl.constexpr, LEAN: gl.constexpr,
                   qkb_layout: gl.constexpr, HALF: gl.constexpr, win_lo=None, win_hi=None):
    """The overlapped schedule's first block (visit 0, masked) after its QK^T: softmax, and under P_SMEM
    P staged in its tile (pP then a stand-in). HALF (HALF_BLOCK, 0 otherwise): on the block's lower
    HALF keys only (their scores are half of each thread's registers), P's upper keys staged as zeros,
    so the pipeline after it, whose PV reads whole tiles, is the same. win_lo, win_hi: the window kernel's
    bounds (softmax.py _masked). Returns (pP, m_i, l_i, alpha, pPb)."""
    n0 = (n_blocks - 1) * BLOCK_N
    if HALF > 0:
        s = _lower_keys(_masked(s, n0, row0, Sk, off, CAUSAL, s_layout, win_lo, win_hi))
        h_layout: gl.constexpr = s.type.layout
        pP, m_h, l_h, a_h, pPb = _softmax(s, gl.convert_layout(m_i, gl.SliceLayout(1, h_layout)),
                                          _half_sums(l_i, s), qk_scale, n0, row0, Sk, off, False, CAUSAL,
                                          HALF, h_layout, p_layout, V_PERM, P_OFFSET, LEAN, s, qkb_layout, kv_it)
        m_i = gl.convert_layout(m_h, row_s)
        l_i = gl.convert_layout(l_h, l_i.type.layout)
        alpha = gl.convert_layout(a_h, row_s)
    else:
        pP, m_i, l_i, alpha, pPb = _softmax(s, m_i, l_i, qk_scale, n0, row0, Sk, off, True, CAUSAL, BLOCK_N,
                                            s_layout, p_layout, V_PERM, P_OFFSET, LEAN, sb, qkb_layout, kv_it,
                                            win_lo, win_hi)
    if P_SMEM:
        if O_IN_P:  # the tile may still be read by the previous tile's output store
            tma.store_wait(0)
        tile = _p_tile(p_smem, kv_it, CID) if P_DOUBLE else p_smem
        if HALF > 0:
            _p_stage_lower(pP, tile)
        else:
            _p_stage(pP, tile)
        pP = alpha
        pPb = alpha
    return pP, m_i, l_i, alpha, pPb


@gluon.jit
def _column_halves(x):
    """The (64, W / 2) left and right halves of a (64, W) wgmma accumulator (or its bf16 rounding): a thread
    holds columns 8c + 2q + b, so each half is half of its registers (no data movement)."""
    return gl.split(x.reshape([64, 2, x.shape[1] // 2]).permute((0, 2, 1)))


@gluon.jit
def _o_chunk_store(x, K: gl.constexpr, o_bufs, o_desc, b, row0, col0, CID: gl.constexpr):
    """O_THROUGH_P: output chunk K (columns [K O_CHUNK, (K + 1) O_CHUNK) of the warpgroup's 64 rows) into
    its P tile K % 2 and a TMA store from there; chunk K >= 2 first waits for the store of chunk K - 2,
    which read the same tile. The tile's last PV is done (O is final), and the next tile's first P store
    waits for these stores (O_IN_P)."""
    if K >= 2:
        tma.store_wait(1)
    tile = o_bufs.index((K % 2) * NUM_CONSUMERS + CID)
    tile.store(x)
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [b, row0, col0 + K * O_CHUNK], tile.reshape([1, 64, O_CHUNK]))


@gluon.jit
def _o_rows_store(x, o_ptr, row, rows, col0, stride, WIDTH: gl.constexpr):
    """VARLEN: a warpgroup's (64, W) bf16 output tile x whose rows cross its sequence's end: the first `rows`
    rows (the sequence's; from packed row `row`) and columns below WIDTH (columns col0.. of rows `stride`
    apart), stored by pointer straight from the accumulator's registers. A TMA box would write the rows past
    the end, the next sequence's (only the end of the whole tensor clips a box)."""
    layout: gl.constexpr = x.type.layout
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
    c = gl.arange(0, x.shape[1], layout=gl.SliceLayout(0, layout))
    ptrs = o_ptr + (row + r)[:, None] * stride + (col0 + c)[None, :]
    gl.store(ptrs, x, mask=(r < rows)[:, None] & (c < WIDTH)[None, :])


@gluon.jit
def _lse_store(m_i, l_o, lse_ptr, base, rows, P_OFFSET: gl.constexpr):
    """LSE: a warpgroup's 64 rows' natural-log sums of exp(scores), the first `rows` of them (the
    sequence's) from float32 word `base` (int32: kernels/gluon_launch.lse_pointer keeps the LSE below 2^31
    words; an int64 base, held through the tile loop, spilled lean P kernels). l sums 2^(s scale - (m -
    P_OFFSET)) in log2 units, m the kernel's reference (the row maximum, or lean P's grid point at or
    above it), so log2 of the sum of exp(scores) is m - P_OFFSET + log2(l) (lean P's codes are not
    corrected: the Triton kernels' LSE neither). A row that saw no key (l = 0) gets -inf, as there."""
    layout: gl.constexpr = m_i.type.layout
    l = gl.convert_layout(l_o, layout)
    lse = gl.where(l > 0.0, (m_i - P_OFFSET + gl.log2(l)) * 0.6931471805599453, float("-inf"))
    r = gl.arange(0, 64, layout=layout)
    gl.store(lse_ptr + base + r, lse, mask=r < rows)


@gluon.jit
def _lower_keys(s):
    """The scores of a block's lower half of keys, from the whole block's (64, N) accumulator: a thread
    holds keys 8c + 2q + b, so the lower half (c < N / 16) is half of each thread's registers."""
    lo, hi = gl.split(s.reshape([64, 2, s.shape[1] // 2]).permute((0, 2, 1)))
    return lo


@gluon.jit
def _upper_half_unseen(n_blocks, row0, Sq, Sk, BLOCK_N: gl.constexpr):
    """HALF_BLOCK (causal): whether keys [top + BLOCK_N / 2, top + BLOCK_N) of the first block visited
    (top = its first key) lie past the key end or past the diagonal of every row of the warpgroup
    whose first row is row0 (rows are bottom-right aligned: row r sees keys <= r + Sk - Sq)."""
    hi = gl.minimum(Sk, gl.maximum(gl.minimum(row0 + 64, Sq) + Sk - Sq, 0))
    return (n_blocks > 0) & (hi <= (n_blocks - 1) * BLOCK_N + BLOCK_N // 2)


@gluon.jit
def _plain_step(j, n_blocks, n_masked, kv_it, turn_it, acc, m_i, l_i, accc, q_bufs, qb, k_bufs, v_bufs, vc_bufs,
                kb_bufs, vb_bufs, k_ready, k_empty, v_ready, v_empty, turn_bars, qk_scale, row0, Sk, off,
                ones_smem, onesb_smem, l_zero, CID: gl.constexpr, NUM_CONSUMERS: gl.constexpr,
                PINGPONG: gl.constexpr, STAGES: gl.constexpr, QK_PARTS: gl.constexpr, CAUSAL: gl.constexpr,
                BLOCK_N: gl.constexpr, p_layout: gl.constexpr, row_o: gl.constexpr, row_oc: gl.constexpr,
                row_s: gl.constexpr, V_PERM: gl.constexpr, P_OFFSET: gl.constexpr, qkb_layout: gl.constexpr,
                s_zero, sb_zero, HALF: gl.constexpr, n_open=None, win_lo=None, win_hi=None):
    """One step of the plain schedule on the K/V block in stage kv_it % STAGES (visit j of n_blocks,
    masked when j < n_masked): S = QK^T; wait; softmax; O += PV; wait; both stages released.
    HALF (HALF_BLOCK, 0 otherwise): only the block's first HALF keys, a masked step on the lower
    halves of the K and V^T tiles, for a block whose upper half no row sees (s_zero: S's shape and
    layout, HALF keys wide then; sb_zero: the second key part's under SPLIT, never halved).
    n_open, win_lo, win_hi (the window kernel): visits j >= n_open cross the window's left edge, masked too.
    Returns (acc, m_i, l_i, accc)."""
    _mark(kv_it, EV_START, CID)
    s_st = kv_it % STAGES
    s_ph = (kv_it // STAGES) & 1
    s_layout: gl.constexpr = s_zero.type.layout
    s, sb = _qk_waited(q_bufs, qb, k_bufs, k_ready, k_empty, turn_bars, s_zero, kv_it, turn_it,
                       CID, NUM_CONSUMERS, PINGPONG, STAGES, QK_PARTS, kb_bufs, sb_zero, HALF)
    n0 = (n_blocks - 1 - j) * BLOCK_N
    if n_open is None:
        masked = j < n_masked
    else:
        masked = (j < n_masked) | (j >= n_open)
    if HALF > 0:
        p8, m_h, l_h, alpha, p8b = _softmax(s, gl.convert_layout(m_i, gl.SliceLayout(1, s_layout)),
                                            _half_sums(l_i, s_zero), qk_scale, n0, row0, Sk, off, True, CAUSAL,
                                            HALF, s_layout, p_layout, V_PERM, P_OFFSET, False, sb, qkb_layout,
                                            kv_it, win_lo, win_hi)
        m_i = gl.convert_layout(m_h, row_s)
        l_i = gl.convert_layout(l_h, l_i.type.layout)
        alpha = gl.convert_layout(alpha, row_s)
    elif masked:
        p8, m_i, l_i, alpha, p8b = _softmax(s, m_i, l_i, qk_scale, n0, row0, Sk, off, True, CAUSAL,
                                            BLOCK_N, s_layout, p_layout, V_PERM, P_OFFSET, False,
                                            sb, qkb_layout, kv_it, win_lo, win_hi)
    else:
        p8, m_i, l_i, alpha, p8b = _softmax(s, m_i, l_i, qk_scale, n0, row0, Sk, off, False, CAUSAL,
                                            BLOCK_N, s_layout, p_layout, V_PERM, P_OFFSET, False,
                                            sb, qkb_layout, kv_it)
    l_i = _marked(l_i, kv_it, EV_SOFTMAX_DONE, CID)
    acc, l_i, accc = _rescale(acc, l_i, alpha, row_o, accc, row_oc)
    mbarrier.wait(v_ready.index(s_st), s_ph)
    _turn_wait(turn_bars, turn_it + 1, CID, PINGPONG)
    ones_h = _keys(ones_smem, HALF, 1) if ROWSUM_MMA else ones_smem  # (None without a row-sum MMA)
    o_tok, r_tok, oc_tok = _pv_issue(_p_operand(p8, V_PERM, False, p_layout), _keys(v_bufs.index(s_st), HALF, 1),
                                     acc, ones_h, l_zero, _p_operand(p8b, V_PERM, False, p_layout),
                                     vb_bufs.index(s_st), onesb_smem, accc, _keys(vc_bufs.index(s_st), HALF, 1))
    _turn_pass(turn_bars, CID, NUM_CONSUMERS, PINGPONG)
    _mark(kv_it, EV_PV_ISSUED, CID)
    acc, l_i, accc = _pv_done(o_tok, r_tok, l_i, row_s, oc_tok, accc)
    _mark(kv_it, EV_PV_DONE, CID)
    mbarrier.arrive(v_empty.index(s_st), count=1)
    return acc, m_i, l_i, accc


@gluon.jit
def _half_sums(l_i, s_zero):
    """l in the layout a HALF step's softmax keeps it in (s_zero: its scores' shape and layout): per
    row, or LANE_SUMS's (64, 4) per lane; the same registers either way (a thread's keys of a row are
    summed inside it), so the conversion moves nothing."""
    if LANE_SUMS:
        return gl.convert_layout(l_i, _lane_sums(s_zero).type.layout)
    else:
        return gl.convert_layout(l_i, gl.SliceLayout(1, s_zero.type.layout))
