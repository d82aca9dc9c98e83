"""The consumer's wgmmas: S = Q K^T over the column parts of Q and K, O += P V (with the row-sum
wgmma against ones and O's second part where the config has them), and their waits.
"""
# The config's constants (BLOCK_N, LEAN, ...) are defined only in the emitted module, by
# generator/gluon_sm90/emit.py:
# ruff: noqa: F821

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from .common import _mark
from .smem import _keys
from .turns import _turn_pass, _turn_wait

# ---- emitted below this line ----


@gluon.jit
def _q_rows(q_bufs, slot, CID: gl.constexpr):
    """This warpgroup's 64 rows of the Q column part in `slot`: a slice of the tile, or with 192-row
    tiles (Q_BOXES = 3 boxes of 64 rows per part) its own box."""
    if Q_BOXES == 1:
        return q_bufs.index(slot).slice(CID * 64, 64, dim=0)
    else:
        return q_bufs.index(slot * Q_BOXES + CID)


@gluon.jit
def _pass_blocks(kv_it, n_blocks, k_ready, k_empty, v_ready, v_empty, STAGES: gl.constexpr):
    """A consumer whose rows all lie past the queries' end releases each of its tile's n_blocks K and
    V stages once loaded (every stage waits for all NUM_CONSUMERS releases; arriving before the load
    would count toward the stage's previous use) and computes nothing. Returns the next kv_it."""
    for j in range(n_blocks):
        st = kv_it % STAGES
        ph = (kv_it // STAGES) & 1
        mbarrier.wait(k_ready.index(st), ph)
        mbarrier.arrive(k_empty.index(st), count=1)
        mbarrier.wait(v_ready.index(st), ph)
        mbarrier.arrive(v_empty.index(st), count=1)
        kv_it += 1
    return kv_it


@gluon.jit
def _qk_issue(q_bufs, qb, k_bufs, kb, s_zero, CID: gl.constexpr, QK_PARTS: gl.constexpr, HALF: gl.constexpr = 0):
    """S = Q K^T as QK_PARTS chained async wgmmas over the column parts (slots qb.., kb..); returns
    the token of the last (each wgmma is its own commit group, so waiting for it waits for all).
    HALF > 0: the first HALF keys (rows) of the K tile only.
    F16_S: the last wgmma is synchronous (done on return). Triton hands an f16 accumulator to the wait as
    16-bit halves, split before the wait: ptxas then serialises every wgmma of the kernel; a synchronous
    wgmma splits them after its own wait."""
    s_tok = warpgroup_mma(_q_rows(q_bufs, qb, CID), _keys(k_bufs.index(kb), HALF, 0).permute((1, 0)), s_zero,
                          use_acc=False, is_async=not (F16_S and QK_PARTS == 1))
    for p in gl.static_range(1, QK_PARTS):
        s_tok = warpgroup_mma(_q_rows(q_bufs, qb + p, CID), _keys(k_bufs.index(kb + p), HALF, 0).permute((1, 0)),
                              s_tok, is_async=not (F16_S and p == QK_PARTS - 1))
    return s_tok


@gluon.jit
def _qk_waited(q_bufs, qb, k_bufs, k_ready, k_empty, turn_bars, s_zero, kv_it, turn_it, CID: gl.constexpr,
               NUM_CONSUMERS: gl.constexpr, PINGPONG: gl.constexpr, STAGES: gl.constexpr, QK_PARTS: gl.constexpr,
               kb_bufs, sb_zero, HALF: gl.constexpr = 0):
    """S = Q K^T for the K block in stage kv_it % STAGES (HALF > 0: its first HALF keys), issued in
    this warpgroup's turn and waited for; that K stage is released. Returns (S, S of the second key
    part under SPLIT, else S)."""
    st = kv_it % STAGES
    mbarrier.wait(k_ready.index(st), (kv_it // STAGES) & 1)
    _turn_wait(turn_bars, turn_it, CID, PINGPONG)
    _mark(kv_it, EV_READY, CID)
    s_tok = _qk_issue(q_bufs, qb, k_bufs, st * QK_PARTS, s_zero, CID, QK_PARTS, HALF)
    sb_tok = _qk_issue(q_bufs, qb, kb_bufs, st * QK_PARTS, sb_zero, CID, QK_PARTS) if SPLIT else s_tok
    _mark(kv_it, EV_QK_ISSUED, CID)
    _turn_pass(turn_bars, CID, NUM_CONSUMERS, PINGPONG)
    _mark(kv_it, EV_ISSUED, CID)
    s, sb = _qk_result(s_tok, sb_tok, False)
    _mark(kv_it, EV_QK_DONE, CID)
    mbarrier.arrive(k_empty.index(st), count=1)
    return s, sb


@gluon.jit
def _qk_result(s_tok, sb_tok, PV_IN_FLIGHT: gl.constexpr):
    """S = Q K^T once its wgmmas are done (and the second key part's S under SPLIT, else S again);
    with PV_IN_FLIGHT the PV wgmmas issued after it (and their row sums) may still run."""
    if SPLIT:
        s, sb = warpgroup_mma_wait(PV_GROUPS if PV_IN_FLIGHT else 0, deps=(s_tok, sb_tok))
    else:
        s = warpgroup_mma_wait(PV_GROUPS if PV_IN_FLIGHT else 0, deps=(s_tok,))
        sb = s
    return s, sb


@gluon.jit
def _pv_issue(p8, v_smem, acc, ones_smem, l_zero, p8b, vb_smem, onesb_smem, accc, vc_smem):
    """O += P V as an async wgmma; under ROWSUM_MMA also the rounded row sum: P against the ones
    tile (fresh accumulator each time: FP8 wgmma accumulation is too coarse for a running sum).
    It replaces one FADD per score (the exact softmax's sum) by one m64n8k32 wgmma per 32 keys.
    SPLIT: the second key part's P (p8b) chained onto each (PV and row sum: two wgmmas each).
    O_SPLIT: O's second part (accc, V^T rows vc_smem) its own wgmma. PV_GROUPS counts them all.
    Returns the tokens (O, O's second part or O again, row sum or O again)."""
    o_tok = warpgroup_mma(p8, v_smem.permute((1, 0)), acc, is_async=True)
    if SPLIT:
        o_tok = warpgroup_mma(p8b, vb_smem.permute((1, 0)), o_tok, is_async=True)
    if O_SPLIT:
        oc_tok = warpgroup_mma(p8, vc_smem.permute((1, 0)), accc, is_async=True)
    else:
        oc_tok = o_tok
    if ROWSUM_MMA:
        r_tok = warpgroup_mma(p8, ones_smem.permute((1, 0)), l_zero, use_acc=False, is_async=True)
        if SPLIT:
            r_tok = warpgroup_mma(p8b, onesb_smem.permute((1, 0)), r_tok, is_async=True)
    else:
        r_tok = o_tok  # a stand-in _pv_done ignores (a None in a returned tuple does not compile)
    return o_tok, r_tok, oc_tok


@gluon.jit
def _pv_done(o_tok, r_tok, l_i, row_s: gl.constexpr, oc_tok, accc, LATER: gl.constexpr = 0):
    """Wait for _pv_issue's wgmmas (LATER: wgmmas issued after them may still run); under ROWSUM_MMA
    add the row sum (all 8 columns hold it) to l. Returns (acc, l_i, accc: O's second part under
    O_SPLIT, else accc as given)."""
    if O_SPLIT:
        if ROWSUM_MMA:
            acc, accc, rs = warpgroup_mma_wait(LATER, deps=(o_tok, oc_tok, r_tok))
            l_i = l_i + gl.convert_layout(gl.max(rs, axis=1), row_s)
        else:
            acc, accc = warpgroup_mma_wait(LATER, deps=(o_tok, oc_tok))
    elif ROWSUM_MMA:
        acc, rs = warpgroup_mma_wait(LATER, deps=(o_tok, r_tok))
        l_i = l_i + gl.convert_layout(gl.max(rs, axis=1), row_s)
    else:
        acc = warpgroup_mma_wait(LATER, deps=(o_tok,))
    return acc, l_i, accc
