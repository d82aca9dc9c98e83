"""Device code of the Gluon backend: copied verbatim (below the marker) into every emitted Gluon
kernel module, after which generator/gluon_sm90/emit.py appends the config's constants and the entry
kernel. Kept as a real module so that it is linted and read like code; it is never launched from
here. The schedule and why each piece is shaped as it is: docs/BACKENDS.md.

Roles (warp specialisation): the entry kernel's default partition is consumer warpgroup 0; the
worker partitions are consumer warpgroups 1 and 2 (two or three consumers) and the TMA producer (one
warp; a warpgroup when it also transposes V, V_NATURAL). A consumer warpgroup owns 64 query rows of
the CTA's tile and issues m64 x BLOCK_N x 32 FP8 wgmmas (QGMMA); a 192-key block (SPLIT) is a
128-key and a 64-key part, each its own wgmmas (a 256-key pv_defer block: two 128-key parts).

Module constants (written by emit_gluon for each config) choose among the variants; every branch on
them is resolved at compile time, so a kernel contains only its own schedule.
"""

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
    """TRACE only (generator/timeline.py): CTA 0 stores the SM clock for consumer warpgroup CID,
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
def _producer(q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs,
              q_ready, q_empty, k_ready, k_empty, v_ready, v_empty,
              H, GROUP, Hkv, Sq, Sk, n_m, n_tiles, tile_table,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
              STAGES: gl.constexpr, Q_STAGES: gl.constexpr, CAUSAL: gl.constexpr, HEAVY_FIRST: gl.constexpr,
              HEAD_QK: gl.constexpr, QK_PARTS: gl.constexpr, v_raw, v_raw_ready, kb_desc, vb_desc, kb_bufs, vb_bufs,
              vc_desc, vc_bufs):
    """One warp: TMA loads of Q (ring of Q_STAGES) and of K, V^T blocks (ring of STAGES, separate
    K and V barriers so that QK^T can start before V has landed). Q and K tiles come in QK_PARTS
    column parts of HEAD_QK / QK_PARTS (tensor shapes must be powers of two: 192 = 3 x 64), a
    192-row Q tile (three consumers) in Q_BOXES = 3 row boxes of 64.
    V_NATURAL: a warpgroup; V's (BLOCK_N, D) tiles are loaded into two raw slots and the producer
    writes their transposes into the V^T ring (_transpose_v) one block behind the loads: K(j) and
    V(j) are issued, then V^T(j-1) written while V(j) is in flight, so the consumers get K(j) and
    V^T(j-1) in the order they use them (QK^T(j) beside PV(j-1)).
    SPLIT (two key parts, BN_A + BN_B: 128 + 64, or 128 + 128 with pv_defer): K and V^T of a block
    come as one box per part each (kb_*, vb_*), on the same barriers. O_SPLIT: V^T's rows come as two
    boxes, O_W and O_C rows (vc_*), on the same barrier."""
    n_bh = n_tiles // n_m
    kv_it = 0
    q_it = 0
    lo, hi, step = _tile_loop(tile_table, n_tiles)
    for i in range(lo, hi, step):
        b, h, mb = _tile_coords(_tile_at(tile_table, i), n_bh, H, n_m, HEAVY_FIRST)
        hk = h // GROUP
        m0 = mb * BLOCK_M
        qs = q_it % Q_STAGES
        mbarrier.wait(q_empty.index(qs), ((q_it // Q_STAGES) & 1) ^ 1)
        mbarrier.expect(q_ready.index(qs), QK_PARTS * Q_BOXES * q_desc.block_type.nbytes)
        for p in gl.static_range(QK_PARTS):
            if Q_BOXES == 1:
                tma.async_copy_global_to_shared(q_desc, [b * Sq + m0, h * HEAD_QK + p * (HEAD_QK // QK_PARTS)],
                                                q_ready.index(qs), q_bufs.index(qs * QK_PARTS + p))
            else:  # 192 rows: TMA boxes are powers of two, so one 64-row box per consumer
                for r in gl.static_range(Q_BOXES):
                    tma.async_copy_global_to_shared(
                        q_desc, [b * Sq + m0 + r * 64, h * HEAD_QK + p * (HEAD_QK // QK_PARTS)],
                        q_ready.index(qs), q_bufs.index((qs * QK_PARTS + p) * Q_BOXES + r))
        q_it += 1
        n_blocks, n_masked = _block_range(m0, Sq, Sk, BLOCK_M, BLOCK_N, CAUSAL)
        k_row = b * Sk
        v_row = (b * Hkv + hk) * HEAD_D
        for j in range(n_blocks):
            n0 = (n_blocks - 1 - j) * BLOCK_N
            s = kv_it % STAGES
            ph = ((kv_it // STAGES) & 1) ^ 1
            mbarrier.wait(k_empty.index(s), ph)
            if SPLIT:  # both key parts' boxes on one barrier
                mbarrier.expect(k_ready.index(s), QK_PARTS * (k_desc.block_type.nbytes + kb_desc.block_type.nbytes))
            else:
                mbarrier.expect(k_ready.index(s), QK_PARTS * k_desc.block_type.nbytes)
            for p in gl.static_range(QK_PARTS):
                col = hk * HEAD_QK + p * (HEAD_QK // QK_PARTS)
                _k_load(k_desc, k_row + n0, col, k_ready.index(s), k_bufs.index(s * QK_PARTS + p))
                if SPLIT:
                    _k_load(kb_desc, k_row + n0 + BN_A, col, k_ready.index(s), kb_bufs.index(s * QK_PARTS + p))
            if V_NATURAL:  # V(j) into raw slot j % 2 (its last reader, V^T(j-2), is written), then V^T(j-1)
                raw_slot = kv_it % 2
                mbarrier.expect(v_raw_ready.index(raw_slot), v_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(v_desc, [k_row + n0, hk * HEAD_D], v_raw_ready.index(raw_slot),
                                                v_raw.index(raw_slot))
                if j > 0:
                    _transpose_v(v_raw, v_raw_ready, v_bufs, v_ready, v_empty, kv_it - 1, STAGES, BLOCK_N, O_W)
            elif K_AHEAD:  # V(j-1) after K(j): K(j) does not wait for V(j-2)'s release (step j's QK^T)
                if j > 0:
                    _load_v(v_desc, vb_desc, v_bufs, vb_bufs, v_ready, v_empty, kv_it - 1, v_row, n0 + BLOCK_N, STAGES,
                            vc_desc, vc_bufs)
            else:
                _load_v(v_desc, vb_desc, v_bufs, vb_bufs, v_ready, v_empty, kv_it, v_row, n0, STAGES, vc_desc, vc_bufs)
            kv_it += 1
        if n_blocks > 0:
            if V_NATURAL:
                _transpose_v(v_raw, v_raw_ready, v_bufs, v_ready, v_empty, kv_it - 1, STAGES, BLOCK_N, O_W)
            elif K_AHEAD:
                _load_v(v_desc, vb_desc, v_bufs, vb_bufs, v_ready, v_empty, kv_it - 1, v_row, 0, STAGES, vc_desc,
                        vc_bufs)


@gluon.jit
def _k_load(k_desc, row, col, bar, buf):
    """TMA load of K rows row.. (columns col..) into the K tile buf. K_PERM: as the 5-D box of
    emit_gluon.k_box (row a multiple of 16: Sk % 16 == 0), which fills the 2-D tile with its rows
    relabelled as V_PERM wants (_key_of_column)."""
    if K_PERM:
        tma.async_copy_global_to_shared(k_desc, [row // 16, 0, 0, 0, col], bar,
                                        buf._reinterpret(buf.dtype, k_desc.block_type.shape, k_desc.layout))
    else:
        tma.async_copy_global_to_shared(k_desc, [row, col], bar, buf)


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
                 HEAD_D: gl.constexpr):
    """V^T of KV block `it` (V_NATURAL): wait for its (BLOCK_N, D) tile in raw slot it % 2 and for its V^T
    stage to be free, then write the transpose in 32-key chunks. Each thread reads 4 keys x D/16
    dims (one vector per key row), so the transpose is a byte permute inside its registers and the
    writes are vectors along keys (LDS / PRMT / STS, no shuffles, no scratch). The warpgroup's
    writes are fenced for the async proxy (wgmma reads V^T) and joined before one arrive."""
    s = it % STAGES
    r = it % 2
    mbarrier.wait(v_raw_ready.index(r), (it // 2) & 1)
    mbarrier.wait(v_empty.index(s), ((it // STAGES) & 1) ^ 1)
    rows: gl.constexpr = gl.BlockedLayout([4, HEAD_D // 16], [8, 4], [1, 4], [1, 0])  # (keys, dims)
    vt = v_bufs.index(s)
    raw = v_raw.index(r)
    for c in gl.static_range(BLOCK_N // 32):
        x = raw.slice(c * 32, 32, dim=0).load(rows)
        vt.slice(c * 32, 32, dim=1).store(x.permute((1, 0)))
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(v_ready.index(s), count=1)


@gluon.jit
def _softmax(s, m_i, l_i, qk_scale, n0, row0, Sk, off,
             MASK: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr,
             qk_layout: gl.constexpr, p_layout: gl.constexpr, V_PERM: gl.constexpr, P_OFFSET: gl.constexpr,
             LEAN: gl.constexpr, sb, qkb_layout: gl.constexpr, kv_it=0):
    """Online softmax of one 64 x BLOCK_N score block. Probabilities are scaled by 2^P_OFFSET so
    that small ones stay out of e4m3 subnormals; l carries the same factor, which cancels.
    LEAN (lean P): no exponential here; one FMA per score leaves what _p_operand turns into e4m3
    codes (LEAN_ASM: generator/lean_asm.lean_tail_asm); the rounded row sum comes from an MMA with PV
    (ROWSUM_MMA), or CODE_SUMS from the packed codes, decoded here (_code_sums). ROWSUM_MMA: l is not
    summed here; the row sum of the probabilities as rounded to e4m3 comes from the MMA against ones
    (_pv_issue).
    SPLIT (two key parts): s holds keys [n0, n0 + BN_A) and sb keys [n0 + BN_A, n0 + BN_A + BN_B): one
    row maximum and one row sum over both, two P operands (the last result, p8b; else p8 again).
    kv_it: the step, for the timeline's row-maximum stamp (TRACE only)."""
    if MASK:
        s = _masked(s, n0, row0, Sk, off, CAUSAL, qk_layout)
        if SPLIT:
            sb = _masked(sb, n0 + BN_A, row0, Sk, off, CAUSAL, qkb_layout)
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
            if LEAN_CENTER != 0.0:  # "centered": the line lowered by LEAN_CENTER codes (lean_asm.py); b straight
                # from the grid index, as "fma"'s from ceil(8 m): one rounding and one add after the row maximum
                # (through m_use, ptxas scheduled both rows' maxima before any fold: 12% slower, docs/PERF.md s25)
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
    several codes on rows with logits of hundreds (0x7f, e4m3's NaN, at p_scale_log2 = 8: session 30). Their
    bound, 2^-11 + |b| 2^-10, keeps the maximum's code at or below 125: b is lowered by it (one-FMA folds),
    or (corrected) only by what of it passes code 125, so that a row's maximum keeps its exact code but on
    rows with logits of hundreds. The shift, common to the row, is cancelled by the normalisation. (Holding
    a16 / qk_scale per row to compensate a exactly cost 4%: ptxas then serialised the two rows' maxima;
    cvt.rm would be an F2F each, a slower pipe than F2FP's one for both rows.) docs/BACKENDS.md."""
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
def _masked(s, n0, row0, Sk, off, CAUSAL: gl.constexpr, layout: gl.constexpr):
    """s (64 rows x its keys from n0) with keys past Sk, and past each row's diagonal if CAUSAL, at -inf."""
    cols = n0 + _key_of_column(gl.arange(0, s.shape[1], layout=gl.SliceLayout(0, layout)))
    rows = row0 + gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
    if CAUSAL and P_SMEM:
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
    (generator/exp2_poly.py), so that the two pipes share the exponentials."""
    if EXP2_POLY > 0:
        return gl.inline_asm_elementwise(EXP2_ASM, EXP2_CONSTRAINTS, [x], dtype=gl.float32, is_pure=True, pack=8)
    else:
        return gl.exp2(x)


@gluon.jit
def _rescale(acc, l_i, alpha, row_o: gl.constexpr, accc, row_oc: gl.constexpr):
    """O *= alpha per row, and l too under ROWSUM_MMA (whose row sums arrive with PV, so l is
    rescaled when O is). O_SPLIT: O's second part (accc) too. Returns (acc, l_i, accc)."""
    acc = _times_rows(acc, alpha, row_o, RESCALE_ASM, RESCALE_CONSTRAINTS, RESCALE_PACK)
    if O_SPLIT:
        accc = _times_rows(accc, alpha, row_oc, RESCALE_C_ASM, RESCALE_C_CONSTRAINTS, RESCALE_C_PACK)
    if ROWSUM_MMA:
        l_i = l_i * alpha
    return acc, l_i, accc


@gluon.jit
def _times_rows(acc, alpha, row: gl.constexpr, ASM: gl.constexpr, CONSTRAINTS: gl.constexpr, PACK: gl.constexpr):
    """One O accumulator times its rows' alpha. RESCALE_IN_PLACE: inline PTX on its own registers
    (generator/rescale_asm.py), with skip_rescale jumped over by a warp whose rows all have alpha == 1
    (maxima kept)."""
    a = gl.convert_layout(alpha, row)[:, None]
    if RESCALE_IN_PLACE:
        return gl.inline_asm_elementwise(ASM, CONSTRAINTS, [acc, gl.broadcast(acc, a)[1]], dtype=gl.float32,
                                         is_pure=True, pack=PACK)
    else:
        return acc * a


@gluon.jit
def _carried(p, p_layout: gl.constexpr, LEAN: gl.constexpr = False):
    """One key part's float32 P as it goes to the PV wgmma (V_PERM): a thread's accumulator registers
    hold, per 32-key chunk, keys {16h + 8s + 2q + b}; the register A operand wants them as
    {16h + 4q + 2s + b}. Relabelling the keys (a bit permutation, no data movement) and storing V^T in
    the same key order makes the tensor already distributed like the A operand. Float32, rounded by
    _p_operand next to its wgmma, or (PACK_P, P_SMEM) rounded now and carried packed (LEAN: the folded
    scores turned into their codes, P_SMEM only)."""
    NB: gl.constexpr = p.shape[1] // 32
    p = p.reshape([64, NB, 2, 2, 4, 2]).permute((0, 1, 2, 4, 3, 5)).reshape([64, p.shape[1]])
    p = gl.convert_layout(p, p_layout)
    if PACK_P or P_SMEM:
        p = _p_pack(p, LEAN)
    return p


@gluon.jit
def _p_pack(p, LEAN: gl.constexpr = False):
    """float32 P (64 x keys, the A operand's layout: four consecutive keys per thread) -> int32
    (64 x keys / 4), four e4m3 per register: a quarter of the registers to carry across steps.
    LEAN: p holds lean P's folded scores, made codes by LEAN_ASM (the same four-in, one-out form)."""
    x0, x1 = gl.split(p.reshape([64, p.shape[1] // 4, 2, 2]))   # key 4a + 2b + c: c = 0 / 1
    x00, x01 = gl.split(x0)                                      # b = 0 / 1
    x10, x11 = gl.split(x1)
    if F16_S:  # y = 1024 + code in f16 (_f16_fold): the low bytes of two packed pairs, one PRMT
        return gl.inline_asm_elementwise(F16_PACK_ASM, "=r,h,h,h,h", [x00, x10, x01, x11], dtype=gl.int32,
                                         is_pure=True, pack=1)
    ASM: gl.constexpr = LEAN_ASM if LEAN else E4M3X4_ASM
    return gl.inline_asm_elementwise(ASM, "=r,r,r,r,r", [x00, x10, x01, x11], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _p_unpack(w, p_layout: gl.constexpr):
    """_p_pack's registers as the e4m3 A operand (each is its four keys' bytes: the joins only repeat
    it, so the layout conversion moves nothing). The operand is a copy (an identity LOP3): a plain
    mov lets ptxas coalesce it with the loop-carried register, so the next step's P would be written
    where the in-flight PV wgmma reads, and ptxas serialises every wgmma (C7513)."""
    x = gl.join(w, w)
    x = gl.join(x, x)
    x = gl.convert_layout(x.reshape([64, w.shape[1] * 4]), p_layout)
    return gl.inline_asm_elementwise("lop3.b32 $0, $1, $1, $1, 0xF0;", "=r,r,r,r,r", [x], dtype=gl.float8e4nv,
                                     is_pure=True, pack=4)


@gluon.jit
def _p_stage(w, p_smem):
    """P_SMEM: _p_pack's words into this warpgroup's P tile (as int32: the tile's bytes are the same
    under a 32-bit view of its swizzle, P_SWIZZLE bytes, and 8-bit tensors stored from registers are
    lowered to stmatrix.b16). Call only once the PV wgmma reading the tile is done; _p_publish before the
    next one reads it."""
    _p_words(p_smem, w.shape[1]).store(w)


@gluon.jit
def _p_words(p_smem, N: gl.constexpr):
    """The P tile as (64, N) int32 words (N = its keys / 4), the view _p_stage and _p_stage_lower store."""
    return p_smem._reinterpret(gl.int32, [64, N],
                               gl.NVMMASharedLayout(swizzle_byte_width=P_SWIZZLE, element_bitwidth=32, rank=2))


@gluon.jit
def _p_stage_lower(w, p_smem):
    """HALF_BLOCK on an overlapped kernel: a half block's _p_pack words into the lower half of the keys
    of the P tile, zeros into the upper half (the pipeline's PV wgmma reads the whole tile; the upper
    keys' V rows are loaded, finite, and times zero add nothing)."""
    words = _p_words(p_smem, 2 * w.shape[1])
    words.slice(0, w.shape[1], dim=1).store(w)
    words.slice(w.shape[1], w.shape[1], dim=1).store(gl.zeros_like(w))


@gluon.jit
def _pv_prologue(pP, pPb, acc, l_i, alpha, row_o: gl.constexpr, V_PERM: gl.constexpr, LEAN: gl.constexpr,
                 p_layout: gl.constexpr, p_smem, accc, row_oc: gl.constexpr):
    """What precedes PV(j-1) in an overlapped step and in the last block's PV: P(j-1) as the e4m3 A
    operand (both key parts under SPLIT), O (and l) rescaled by alpha(j-1), and under P_SMEM the P
    tile published. Returns (p8, p8b, acc, l_i, accc)."""
    p8 = _p_operand(pP, V_PERM, LEAN, p_layout, p_smem)
    p8b = _p_operand(pPb, V_PERM, LEAN, p_layout) if SPLIT else p8
    if not LATE_RESCALE:
        acc, l_i, accc = _rescale(acc, l_i, alpha, row_o, accc, row_oc)
    if P_SMEM:
        _p_publish()
    return p8, p8b, acc, l_i, accc


@gluon.jit
def _p_tile(p_smem, it, CID: gl.constexpr):
    """P_DOUBLE: the P tile of KV block `it`, this warpgroup's tile it % 2 of its two (the first also
    holds the warpgroup's output tile in the epilogue where it fits, O_IN_P)."""
    return p_smem.index((it % 2) * NUM_CONSUMERS + CID)


@gluon.jit
def _prev_p_ready(p_smem, kv_it, CID: gl.constexpr, acc, l_i, alpha, row_o: gl.constexpr, accc, row_oc: gl.constexpr):
    """P_DOUBLE, before PV(j-1): P(j-1)'s tile published and O (and l) rescaled by alpha(j-1) (unless
    LATE_RESCALE). Returns (the tile, acc, l_i, accc)."""
    _p_publish()
    if not LATE_RESCALE:
        acc, l_i, accc = _rescale(acc, l_i, alpha, row_o, accc, row_oc)
    return _p_tile(p_smem, kv_it - 1, CID), acc, l_i, accc


@gluon.jit
def _p_publish():
    """P_SMEM: make the warpgroup's stores to its P tile visible to the wgmma about to read it. The
    proxy fence waits for the stores, hundreds of cycles under the tensor cores' shared-memory traffic;
    written after O's rescale to overlap them, though ptxas puts it back at the top of the step."""
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _p_operand(pP, V_PERM: gl.constexpr, LEAN: gl.constexpr = False, p_layout: gl.constexpr = None, p_smem=None):
    """The e4m3 A operand of the PV wgmma. Triton keeps fp8 tensors as separate bytes, so an e4m3 P
    carried across a loop back-edge costs ~100 byte-repacking instructions per step; carried as
    float32 and rounded here (4 registers -> one register of 4 e4m3), they fold away. PACK_P: carried
    already rounded, as int32 words of four e4m3 (_p_pack), a quarter of the registers. LEAN: the
    folded scores become codes by integer clamp and byte packing (generator/lean_asm.py), or were made
    codes already where PACK_P packed them. P_SMEM: the warpgroup's P tile (pP is a stand-in)."""
    if P_SMEM:
        return p_smem
    elif PACK_P:  # (lean P's codes too: _carried made them)
        return _p_unpack(pP, p_layout)
    elif LEAN:
        return gl.inline_asm_elementwise(LEAN_ASM, "=r,r,r,r,r", [pP], dtype=gl.float8e4nv, is_pure=True, pack=4)
    elif V_PERM:
        return gl.inline_asm_elementwise(E4M3X4_ASM, "=r,r,r,r,r", [pP], dtype=gl.float8e4nv, is_pure=True, pack=4)
    else:
        return pP


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


@gluon.jit
def _ov_step(j, n_blocks, kv_it, turn_it, pP, acc, alpha, m_i, l_i, q_bufs, qb, k_bufs, v_bufs, s_zero,
             k_ready, k_empty, v_ready, v_empty, turn_bars, qk_scale, row0, Sk, off,
             MASK: gl.constexpr, CID: gl.constexpr, NUM_CONSUMERS: gl.constexpr,
             PINGPONG: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr,
             qk_layout: gl.constexpr, p_layout: gl.constexpr, row_o: gl.constexpr, V_PERM: gl.constexpr,
             P_OFFSET: gl.constexpr, EX2_FENCE: gl.constexpr, LEAN: gl.constexpr, ones_smem, l_zero,
             QK_PARTS: gl.constexpr, pPb, kb_bufs, vb_bufs, sb_zero, onesb_smem, qkb_layout: gl.constexpr,
             p_smem, accc, vc_bufs, row_oc: gl.constexpr):
    """Overlapped step j >= 1: issue QK^T(j) and PV(j-1) back to back, wait for QK^T(j) only, run
    softmax(j) while PV(j-1) is on the tensor cores, then wait for PV(j-1). What keeps ptxas from
    undoing the overlap: nothing in flight across the loop back-edge (else every wgmma of the kernel
    is serialised, C7514); O rescaled at the start of the next step and V(j-1) released one step
    later (an instruction right after the PV wait pulls the wait above the exponentials); P carried
    as float32 (see _p_operand). Even so ptxas hoists the PV wait above part of the exponentials;
    EX2_FENCE puts a barrier on the row sums right before the wait (generator/fence_asm.py). ROWSUM_MMA: the
    rounded row sum of P(j-1) is one more wgmma (against ones) issued with PV(j-1), so l is
    rescaled and summed exactly when O is. SPLIT: two key parts, so twice the wgmmas of each kind
    (pPb carries the second part's P). P_SMEM: P(j-1) is read from the warpgroup's P tile (pP and
    pPb are stand-ins), P(j) written there once PV(j-1) is done, and V(j-1) released then; P_DOUBLE
    (two tiles, one key part): QK^T(j) is issued first, P(j-1)'s tile published and O rescaled while it
    runs, PV(j-1) issued behind it, and P(j) stored into the other tile before the PV(j-1) wait. PV_DEFER
    (overlap off): both products are waited for before the softmax and V(j-1) is released in this
    step; with two key parts PV(j-1) is issued first and QK^T(j)'s second part only once PV(j-1) is
    done (below). O_SPLIT: O's second part (accc) goes with O everywhere."""
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
                                        sb, qkb_layout, kv_it)
    l_i = _marked(l_i, kv_it, EV_SOFTMAX_DONE, CID)
    if P_DOUBLE:  # the other tile (PV(j-2), its last reader, is done): stored before the PV(j-1) wait
        _p_stage(pP, _p_tile(p_smem, kv_it, CID))
    if EX2_FENCE:
        # a barrier that needs every exponential of step j (the row sums, or the OR of all the
        # probabilities; generator/fence_asm.py), right before the PV wait, which ptxas keeps after it
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
                   qkb_layout: gl.constexpr, HALF: gl.constexpr):
    """The overlapped schedule's first block (visit 0, masked) after its QK^T: softmax, and under P_SMEM
    P staged in its tile (pP then a stand-in). HALF (HALF_BLOCK, 0 otherwise): on the block's lower
    HALF keys only (their scores are half of each thread's registers), P's upper keys staged as zeros,
    so the pipeline after it, whose PV reads whole tiles, is the same. Returns (pP, m_i, l_i, alpha, pPb)."""
    n0 = (n_blocks - 1) * BLOCK_N
    if HALF > 0:
        s = _lower_keys(_masked(s, n0, row0, Sk, off, CAUSAL, s_layout))
        h_layout: gl.constexpr = s.type.layout
        pP, m_h, l_h, a_h, pPb = _softmax(s, gl.convert_layout(m_i, gl.SliceLayout(1, h_layout)),
                                          _half_sums(l_i, s), qk_scale, n0, row0, Sk, off, False, CAUSAL,
                                          HALF, h_layout, p_layout, V_PERM, P_OFFSET, LEAN, s, qkb_layout, kv_it)
        m_i = gl.convert_layout(m_h, row_s)
        l_i = gl.convert_layout(l_h, l_i.type.layout)
        alpha = gl.convert_layout(a_h, row_s)
    else:
        pP, m_i, l_i, alpha, pPb = _softmax(s, m_i, l_i, qk_scale, n0, row0, Sk, off, True, CAUSAL, BLOCK_N,
                                            s_layout, p_layout, V_PERM, P_OFFSET, LEAN, sb, qkb_layout, kv_it)
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
                s_zero, sb_zero, HALF: gl.constexpr):
    """One step of the plain schedule on the K/V block in stage kv_it % STAGES (visit j of n_blocks,
    masked when j < n_masked): S = QK^T; wait; softmax; O += PV; wait; both stages released.
    HALF (HALF_BLOCK, 0 otherwise): only the block's first HALF keys, a masked step on the lower
    halves of the K and V^T tiles, for a block whose upper half no row sees (s_zero: S's shape and
    layout, HALF keys wide then; sb_zero: the second key part's under SPLIT, never halved).
    Returns (acc, m_i, l_i, accc)."""
    _mark(kv_it, EV_START, CID)
    s_st = kv_it % STAGES
    s_ph = (kv_it // STAGES) & 1
    s_layout: gl.constexpr = s_zero.type.layout
    s, sb = _qk_waited(q_bufs, qb, k_bufs, k_ready, k_empty, turn_bars, s_zero, kv_it, turn_it,
                       CID, NUM_CONSUMERS, PINGPONG, STAGES, QK_PARTS, kb_bufs, sb_zero, HALF)
    n0 = (n_blocks - 1 - j) * BLOCK_N
    if HALF > 0:
        p8, m_h, l_h, alpha, p8b = _softmax(s, gl.convert_layout(m_i, gl.SliceLayout(1, s_layout)),
                                            _half_sums(l_i, s_zero), qk_scale, n0, row0, Sk, off, True, CAUSAL,
                                            HALF, s_layout, p_layout, V_PERM, P_OFFSET, False, sb, qkb_layout,
                                            kv_it)
        m_i = gl.convert_layout(m_h, row_s)
        l_i = gl.convert_layout(l_h, l_i.type.layout)
        alpha = gl.convert_layout(alpha, row_s)
    elif j < n_masked:
        p8, m_i, l_i, alpha, p8b = _softmax(s, m_i, l_i, qk_scale, n0, row0, Sk, off, True, CAUSAL,
                                            BLOCK_N, s_layout, p_layout, V_PERM, P_OFFSET, False,
                                            sb, qkb_layout, kv_it)
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
    is lowered to stmatrix.b16 and leaves half the bytes unwritten: rows summed over half their keys,
    found on the H200.)"""
    fill: gl.constexpr = gl.BlockedLayout([2], [32], [4], [0])
    words = smem._reinterpret(gl.int32, [2 * N], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    words.store(gl.full([2 * N], 0x38383838, gl.int32, layout=fill))
    return smem


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
              kb_bufs, vb_bufs, onesb_bufs, p_bufs):
    """Consumer warpgroup CID: rows [64 CID, 64 CID + 64) of every tile it visits. Key blocks from
    the diagonal downwards; only the first n_masked (diagonal / key end) pay for the mask."""
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
    lo, hi, step = _tile_loop(tile_table, n_tiles)
    for i in range(lo, hi, step):
        b, h, mb = _tile_coords(_tile_at(tile_table, i), n_bh, H, n_m, HEAVY_FIRST)
        hk = h // GROUP
        m0 = mb * BLOCK_M
        row0 = m0 + CID * 64
        if QD is None:  # no descales: a compile-time constant, nothing to load
            qk_scale = scale_log2
            v_scale = 1.0
        else:
            dsc = b * ds0 + hk * ds1
            qk_scale = scale_log2 * gl.load(QD + dsc) * gl.load(KD + dsc)
            v_scale = gl.load(VD + dsc)
        n_blocks, n_masked = _block_range(m0, Sq, Sk, BLOCK_M, BLOCK_N, CAUSAL)

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
        skip = (row0 >= Sq) & (not PINGPONG)
        if skip:
            kv_it = _pass_blocks(kv_it, n_blocks, k_ready, k_empty, v_ready, v_empty, STAGES)
        elif n_blocks > 0:
            if OVERLAP or PV_DEFER:  # (PV_DEFER: the overlapped step's issue order, softmax after both waits)
                # ---- block 0 (the diagonal / tail block whenever any block is masked); HALF_BLOCK (overlapped:
                # P in shared memory, half_block_conflict): its softmax on the lower half when no row sees the
                # upper one (the whole block's QK^T either way: one wgmma turn, and a half-width accumulator
                # in a second copy of the block makes ptxas spill in the step loops)
                s, sb = _qk_waited(q_bufs, qb, k_bufs, k_ready, k_empty, turn_bars, s_zero, kv_it, turn_it,
                                   CID, NUM_CONSUMERS, PINGPONG, STAGES, QK_PARTS, kb_bufs, sb_zero)
                if HALF_BLOCK and CAUSAL:
                    if _upper_half_unseen(n_blocks, row0, Sq, Sk, BLOCK_N):
                        pP, m_i, l_i, alpha, pPb = _first_softmax(
                            s, sb, n_blocks, kv_it, m_i, l_i, qk_scale, row0, Sk, off, p_smem, CID, CAUSAL,
                            BLOCK_N, qk_layout, p_layout, row_s, V_PERM, P_OFFSET, LEAN, qkb_layout, BLOCK_N // 2)
                    else:
                        pP, m_i, l_i, alpha, pPb = _first_softmax(
                            s, sb, n_blocks, kv_it, m_i, l_i, qk_scale, row0, Sk, off, p_smem, CID, CAUSAL,
                            BLOCK_N, qk_layout, p_layout, row_s, V_PERM, P_OFFSET, LEAN, qkb_layout, 0)
                else:
                    pP, m_i, l_i, alpha, pPb = _first_softmax(
                        s, sb, n_blocks, kv_it, m_i, l_i, qk_scale, row0, Sk, off, p_smem, CID, CAUSAL,
                        BLOCK_N, qk_layout, p_layout, row_s, V_PERM, P_OFFSET, LEAN, qkb_layout, 0)
                turn_it += 1
                kv_it += 1
                # ---- masked blocks (phase 0), then unmasked blocks (phase 1): two loops, MASK constant in each
                for phase in gl.static_range(2):
                    lo = 1 if phase == 0 else gl.maximum(n_masked, 1)
                    hi = n_masked if phase == 0 else n_blocks
                    for j in range(lo, hi):
                        pP, acc, alpha, m_i, l_i, pPb, accc = _ov_step(
                            j, n_blocks, kv_it, turn_it, pP, acc, alpha, m_i, l_i, q_bufs, qb, k_bufs, v_bufs, s_zero,
                            k_ready, k_empty, v_ready, v_empty, turn_bars, qk_scale, row0, Sk, off,
                            phase == 0, CID, NUM_CONSUMERS, PINGPONG, STAGES, CAUSAL, BLOCK_N,
                            qk_layout, p_layout, row_o, V_PERM, P_OFFSET, EX2_FENCE, LEAN, ones_smem, l_zero,
                            QK_PARTS, pPb, kb_bufs, vb_bufs, sb_zero, onesb_smem, qkb_layout, p_smem, accc, vc_bufs,
                            row_oc)
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
                    mbarrier.arrive(v_empty.index((kv_it + STAGES - 2) % STAGES), count=1, pred=n_blocks >= 2)
                mbarrier.arrive(v_empty.index(pst), count=1)
            else:
                # ---- plain schedule: S = QK^T; wait; softmax; O += PV; wait
                j0 = 0
                # a causal tile's first block whose upper half no row of this warpgroup sees: BLOCK_N / 2 keys
                # (not compiled into the non-causal kernel: there only a key end could leave half a block
                # empty, and the second step body costs it 16 bytes of spills)
                if HALF_BLOCK and CAUSAL:
                    if _upper_half_unseen(n_blocks, row0, Sq, Sk, BLOCK_N):
                        acc, m_i, l_i, accc = _plain_step(
                            0, n_blocks, 1, kv_it, turn_it, acc, m_i, l_i, accc, q_bufs, qb, k_bufs, v_bufs, vc_bufs,
                            kb_bufs, vb_bufs, k_ready, k_empty, v_ready, v_empty, turn_bars, qk_scale, row0, Sk,
                            off, ones_smem, onesb_smem, l_zero, CID, NUM_CONSUMERS, PINGPONG, STAGES, QK_PARTS,
                            CAUSAL, BLOCK_N, p_layout, row_o, row_oc, row_s, V_PERM, P_OFFSET, qkb_layout,
                            gl.zeros([64, BLOCK_N // 2], gl.float32, layout=qkh_layout), sb_zero, BLOCK_N // 2)
                        turn_it += 2
                        kv_it += 1
                        j0 = 1
                for j in range(j0, n_blocks):
                    acc, m_i, l_i, accc = _plain_step(
                        j, n_blocks, n_masked, kv_it, turn_it, acc, m_i, l_i, accc, q_bufs, qb, k_bufs, v_bufs,
                        vc_bufs, kb_bufs, vb_bufs, k_ready, k_empty, v_ready, v_empty, turn_bars, qk_scale, row0, Sk,
                        off, ones_smem, onesb_smem, l_zero, CID, NUM_CONSUMERS, PINGPONG, STAGES, QK_PARTS,
                        CAUSAL, BLOCK_N, p_layout, row_o, row_oc, row_s, V_PERM, P_OFFSET, qkb_layout,
                        s_zero, sb_zero, 0)
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
            inv = gl.where(l_o > 0.0, v_scale / l_o, 0.0)
            o = (acc * inv[:, None]).to(gl.bfloat16)
            tma.store_wait(0)
            if O_CHUNKS > 1:  # o_through_p: chunks through the two P tiles (O_CHUNKS 2 or 4)
                o_left, o_right = _column_halves(o)
                if O_CHUNKS == 2:
                    _o_chunk_store(o_left, 0, o_bufs, o_desc, b, row0, h * HEAD_D, CID)
                    _o_chunk_store(o_right, 1, o_bufs, o_desc, b, row0, h * HEAD_D, CID)
                else:
                    o_0, o_1 = _column_halves(o_left)
                    o_2, o_3 = _column_halves(o_right)
                    _o_chunk_store(o_0, 0, o_bufs, o_desc, b, row0, h * HEAD_D, CID)
                    _o_chunk_store(o_1, 1, o_bufs, o_desc, b, row0, h * HEAD_D, CID)
                    _o_chunk_store(o_2, 2, o_bufs, o_desc, b, row0, h * HEAD_D, CID)
                    _o_chunk_store(o_3, 3, o_bufs, o_desc, b, row0, h * HEAD_D, CID)
            else:
                o_smem.store(o)
                if O_SPLIT:
                    oc_smem.store((accc * gl.convert_layout(inv, row_oc)[:, None]).to(gl.bfloat16))
                fence_async_shared()
                if O_W <= HEAD_D:  # O's first (or only) O_W columns
                    tma.async_copy_shared_to_global(o_desc, [b, row0, h * HEAD_D], o_smem.reshape([1, 64, O_W]))
                else:  # (B, Sq, H, D) view: the box's columns past D (the padding of O_W) are clipped
                    tma.async_copy_shared_to_global(o_desc, [b, row0, h, 0], o_smem.reshape([1, 64, 1, O_W]))
                if O_SPLIT:
                    tma.async_copy_shared_to_global(oc_desc, [b, row0, h * HEAD_D + O_W],
                                                    oc_smem.reshape([1, 64, O_C]))
    tma.store_wait(0)
