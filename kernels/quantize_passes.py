"""The quantiser's two Triton passes and their device helpers: pass 1 finds each (batch, kv head)'s
absolute maximum (after the rotation or the K mean where asked), pass 2 writes the e4m3 codes (nearest,
or balanced along the keys for V) in the layout asked for. Packed sequences (PACKED) take the same
passes, each row block within one sequence, one scale per (sequence, kv head). The one-pass kernel of plain
rows (kernels/quantize_onepass.py) is built from the same helpers. The host side that plans and launches them
is kernels/quantize.py."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .balanced_v import _BALANCE_KEYS, _BALANCE_ROW_BITS, _BALANCE_SKIP, _balanced_keys
from .hadamard import _columns

E4M3_MAX = 448.0
_E4M3_MAX = tl.constexpr(E4M3_MAX)
#: descale = max(amax, 1e-12) times the float32 reciprocal of 448 (what torch's CUDA division by a scalar
#: computes; written out so that the CPU path, whose division by a scalar is exact, gives the same descales)
INV_E4M3_MAX = float(torch.tensor(1.0) / torch.tensor(E4M3_MAX))
_INV_E4M3_MAX = tl.constexpr(INV_E4M3_MAX)
AMAX_FLOOR = 1e-12
_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)
#: no L2 eviction priority (a load's or store's default; a str default of a Triton function must be a constexpr)
_NO_HINT = tl.constexpr("")


@triton.jit
def _pick(seg, a0, a1, a2, NSEG: tl.constexpr):
    """The value of segment `seg` of a scalar passed once per segment."""
    v = a0
    if NSEG > 1:
        v = tl.where(seg >= 1, a1, v)
    if NSEG > 2:
        v = tl.where(seg >= 2, a2, v)
    return v


@triton.jit
def _program_rows(
    X0,
    X1,
    X2,
    MEAN,
    CU0,
    CU1,
    CU2,
    P1,
    P2,
    F0,
    F1,
    F2,
    S0,
    S1,
    S2,
    H0,
    H1,
    H2,
    G0,
    G1,
    G2,
    SB0,
    SB1,
    SB2,
    SS0,
    SS1,
    SS2,
    SH0,
    SH1,
    SH2,
    stride_d,
    D,
    NSEQ,
    STEPS,
    NSEG: tl.constexpr,
    DP: tl.constexpr,
    BLOCK_S: tl.constexpr,
    CENTER: tl.constexpr,
    PACKED: tl.constexpr,
    LOAD: tl.constexpr = True,
    BLOCK=None,
    EVICT: tl.constexpr = _NO_HINT,
):
    """This program's tensor (segment: programs [0, P1) the first, [P1, P2) the second, then the
    third) and its rows there (a one-dimensional grid, row blocks of one head after another: no grid
    dimension limits batch x heads), the head dim padded to DP with zeros (as are rows past S);
    centred (float32) with CENTER, else in the input's dtype. Returns (rows, segment, batch, head,
    index of the (batch, kv head) in the amax and descale buffers, first row, S, H, GROUP, the block's
    first row's address, the row stride, whether the block is its head's first). LOAD=False: the rows
    are not loaded (x is 0; BALANCED loads them 16 keys at a time). BLOCK: the block to take instead of the
    program id's (a persistent program's work item), EVICT the rows' L2 eviction priority. PACKED: the tensor
    is (1, S, H, D) rows of NSEQ sequences (`_packed_block`), the returned S the end of the block's sequence
    and the scale index its (sequence, kv head)'s."""
    pid = tl.program_id(0) if BLOCK is None else BLOCK
    seg = 0
    if NSEG > 1:
        seg = (pid >= P1).to(tl.int32)
    if NSEG > 2:
        seg += (pid >= P2).to(tl.int32)
    pid -= _pick(seg, 0, P1, P2, NSEG)
    S = _pick(seg, S0, S1, S2, NSEG)
    H = _pick(seg, H0, H1, H2, NSEG)
    GROUP = _pick(seg, G0, G1, G2, NSEG)
    if PACKED:  # (B = 1; b is the tensor's batch index, 0, and the descales' is the sequence's)
        h, s0, S, first, seq = _packed_block(pid, _pick(seg, CU0, CU1, CU2, NSEG), S, NSEQ, STEPS, BLOCK_S)
        b = seq * 0
    else:
        blocks = tl.cdiv(S, BLOCK_S)
        bh = pid // blocks
        b = bh // H
        h = bh % H
        s0 = (pid % blocks) * BLOCK_S
        first = s0 == 0
        seq = b
    kv = _pick(seg, F0, F1, F2, NSEG) + seq * (H // GROUP) + h // GROUP
    rows = s0 + tl.arange(0, BLOCK_S)
    cols = tl.arange(0, DP)
    ok = (rows < S)[:, None] & (cols < D)[None, :]
    stride_s = _pick(seg, SS0, SS1, SS2, NSEG)
    src = (
        _pick(seg, X0, X1, X2, NSEG)
        + b.to(tl.int64) * _pick(seg, SB0, SB1, SB2, NSEG)
        + h.to(tl.int64) * _pick(seg, SH0, SH1, SH2, NSEG)
        + s0.to(tl.int64) * stride_s
    )
    x = 0.0
    if LOAD:
        x = tl.load(
            src + tl.arange(0, BLOCK_S)[:, None] * stride_s + cols[None, :] * stride_d,
            mask=ok,
            other=0.0,
            eviction_policy=EVICT,
        )
    if CENTER:  # (a centred segment is alone in its launch: its kv index is its own)
        mean = tl.load(MEAN + (kv - F0) * D + cols, mask=cols < D, other=0.0)
        x = tl.where(ok, x.to(tl.float32) - mean[None, :], 0.0)
    return x, seg, b, h, kv, s0, S, H, GROUP, src, stride_s, first


@triton.jit
def _packed_block(pid, CU, S, NSEQ, STEPS, BLOCK_S: tl.constexpr):
    """A program's head and rows in packed (S = total, H, D) rows of NSEQ sequences, CU their int32
    cumulative lengths on the device. Sequence i owns the program slots from A_i = CU[i] // BLOCK_S + i
    (per head S // BLOCK_S + NSEQ slots: A_{i+1} - A_i is at least its blocks), so a block starts
    BLOCK_S-aligned from its sequence's first row and never holds another's rows; the sequence is the
    last i with A_i <= slot (a binary search of STEPS loads; A increases with i), no host value read.
    Returns (head, first row, end of the rows (the sequence's end), whether the block is its sequence's
    first, sequence). The slots a sequence does not fill hold no rows; its first always exists, so an
    empty sequence still writes its descale. Bounds are clamped to [0, S]: bad lengths never move a
    load or store outside the tensors."""
    slots = S // BLOCK_S + NSEQ
    h = pid // slots
    j = pid % slots
    seq = tl.full([], 0, tl.int32)
    for t in range(STEPS):
        cand = seq + (1 << (STEPS - 1 - t))
        start = tl.load(CU + cand, mask=cand < NSEQ, other=0)
        seq = tl.where((cand < NSEQ) & (start // BLOCK_S + cand <= j), cand, seq)
    start = tl.load(CU + seq)
    block = j - (start // BLOCK_S + seq)
    start = tl.minimum(tl.maximum(start, 0), S)
    end = tl.minimum(tl.maximum(tl.load(CU + seq + 1), start), S)
    return h, start + block * BLOCK_S, end, block == 0, seq


#: the segment starts, buffer offsets and sequence counts are not specialised on: one compiled kernel
#: for any of them
_SEGMENT_ARGS = ["P1", "P2", "F0", "F1", "F2", "NSEQ", "STEPS"]


@triton.jit
def _max_keep_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _abs_max(x, axis: tl.constexpr = None):
    """max |x| with a NaN kept (tl.max drops it): a NaN input gives its (batch, kv head) a NaN descale,
    as the reference's amax does, so the output shows the bad input instead of hiding it."""
    return tl.reduce(tl.abs(x), axis, _max_keep_nan)


@triton.jit
def _free_slot(b, h, H, s0, SKP):
    """Where the mask of the block of keys from s0 of (batch b, head h) sits in FREE: (B, H, SKP / 16)."""
    return (b.to(tl.int64) * H + h) * (SKP // _BALANCE_KEYS) + s0 // _BALANCE_KEYS


@triton.jit
def _free_masks(src, stride_s, stride_d, free, n, D, DP: tl.constexpr, BLOCK_S: tl.constexpr):
    """The max |x| of a balanced program's rows (n of them left in the head from src, rows past it 0), having
    stored at free[j] the mask of the keys of its j-th block of 16 that may move (`_free_keys`), a bit a key:
    a block at a time, a block wholly past n neither read nor written (FREE holds S / 16 rounded up a head)."""
    keys = tl.arange(0, _BALANCE_KEYS)
    cols = tl.arange(0, DP)
    m = tl.zeros([], tl.float32)
    for j in range(BLOCK_S // _BALANCE_KEYS):
        k0 = j * _BALANCE_KEYS
        ok = (k0 + keys < n)[:, None] & (cols < D)[None, :]
        x = tl.load(src + (k0 + keys)[:, None] * stride_s + cols[None, :] * stride_d, mask=ok, other=0.0)
        rows = _abs_max(x.to(tl.float32), axis=1)
        top = _abs_max(rows)
        e = tl.maximum((top.to(tl.int32, bitcast=True) >> 23) & 0xFF, _BALANCE_ROW_BITS + 1)
        fixed = (rows * ((254 - e + _BALANCE_ROW_BITS) << 23).to(tl.float32, bitcast=True)).to(tl.int32)
        moves = fixed * (_BALANCE_SKIP * _BALANCE_KEYS) >= tl.sum(fixed)
        tl.store(free + j, tl.sum(tl.where(moves, 1 << keys, 0)), mask=k0 < n)
        m = _max_keep_nan(m, top)
    return m


@triton.jit(do_not_specialize=_SEGMENT_ARGS)
def _amax_kernel(
    X0,
    X1,
    X2,
    R,
    MEAN,
    AMAX,
    FREE,
    CU0,
    CU1,
    CU2,
    P1,
    P2,
    F0,
    F1,
    F2,
    S0,
    S1,
    S2,
    H0,
    H1,
    H2,
    G0,
    G1,
    G2,
    SB0,
    SB1,
    SB2,
    SS0,
    SS1,
    SS2,
    SH0,
    SH1,
    SH2,
    stride_d,
    D,
    inv_sqrt,
    SKP,
    NSEQ,
    STEPS,
    NSEG: tl.constexpr,
    DP: tl.constexpr,
    BN: tl.constexpr,
    BLOCK_S: tl.constexpr,
    CENTER: tl.constexpr,
    ROTATE: tl.constexpr,
    TERMS: tl.constexpr,
    LAST_K_MAJOR: tl.constexpr,
    BALANCED: tl.constexpr,
    PACKED: tl.constexpr,
):
    tl.static_assert(not (BALANCED and PACKED), "balanced V takes no packed sequences")
    x, seg, b, h, kv, s0, S, H, GROUP, src, stride_s, _ = _program_rows(
        X0,
        X1,
        X2,
        MEAN,
        CU0,
        CU1,
        CU2,
        P1,
        P2,
        F0,
        F1,
        F2,
        S0,
        S1,
        S2,
        H0,
        H1,
        H2,
        G0,
        G1,
        G2,
        SB0,
        SB1,
        SB2,
        SS0,
        SS1,
        SS2,
        SH0,
        SH1,
        SH2,
        stride_d,
        D,
        NSEQ,
        STEPS,
        NSEG,
        DP,
        BLOCK_S,
        CENTER,
        PACKED,
        not BALANCED,
    )
    if ROTATE:
        m = 0.0
        for c0 in range(0, DP, BN):
            m = _max_keep_nan(m, _abs_max(_columns(x, R, c0, inv_sqrt, DP, BN, ROTATE, TERMS)))
    elif BALANCED:  # and which keys of each block may move, for pass 2
        m = _free_masks(src, stride_s, stride_d, FREE + _free_slot(b, h, H, s0, SKP), S - s0, D, DP, BLOCK_S)
    else:
        m = _abs_max(x.to(tl.float32))
    _fold_amax(AMAX, kv, m)


@triton.jit
def _fold_amax(AMAX, kv, m):
    """AMAX[kv] = max(AMAX[kv], m) for m >= 0 or a NaN with its sign bit clear: as int32 bits these order
    as the floats do with the NaN on top (a float atomic_max would drop it); the result does not depend on
    the order of the programs."""
    tl.atomic_max(AMAX.to(tl.pointer_type(tl.int32)) + kv, m.to(tl.int32, bitcast=True), sem="relaxed")


@triton.jit
def _scale_of(amax, DESCALE, kv, store):
    """The scale of a (batch, kv head) of this amax, its descale stored where `store` (one block of each):
    descale = max(amax, floor) / 448 as the reference, scale its IEEE reciprocal (once a block)."""
    descale = _max_keep_nan(amax, _AMAX_FLOOR) * _INV_E4M3_MAX
    if store:
        tl.store(DESCALE + kv, descale)
    return tl.math.div_rn(tl.full([], 1.0, tl.float32), descale)


@triton.jit(do_not_specialize=_SEGMENT_ARGS)
def _codes_kernel(
    X0,
    X1,
    X2,
    R,
    MEAN,
    AMAX,
    FREE,
    CU0,
    CU1,
    CU2,
    WEIGHT,
    DESCALE,
    OUT0,
    OUT1,
    OUT2,
    P1,
    P2,
    F0,
    F1,
    F2,
    S0,
    S1,
    S2,
    H0,
    H1,
    H2,
    G0,
    G1,
    G2,
    SB0,
    SB1,
    SB2,
    SS0,
    SS1,
    SS2,
    SH0,
    SH1,
    SH2,
    stride_d,
    D,
    inv_sqrt,
    SKP,
    NSEQ,
    STEPS,
    NSEG: tl.constexpr,
    DP: tl.constexpr,
    BN: tl.constexpr,
    BLOCK_S: tl.constexpr,
    CENTER: tl.constexpr,
    ROTATE: tl.constexpr,
    TERMS: tl.constexpr,
    LAST_K_MAJOR: tl.constexpr,
    BALANCED: tl.constexpr,
    PACKED: tl.constexpr,
):
    """The codes of a block of rows. LAST_K_MAJOR: the last segment's go keys-fastest into its (B, H, D,
    SKP) buffer (V for the FP8 kernels' V^T, written by this pass instead of a copy after it).
    BALANCED: rounded as `balanced_codes` (V, alone in its launch, never rotated: BLOCK_S / 16 blocks of
    keys a program, BN = DP), kappa WEIGHT (B, kv heads) float32."""
    x, seg, b, h, kv, s0, S, H, GROUP, src, stride_s, first = _program_rows(
        X0,
        X1,
        X2,
        MEAN,
        CU0,
        CU1,
        CU2,
        P1,
        P2,
        F0,
        F1,
        F2,
        S0,
        S1,
        S2,
        H0,
        H1,
        H2,
        G0,
        G1,
        G2,
        SB0,
        SB1,
        SB2,
        SS0,
        SS1,
        SS2,
        SH0,
        SH1,
        SH2,
        stride_d,
        D,
        NSEQ,
        STEPS,
        NSEG,
        DP,
        BLOCK_S,
        CENTER,
        PACKED,
        not BALANCED,
    )
    scale = _scale_of(tl.load(AMAX + kv), DESCALE, kv, first & (h % GROUP == 0))
    out = _pick(seg, OUT0, OUT1, OUT2, NSEG)
    k_major = False
    if LAST_K_MAJOR:
        k_major = seg == NSEG - 1
    if BALANCED:
        _balanced_block(src, stride_s, stride_d, S, s0, D, b, h, H, GROUP, scale, out, FREE, WEIGHT, SKP, k_major, DP,
                        BLOCK_S)  # fmt: skip
    else:
        _plain_codes(x, R, inv_sqrt, scale, out, s0, S, D, b, h, H, SKP, k_major, DP, BN, ROTATE, TERMS, BLOCK_S)


@triton.jit
def _balanced_block(
    src, stride_s, stride_d, S, s0, D, b, h, H, GROUP, scale, out, FREE, WEIGHT, SKP, k_major, DP: tl.constexpr,
    BLOCK_S: tl.constexpr,
):  # fmt: skip
    """The balanced codes of the block of (batch b, head h) from row s0 (the codes pass of either kernel): kappa
    its (batch, kv head)'s from WEIGHT, the codes into `out` as (B, S, H, D), or keys-fastest (k_major) as
    (B, H, D, SKP)."""
    kappa = tl.load(WEIGHT + b.to(tl.int64) * (H // GROUP) + h // GROUP)
    dst = out + ((b.to(tl.int64) * S + s0) * H + h) * D  # (natural: keys H x D codes apart)
    dst_k = H * D
    dst_c = 1
    if k_major:
        dst = out + (b.to(tl.int64) * H + h) * D * SKP + s0
        dst_k = 1
        dst_c = SKP
    free = FREE + _free_slot(b, h, H, s0, SKP)
    _balanced_rows(src, stride_s, stride_d, S - s0, D, scale, free, kappa, dst, dst_k, dst_c, DP, BLOCK_S)


@triton.jit
def _balanced_rows(
    src, stride_s, stride_d, n, D, scale, free, kappa, dst, dst_k, dst_c, DP: tl.constexpr, BLOCK_S: tl.constexpr
):
    """The balanced codes of a program's rows (n of them left in the head from src), a block of 16 keys at a time
    (`_balanced_keys`, free[j] the j-th block's keys that may move), each thread all 16 keys of its channels. The
    codes go to dst, dst_k apart from key to key and dst_c from channel to channel; no row past n is read or
    written."""
    cols = tl.arange(0, DP)
    keys = tl.arange(0, _BALANCE_KEYS)
    coff = cols * stride_d
    cmask = cols < D
    for j in range(BLOCK_S // _BALANCE_KEYS):
        k0 = j * _BALANCE_KEYS
        y = _load_keys(src + k0 * stride_s, stride_s, coff, n - k0, cmask, scale, DP)
        # (the masks from L2: the one-pass kernel's pass 1 of another program stored them during this launch)
        moves = tl.load(free + j, mask=k0 < n, other=0, cache_modifier=".cg")
        y8 = _balanced_keys(y, moves, kappa).to(tl.float8e4nv)
        ok = cmask[:, None] & (k0 + keys < n)[None, :]
        tl.store(dst + (k0 + keys[None, :]) * dst_k + cols[:, None] * dst_c, y8, mask=ok)


@triton.jit
def _plain_codes(
    x,
    R,
    inv_sqrt,
    scale,
    out,
    s0,
    S,
    D,
    b,
    h,
    H,
    SKP,
    k_major,
    DP: tl.constexpr,
    BN: tl.constexpr,
    ROTATE: tl.constexpr,
    TERMS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    EVICT: tl.constexpr = _NO_HINT,
):
    """Each code the nearest e4m3 of its (rotated) value times the scale, BN columns at a time; EVICT
    the stores' L2 eviction priority."""
    rows = s0 + tl.arange(0, BLOCK_S)
    dst = out + ((b.to(tl.int64) * S + s0) * H + h) * D + tl.arange(0, BLOCK_S)[:, None] * (H * D)
    for c0 in range(0, DP, BN):
        y = tl.clamp(_columns(x, R, c0, inv_sqrt, DP, BN, ROTATE, TERMS) * scale, -_E4M3_MAX, _E4M3_MAX)
        cols = c0 + tl.arange(0, BN)
        ok = (rows < S)[:, None] & (cols < D)[None, :]
        y8 = y.to(tl.float8e4nv)
        if k_major:
            dst_k = out + ((b.to(tl.int64) * H + h) * D + cols[None, :]) * SKP + rows[:, None]
            tl.store(dst_k, y8, mask=ok, eviction_policy=EVICT)
        else:
            tl.store(dst + cols[None, :], y8, mask=ok, eviction_policy=EVICT)


@triton.jit
def _key_row(src, stride_s, coff, n, cmask, scale, k: tl.constexpr):
    """Key k of the block (k < n, else 0) times the scale, clamped to e4m3's range: [DP] float32."""
    x = tl.load(src + k * stride_s + coff, mask=cmask & (k < n), other=0.0)
    return tl.clamp(x.to(tl.float32) * scale, -_E4M3_MAX, _E4M3_MAX)


@triton.jit
def _keys2(src, stride_s, coff, n, cmask, scale, k: tl.constexpr, step: tl.constexpr):
    return tl.join(
        _key_row(src, stride_s, coff, n, cmask, scale, k), _key_row(src, stride_s, coff, n, cmask, scale, k + step)
    )


@triton.jit
def _keys4(src, stride_s, coff, n, cmask, scale, k: tl.constexpr, step: tl.constexpr):
    return tl.join(
        _keys2(src, stride_s, coff, n, cmask, scale, k, 2 * step),
        _keys2(src, stride_s, coff, n, cmask, scale, k + step, 2 * step),
    )


@triton.jit
def _keys8(src, stride_s, coff, n, cmask, scale, k: tl.constexpr, step: tl.constexpr):
    return tl.join(
        _keys4(src, stride_s, coff, n, cmask, scale, k, 2 * step),
        _keys4(src, stride_s, coff, n, cmask, scale, k + step, 2 * step),
    )


@triton.jit
def _load_keys(src, stride_s, coff, n, cmask, scale, DP: tl.constexpr):
    """The block's 16 keys as (DP, 16) float32, each thread all 16 keys of its channels: tl.join puts its new
    dimension inside each thread, and joining keys k and k + step at every level (odd keys last) makes the
    row-major reshape the keys' order, so every reduction over the keys stays in registers and a K-major store
    is one 16-byte run per channel."""
    keys = tl.join(
        _keys8(src, stride_s, coff, n, cmask, scale, 0, 2), _keys8(src, stride_s, coff, n, cmask, scale, 1, 2)
    )
    return tl.reshape(keys, [DP, _BALANCE_KEYS])
