"""Online softmax of one score block: the exact variant (2^x by the MUFU or a polynomial), lean P
(one FMA per score whose result holds the e4m3 code, no exponential), lean P on f16 scores (two
scores per instruction), and the row sums (per row, per lane, or from lean P's packed codes).
"""
# The config's constants (BLOCK_N, LEAN, ...) are defined only in the emitted module, by
# generator/gluon_sm90/emit.py:
# ruff: noqa: F821

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared

from .common import _marked
from .mma import _q_rows
from .p_carry import _carried

# ---- emitted below this line ----


@gluon.jit
def _softmax(s, m_i, l_i, qk_scale, n0, row0, Sk, off,
             MASK: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr,
             qk_layout: gl.constexpr, p_layout: gl.constexpr, V_PERM: gl.constexpr, P_OFFSET: gl.constexpr,
             LEAN: gl.constexpr, sb, qkb_layout: gl.constexpr, kv_it=0, win_lo=None, win_hi=None):
    """Online softmax of one 64 x BLOCK_N score block. Probabilities are scaled by 2^P_OFFSET so
    that small ones stay out of e4m3 subnormals; l carries the same factor, which cancels.
    LEAN (lean P): no exponential here; one FMA per score leaves what _p_operand turns into e4m3
    codes (LEAN_ASM: generator/asm/lean.lean_tail_asm); the rounded row sum comes from an MMA with PV
    (ROWSUM_MMA), or CODE_SUMS from the packed codes, decoded here (_code_sums). ROWSUM_MMA: l is not
    summed here; the row sum of the probabilities as rounded to e4m3 comes from the MMA against ones
    (_pv_issue).
    SPLIT (two key parts): s holds keys [n0, n0 + BN_A) and sb keys [n0 + BN_A, n0 + BN_A + BN_B): one
    row maximum and one row sum over both, two P operands (the last result, p8b; else p8 again).
    kv_it: the step, for the timeline's row-maximum stamp (TRACE only). win_lo, win_hi: the window (_masked)."""
    if MASK:
        s = _masked(s, n0, row0, Sk, off, CAUSAL, qk_layout, win_lo, win_hi)
        if SPLIT:
            sb = _masked(sb, n0 + BN_A, row0, Sk, off, CAUSAL, qkb_layout, win_lo, win_hi)
    if SPLIT:
        row_max = gl.maximum(gl.max(s, axis=1), gl.convert_layout(gl.max(sb, axis=1), gl.SliceLayout(1, qk_layout)))
        m_new = gl.maximum(m_i, row_max * qk_scale)
    else:  # (F16_S: f16 scores, and qk_scale per row, _q_headroom's 2^e)
        m_new = gl.maximum(m_i, gl.max(s, axis=1).to(gl.float32) * qk_scale)
    if LEAN and LEAN_GRID:  # b = magic + 56 - (8 ref + LEAN_CENTER) must be exact in fp32: ref on its grid
        if LEAN_CENTER != 0.0:  # grid index n: ref = (n - LEAN_CENTER) / 8 - P_OFFSET, so 8 ref + LEAN_CENTER = n - 8 P
            grid_n = gl.ceil(m_new * 8.0 + LEAN_CENTER)
            m_new = grid_n * 0.125 - LEAN_CENTER * 0.125
        else:
            m_new = gl.ceil(m_new * 8.0) * 0.125
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    m_use = _marked(m_use, kv_it, EV_MAX_DONE, (row0 // 64) % NUM_CONSUMERS)  # (TRACE only)
    alpha = gl.exp2(m_i - m_use)
    if LEAN and F16_S:  # (clamp "sat"; qk_scale per row)
        p = _f16_fold(s, qk_scale, m_use)
        l_new = l_i
    elif LEAN:
        ref = m_use - P_OFFSET
        ones = gl.full(s.shape, 1.0, gl.float32, layout=qk_layout)
        if LEAN_FMA:   # y = 8 (s scale - ref) + magic + 56: the code is in y's low bits
            if LEAN_CENTER != 0.0:  # "centered": the line lowered by LEAN_CENTER codes (asm/lean.py); b straight
                # from the grid index, as "fma"'s from ceil(8 m): one rounding and one add after the row maximum
                # (through m_use, ptxas scheduled both rows' maxima before any fold, 12% slower)
                n_use = gl.where(grid_n == float("-inf"), LEAN_CENTER, grid_n)  # m_use = 0 for an empty row
                if LEAN_SAT:     # clamp "sat": a and b divided by LEAN_SAT_SCALE, no magic (one exact FMA)
                    b_row = gl.fma(n_use, -1.0 / LEAN_SAT_SCALE, (56.0 + 8.0 * P_OFFSET) / LEAN_SAT_SCALE)
                else:
                    b_row = (LEAN_MAGIC + 56.0 + 8.0 * P_OFFSET) - n_use
            elif LEAN_SAT:
                b_row = gl.fma(ref, -8.0 / LEAN_SAT_SCALE, 56.0 / LEAN_SAT_SCALE)
            else:
                b_row = (LEAN_MAGIC + 56.0) - 8.0 * ref
            a_mul: gl.constexpr = 8.0 / LEAN_SAT_SCALE if LEAN_SAT else 8.0
            a, b = gl.broadcast(ones * (qk_scale * a_mul), b_row[:, None])
        else:                    # x = s scale - ref; _p_operand finishes the fold
            a, b = gl.broadcast(ones * qk_scale, -ref[:, None])
        if LEAN_FMA and LEAN_SAT:  # clamp "sat": the FMA saturates (FFMA.SAT), LEAN_ASM adds the magic
            p = gl.inline_asm_elementwise("fma.rn.sat.f32 $0, $1, $2, $3;", "=f,f,f,f", [s, a, b], dtype=gl.float32,
                                          is_pure=True, pack=1)
        else:
            p = gl.fma(s, a, b)  # one rounding: under LEAN_FMA, y's low bits are exactly round(8x) + 56
        l_new = l_i
    else:
        p = _exp2(s * qk_scale - (m_use - P_OFFSET)[:, None])
        if SPLIT:
            pb = _exp2(sb * qk_scale - gl.convert_layout(m_use - P_OFFSET, gl.SliceLayout(1, qkb_layout))[:, None])
        if ROWSUM_MMA:
            l_new = l_i
        elif SPLIT:
            l_new = l_i * alpha + gl.sum(p, axis=1) + gl.convert_layout(gl.sum(pb, axis=1),
                                                                        gl.SliceLayout(1, qk_layout))
        elif LANE_SUMS:
            l_new = _lane_update(l_i, alpha, _lane_sums(p))
        else:
            l_new = l_i * alpha + gl.sum(p, axis=1)
    if V_PERM:
        p8 = _carried(p, p_layout, LEAN)
        p8b = _carried(pb, p_layout) if SPLIT else p8
    else:
        p8 = gl.convert_layout(p.to(gl.float8e4nv), p_layout)
        if SPLIT:
            p8b = gl.convert_layout(pb.to(gl.float8e4nv), p_layout)
        else:
            p8b = p8
    if LEAN and CODE_SUMS:
        l_new = _with_code_sums(l_i, alpha, p8)
    return p8, m_new, l_new, alpha, p8b


@gluon.jit
def _f16_fold(s, qk_scale, m_use):
    """Lean P's fold on f16 scores (qk_acc="f16", clamp "sat"), two scores per instruction: t = sat(s a + b)
    (HFMA2.SAT, a and b per row in f16), then y = 128 t + 1024, whose low byte is the e4m3 code (f16 integers
    are exact on [1024, 2048)): t = (8 (x + P) + 56 - center) / 128 for x = s qk_scale - m_use, a = qk_scale /
    16, b = t_top - m_use / 16. a's f16 rounding scales the row's x by (1 + <2^-11): harmless along the row,
    but at the maximum it moves t by up to |m_use| 2^-15, and b's own rounding by up to |b| 2^-11, both of
    several codes on rows with logits of hundreds (0x7f, e4m3's NaN, at p_scale_log2 = 8). Their
    bound, 2^-11 + |b| 2^-10, keeps the maximum's code at or below 125: b is lowered by it (one-FMA folds),
    or (corrected) only by what of it passes code 125, so that a row's maximum keeps its exact code but on
    rows with logits of hundreds. The shift, common to the row, is cancelled by the normalisation. (Holding
    a16 / qk_scale per row to compensate a exactly cost 4%: ptxas then serialised the two rows' maxima;
    cvt.rm would be an F2F each, a slower pipe than F2FP's one for both rows.) docs/design.md."""
    a_mul: gl.constexpr = 8.0 / LEAN_SAT_SCALE
    F16_STEP: gl.constexpr = 0.00048828125  # 2^-11: half an f16 step of v is at most |v| 2^-11
    t_top: gl.constexpr = (56.0 + 8.0 * P_OFFSET - LEAN_CENTER) / LEAN_SAT_SCALE
    a16 = (qk_scale * a_mul).to(gl.float16)
    if F16_U:  # the reversed line u = 1 - t = s (-a) + (1 - b) (f16_fold_asm): 1 - b, raised only where the
        # bound would pass code 125, so that the maximum stays on its code (FA3's error; lowered always: 1.015x)
        room: gl.constexpr = (125.0 - 56.0 - 8.0 * P_OFFSET) / LEAN_SAT_SCALE - F16_STEP
        a16 = -a16
        v = gl.fma(m_use, a_mul, 1.0 - t_top)
        v = gl.maximum(v, gl.fma(gl.abs(v), 2.0 * F16_STEP, gl.fma(m_use, a_mul, 1.0 - t_top - room)))
    else:  # lowered always: the one-FMA folds' own rounding outweighs the shift, and the capped form above
        # made ptxas serialise the two rows' maxima here (a step estimate of 1025 cycles against 859)
        v = gl.fma(m_use, -a_mul, t_top - F16_STEP)
        v = gl.fma(gl.abs(v), -2.0 * F16_STEP, v)
    b16 = v.to(gl.float16)  # (one F2FP for both rows; cvt.rm / cvt.rp would be an F2F per row)
    a, _ = gl.broadcast(a16[:, None], s)
    b, _ = gl.broadcast(b16[:, None], s)
    args = [s, a, b]
    if LEAN_FLOOR:  # the subnormal codes' line: t2 = (slope (x + P - at) + 8 - center) / 128, unsaturated
        k2: gl.constexpr = (LEAN_FLOOR_SLOPE * (P_OFFSET - LEAN_FLOOR_AT) + 8.0 - LEAN_CENTER) / LEAN_SAT_SCALE
        a3, _ = gl.broadcast((qk_scale * (LEAN_FLOOR_SLOPE / LEAN_SAT_SCALE)).to(gl.float16)[:, None], s)
        b3, _ = gl.broadcast(gl.fma(m_use, -LEAN_FLOOR_SLOPE / LEAN_SAT_SCALE, k2).to(gl.float16)[:, None], s)
        args = args + [a3, b3]
    if LEAN_MUFU:  # a share of the pairs by the MUFU on the line e = x + P - 8 (f16_mufu_asm; the linear fold's
        if F16_U:  # from its own line t', e = 16 t' + k); the corrected fold's line unsaturated: e = 1 - 16 u
            a2, _ = gl.broadcast((a16.to(gl.float32) * -16.0).to(gl.float16)[:, None], s)
            b2, _ = gl.broadcast(gl.fma(b16.to(gl.float32), -16.0, F16_MUFU_TOP).to(gl.float16)[:, None], s)
            args = args + [a2, b2]
        return gl.inline_asm_elementwise(F16_MUFU_ASM, F16_MUFU_CONSTRAINTS, args, dtype=gl.float16,
                                         is_pure=True, pack=8)
    if LEAN_FLOOR:
        return gl.inline_asm_elementwise(F16_FOLD_ASM, "=r,r,r,r,r,r", args, dtype=gl.float16, is_pure=True, pack=2)
    return gl.inline_asm_elementwise(F16_FOLD_ASM, "=r,r,r,r", args, dtype=gl.float16, is_pure=True, pack=2)


@gluon.jit
def _q_headroom(q_bufs, qb, CID: gl.constexpr, row_s: gl.constexpr):
    """qk_acc="f16": this warpgroup's Q rows scaled by 2^-e in shared memory, e >= 0 per row the least that
    keeps every f16 score and partial sum within 2^15 for any e4m3 K (|q . k| <= 448 sum|q|): a power of
    two, exact unless a value falls to a subnormal. Returns 2^e per row (row_s) for the softmax scale.
    Call after the tile's Q has landed and before its first wgmma."""
    layout: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
    l1 = gl.zeros([64], gl.float32, layout=gl.SliceLayout(1, layout))
    for p in gl.static_range(QK_PARTS):
        x = _q_rows(q_bufs, qb + p, CID).load(layout).to(gl.float32)
        l1 += gl.sum(gl.abs(x), axis=1)
    e = gl.maximum(gl.ceil(gl.log2(l1 * Q_HEADROOM)), 0.0)   # l1 = 0: log2 is -inf, e = 0
    f = gl.exp2(-e)
    for p in gl.static_range(QK_PARTS):
        rows = _q_rows(q_bufs, qb + p, CID)
        x = rows.load(layout).to(gl.float32)
        rows.store((x * f[:, None]).to(gl.float8e4nv))
    fence_async_shared()
    gl.thread_barrier()
    return gl.convert_layout(gl.exp2(e), row_s)


@gluon.jit
def _with_code_sums(l_i, alpha, w):
    """CODE_SUMS: l * alpha plus the sums of the probabilities that lean P's packed codes w (64 x keys / 4
    words, as _p_pack lays them out) encode, per lane (LANE_SUMS: l is (64, 4)) or per row."""
    r = _code_sums(w)
    if LANE_SUMS:
        return _lane_update(l_i, alpha, r)
    else:
        return l_i * alpha + gl.convert_layout(gl.sum(r, axis=1), l_i.type.layout)


@gluon.jit
def _lane_update(l_i, alpha, r):
    """LANE_SUMS: the (64, 4) per-lane sums l rescaled by their rows' alpha, plus this step's r."""
    r = gl.convert_layout(r, l_i.type.layout)
    return l_i * gl.convert_layout(alpha, gl.SliceLayout(1, l_i.type.layout))[:, None] + r


@gluon.jit
def _code_sums(w):
    """(64, 4): each lane's sum of the probabilities its words of a row encode. Per 32-key chunk c a
    thread holds words 8c + 4h + q of its rows (h = 0, 1; q its lane in the quad), so four words of one
    row (two chunks, both h) go into each CODE_SUM_ASM without leaving the thread."""
    NC: gl.constexpr = w.shape[1] // 8
    x = w.reshape([64, NC // 2, 2, 2, 4]).permute((0, 4, 1, 2, 3))   # [row, q, chunk pair, chunk, h]
    x0, x1 = gl.split(x)
    x00, x01 = gl.split(x0)
    x10, x11 = gl.split(x1)
    s = gl.inline_asm_elementwise(CODE_SUM_ASM, CODE_SUM_CONSTRAINTS, [x00, x01, x10, x11], dtype=gl.float32,
                                  is_pure=True, pack=1)
    return gl.sum(s, axis=2)


@gluon.jit
def _lane_sums(p):
    """LANE_SUMS: each thread's sum of its probabilities of each of its rows, one per lane of the four
    that share a row: (64, 4), no shuffles. The wgmma accumulator gives a thread keys 8c + 2q + b of
    its rows (q: its lane in the quad), so the sums over b and c stay in the thread."""
    return gl.sum(gl.sum(p.reshape([64, p.shape[1] // 8, 4, 2]), axis=3), axis=1)


@gluon.jit
def _key_of_column(c):
    """The key (from the block's first) in score column c: c, or under K_PERM (the relabelling made on K's
    tile rows, _k_load) key 16h + 4q + 2s + b in column 16h + 8s + 2q + b."""
    if K_PERM:
        return (c & -16) | (((c >> 1) & 3) << 2) | (((c >> 3) & 1) << 1) | (c & 1)
    else:
        return c


@gluon.jit
def _masked(s, n0, row0, Sk, off, CAUSAL: gl.constexpr, layout: gl.constexpr, win_lo=None, win_hi=None):
    """s (64 rows x its keys from n0) with keys past Sk, and past each row's diagonal if CAUSAL, at -inf.
    win_lo, win_hi (the window kernel; None compiles none of it): row r keeps keys r + win_lo .. r + win_hi
    below Sk alone (off - WIN_L and off + WIN_R: a causal window's right edge is the diagonal)."""
    cols = n0 + _key_of_column(gl.arange(0, s.shape[1], layout=gl.SliceLayout(0, layout)))
    rows = row0 + gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
    if win_lo is not None:
        keep = (cols[None, :] < Sk) & (cols[None, :] <= rows[:, None] + win_hi)
        keep = keep & (cols[None, :] >= rows[:, None] + win_lo)
    elif CAUSAL and P_SMEM:
        # a row before the queries' end sees no key at or past Sk (row + off < Sq + off = Sk), so the causal
        # compare alone masks both; rows past the end see finite scores and are not stored. (Here only:
        # ptxas spills 8 bytes in several register-P kernels without the key-end compare, and the P_SMEM
        # kernels' masked steps with a half first block spill with it: its i1 masks packed into words.)
        keep = cols[None, :] <= rows[:, None] + off
    else:
        keep = cols[None, :] < Sk
        if CAUSAL:
            keep = keep & (cols[None, :] <= rows[:, None] + off)
    return gl.where(keep, s, float("-inf"))


@gluon.jit
def _exp2(x):
    """2^x of the scores: MUFU.EX2, or for EXP2_POLY of every 8 a polynomial on the FMA pipe
    (generator/asm/exp2_poly.py), so that the two pipes share the exponentials."""
    if EXP2_POLY > 0:
        return gl.inline_asm_elementwise(EXP2_ASM, EXP2_CONSTRAINTS, [x], dtype=gl.float32, is_pure=True, pack=8)
    else:
        return gl.exp2(x)
