"""Balanced rounding of V (`quantize_fp8(..., v_rounding="balanced")`): e4m3 codes whose rounding errors
cancel per channel along each block of BALANCE_KEYS keys (`balanced_codes`, torch; `_balanced_keys`, the same
arithmetic inside the quantiser's codes pass), and kappa, the weight of a moved code's own error
(`balance_weights`, estimated from the spread of Q K^T: torch, or two Triton launches on a GPU).

All sums are integers in fixed point, so the result does not depend on summation order: a GPU gives the CPU's
codes bitwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fastlaunch import run

__all__ = [
    "BALANCE_COST_CAP",
    "BALANCE_FIXED",
    "BALANCE_KEYS",
    "BALANCE_ROW_BITS",
    "BALANCE_SKIP",
    "BALANCE_STEPS",
    "BALANCE_WEIGHT_MAX",
    "WEIGHT_SAMPLES",
    "balance_weights",
    "balanced_codes",
]

#: balanced rounding (V): keys per block whose rounding errors are made to cancel, per channel
BALANCE_KEYS = 16
#: candidate moves a block's channel examines: at most this many of its codes go to their other e4m3 neighbour
BALANCE_STEPS = 4
#: a key whose largest |value| times this is below the mean of its block's keys' largest keeps its nearest
#: codes (an attention sink's small value). The mean, not the block's largest: beside a key with one outlier
#: entry (FA3's test inputs put one in 12% of keys) the block's largest would freeze every ordinary key.
BALANCE_SKIP = 4
#: the keys' largest |values| are compared as int32 in units of 2^-20 of the block's largest's binade (< 2^21;
#: x 4 x 16 < 2^31): exact, so the block's mean does not depend on summation order, and of the unscaled rows, so
#: that pass 1 decides it before the descale is known
BALANCE_ROW_BITS = 20
#: errors are summed as int32 in units of 2^-22 (|error| <= 16, half e4m3's step at 448: a block's sum
#: stays under 2^30), exactly, so that the GPU and the CPU agree bitwise
BALANCE_FIXED = 2.0**22
#: sort key (uint32) of a code that cannot move: above every candidate's whichever way bit 31 is turned
BALANCE_DEAD = 0x7FFFFFFF
#: a step's winner is a candidate if its key less the direction bit is below this (a cost under 32.0's bits)
BALANCE_CANDIDATE = 0x42000000
#: a move's weighed cost (kappa (|d| - 2|e|), `balanced_codes`) is capped here, so that in units of 2^-22 it stays
#: under 2^30 (|d| + it, an int32); a block's error sum reaches 2^29 units only with codes near 448 all erring alike
BALANCE_COST_CAP = 256.0
#: kappa is at most this (`balance_weights`; finite, so kappa times a cost of 0, a tie, is 0)
BALANCE_WEIGHT_MAX = 2.0**20
_BALANCE_COST_CAP = tl.constexpr(BALANCE_COST_CAP)
_BALANCE_FIXED = tl.constexpr(BALANCE_FIXED)
_BALANCE_SKIP = tl.constexpr(BALANCE_SKIP)
_BALANCE_ROW_BITS = tl.constexpr(BALANCE_ROW_BITS)
_BALANCE_KEYS = tl.constexpr(BALANCE_KEYS)
_BALANCE_STEPS = tl.constexpr(BALANCE_STEPS)
_BALANCE_CANDIDATE = tl.constexpr(BALANCE_CANDIDATE)
_BALANCE_DEAD = tl.constexpr(BALANCE_DEAD)


#: queries and keys (every n-th) whose scores `balance_weights` reads per (batch, head): a 256 x 256 sample
WEIGHT_SAMPLES = 256
#: score variance (natural log units) above which kappa is the cap anyway (expm1 of it is over 2^20)
_SIGMA2_MAX = 30.0


def balance_weights(q: torch.Tensor, k: torch.Tensor, softmax_scale: float | None = None) -> torch.Tensor:
    """kappa for balanced V ((B, kv_heads) float32): how much a moved code's own squared error should count
    against its block's squared error sum, from how P spreads within a block of keys.

    Over P's rows a channel's error in O is sum_j p_j e_j, per block of keys pbar S + sum_j (p_j - pbar) e_j
    (S the block's error sum); with the fluctuations unrelated to the errors its mean square is
    E[pbar^2] S^2 + E[(p - pbar)^2] sum_j e_j^2, so a move should count its own squared error kappa =
    E[(p - pbar)^2] / E[pbar^2] times. For scores of variance sigma^2 (natural log) along a row, p is
    lognormal and kappa = exp(sigma^2) - 1: 1.7 on Gaussian scores (sigma 1; an emulation of the attention
    error has its optimum at 2-4), 0.04 on flat rows, the cap on peaky ones (sigma 8: a few keys rule, their own errors
    are what counts, and balanced V then keeps nearest codes). sigma^2 is the mean over WEIGHT_SAMPLES
    queries of their scores' variance over WEIGHT_SAMPLES keys (every n-th token of each; one small batched
    product, the rows' means removed, so Q's and K's means drop out as in the softmax); a GQA group's kappa is
    its q heads' mean."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = d**-0.5 if softmax_scale is None else softmax_scale
    (step_q, nq), (step_k, nk) = _weight_sample(sq), _weight_sample(sk)
    if q.device.type == "cuda":  # two launches (the torch ops below cost ~0.3 ms of host time a call)
        return _balance_weights_gpu(q, k, scale, step_q, nq, step_k, nk)
    qs = q[:, ::step_q][:, :nq].permute(0, 2, 1, 3)  # (b, h, nq, d)
    ks = k[:, ::step_k][:, :nk].permute(0, 2, 3, 1)  # (b, hk, d, nk)
    # float32 scores: rows with means of hundreds (channel outliers) keep their spread
    scores = torch.matmul(qs.float().reshape(b, hk, (h // hk) * nq, d), ks.float())
    sigma2 = scores.var(dim=3, unbiased=False).view(b, hk, h // hk, nq).mean(dim=3) * scale**2
    kappa = torch.expm1(sigma2.clamp(0.0, _SIGMA2_MAX)).mean(dim=2)
    return kappa.nan_to_num(BALANCE_WEIGHT_MAX).clamp(0.0, BALANCE_WEIGHT_MAX)


def _weight_sample(n: int) -> tuple[int, int]:
    """(step, count): `balance_weights` reads every step-th of n tokens, count of them (at most WEIGHT_SAMPLES)."""
    step = max(1, n // WEIGHT_SAMPLES)
    return step, min(WEIGHT_SAMPLES, -(-n // step))


def _balance_weights_gpu(
    q: torch.Tensor, k: torch.Tensor, scale: float, step_q: int, nq: int, step_k: int, nk: int
) -> torch.Tensor:
    """`balance_weights` on a GPU in two launches: `_kappa_part_kernel`, one program per (batch, q head, block of
    sampled queries, block of sampled keys), many enough to fill the GPU at batch 1 and each one product deep;
    then `_kappa_sum_kernel`, one per (batch, kv head), merges the key blocks' row statistics and sums the rows in a
    fixed order (no atomics: the same kappa every run). One buffer holds both: kappa first (padded to 16 bytes),
    then the partials, a (mean, centred sum of squares) pair of rows per program."""
    b, _, h, d = q.shape
    hk = k.shape[2]
    qb, kb = -(-nq // _KAPPA_ROWS), -(-nk // _KAPPA_KEYS)
    lead = -(-b * hk // 4) * 4
    buf = torch.empty(lead + b * h * qb * kb * 2 * _KAPPA_ROWS, dtype=torch.float32, device=q.device)
    out, part = buf[: b * hk], buf[lead:]
    args = (
        q,
        k,
        part,
        nq,
        nk,
        step_q * q.stride(1),
        step_k * k.stride(1),
        q.stride(0),
        q.stride(2),
        q.stride(3),
        k.stride(0),
        k.stride(2),
        k.stride(3),
        h // hk,
        d,
    )
    consts = dict(BQ=_KAPPA_ROWS, BK=_KAPPA_KEYS)
    opts = dict(num_warps=4, num_stages=1)
    run(("balance_weights", "part"), _kappa_part_kernel, (b, h * qb * kb), args, consts, opts, q.device.index)
    args = (part, out, qb, kb, h // hk, nq, nk, float(scale) ** 2)
    consts = dict(BQ=_KAPPA_ROWS, BK=_KAPPA_KEYS)
    opts = dict(num_warps=2, num_stages=1)
    run(("balance_weights", "sum"), _kappa_sum_kernel, (b * hk,), args, consts, opts, q.device.index)
    return out.view(b, hk)


#: query rows and keys `_kappa_part_kernel` multiplies at a time (64 x 64 float32 scores over 4 warps)
_KAPPA_ROWS = 64
_KAPPA_KEYS = 64
#: head-dim columns it multiplies at a time (a loop over the head dim, not unrolled)
_KAPPA_COLS = tl.constexpr(32)
#: blocks of sampled queries per q head at most (a head's rows `_kappa_sum_kernel` holds at once)
_KAPPA_BLOCKS = tl.constexpr(WEIGHT_SAMPLES // _KAPPA_ROWS)
_SIGMA2_MAX_C = tl.constexpr(_SIGMA2_MAX)
_BALANCE_WEIGHT_MAX = tl.constexpr(BALANCE_WEIGHT_MAX)


@triton.jit
def _kappa_part_kernel(
    Q,
    K,
    PART,
    NQ,
    NK,
    SQ_STEP,
    SK_STEP,
    sqb,
    sqh,
    sqd,
    skb,
    skh,
    skd,
    GROUP,
    D,
    BQ: tl.constexpr,
    BK: tl.constexpr,
):
    """One block of BQ sampled queries (every SQ_STEP-th element row) of one (batch, q head) against one block of
    BK of the NK sampled keys: each row's mean and centred sum of squares of its float32 scores there, to
    PART[batch, program] as two rows of BQ (`_kappa_sum_kernel` merges the key blocks). The scores come from
    TF32 x3 products (float32's precision), a head-dim slice at a time."""
    b, p = tl.program_id(0), tl.program_id(1)
    qb, kb = tl.cdiv(NQ, BQ), tl.cdiv(NK, BK)
    head = p // (qb * kb)
    rows = (p // kb - head * qb) * BQ + tl.arange(0, BQ)
    k0 = (p % kb) * BK
    qmask = rows < NQ
    q_head = Q + b.to(tl.int64) * sqb + head * sqh
    k_head = K + b.to(tl.int64) * skb + (head // GROUP) * skh
    keys = k0 + tl.arange(0, BK)
    kmask = keys < NK
    acc = tl.zeros([BQ, BK], dtype=tl.float32)
    for c0 in range(0, D, _KAPPA_COLS):  # (not unrolled: 256 columns would spill)
        cols = c0 + tl.arange(0, _KAPPA_COLS)
        qt = tl.load(
            q_head + rows[:, None].to(tl.int64) * SQ_STEP + cols[None, :] * sqd,
            mask=qmask[:, None] & (cols[None, :] < D),
            other=0.0,
        )
        kt = tl.load(
            k_head + keys[None, :].to(tl.int64) * SK_STEP + cols[:, None] * skd,
            mask=kmask[None, :] & (cols[:, None] < D),
            other=0.0,
        )
        acc = tl.dot(qt.to(tl.float32), kt.to(tl.float32), acc, input_precision="tf32x3")
    nc = tl.minimum(NK - k0, BK).to(tl.float32)
    mc = tl.sum(tl.where(kmask[None, :], acc, 0.0), axis=1) / nc
    dev = tl.where(kmask[None, :], acc - mc[:, None], 0.0)
    out = PART + (b.to(tl.int64) * tl.num_programs(1) + p) * 2 * BQ + tl.arange(0, BQ)
    tl.store(out, mc)
    tl.store(out + BQ, tl.sum(dev * dev, axis=1))


@triton.jit
def _kappa_sum_kernel(PART, OUT, QB, KB, GROUP, NQ, NK, scale2, BQ: tl.constexpr, BK: tl.constexpr):
    """kappa of one (batch, kv head) as `balance_weights` from `_kappa_part_kernel`'s partials (its GROUP q heads'
    QB x KB programs each, contiguous), a q head at a time: each sampled query's row statistics merged over the
    key blocks in order (Chan et al.: rows with means of hundreds keep their spread), the variances summed over
    the rows, over NQ times scale2, expm1 of it clamped; the heads' mean, NaN to the cap, clamped to [0, cap].
    Sums in a fixed order, so the result is the same every run."""
    i = tl.program_id(0)
    blocks, rows = tl.arange(0, _KAPPA_BLOCKS), tl.arange(0, BQ)
    mask = (blocks < QB)[:, None] & (blocks[:, None] * BQ + rows[None, :] < NQ)
    total = tl.zeros([], dtype=tl.float32)
    for g in range(0, GROUP):
        first = ((i.to(tl.int64) * GROUP + g) * QB + blocks[:, None]) * KB
        n = tl.zeros([_KAPPA_BLOCKS, BQ], dtype=tl.float32)
        mean = tl.zeros([_KAPPA_BLOCKS, BQ], dtype=tl.float32)
        m2 = tl.zeros([_KAPPA_BLOCKS, BQ], dtype=tl.float32)
        for j in range(0, KB):
            at = PART + (first + j) * 2 * BQ + rows[None, :]
            mc = tl.load(at, mask=mask, other=0.0)
            m2c = tl.load(at + BQ, mask=mask, other=0.0)
            nc = tl.minimum(NK - j * BK, BK).to(tl.float32)
            delta = mc - mean
            both = n + nc
            mean += delta * (nc / both)
            m2 += m2c + delta * delta * (n * nc / both)
            n = both
        per_block = tl.sum(tl.where(mask, m2 / NK, 0.0), axis=1)  # (the rows of each block of queries, then those)
        sigma2 = tl.sum(per_block, axis=0) / NQ * scale2
        kappa = tl.exp(tl.minimum(tl.maximum(sigma2, 0.0), _SIGMA2_MAX_C)) - 1.0
        total += tl.where(sigma2 != sigma2, float("nan"), kappa)
    kappa = total / GROUP
    kappa = tl.where(kappa != kappa, _BALANCE_WEIGHT_MAX, tl.minimum(tl.maximum(kappa, 0.0), _BALANCE_WEIGHT_MAX))
    tl.store(OUT + i, kappa)


def _weighed_cost(win: torch.Tensor, kappa: torch.Tensor) -> torch.Tensor:
    """kappa times the winner's cost (|d| - 2|e|, its key's float32 bits less the low 8) in units of 2^-22, int32,
    capped below 2^30: one float32 multiply, the cap, an exact power-of-two scale and a truncation, as
    `_balanced_keys` does, so that the GPU's codes are the CPU's."""
    cost = (win & 0x7FFFFF00).to(torch.int32).view(torch.float32)
    return (torch.clamp_max(kappa * cost, BALANCE_COST_CAP) * BALANCE_FIXED).to(torch.int32)


def _e4m3_step(y: torch.Tensor) -> torch.Tensor:
    """The spacing of the e4m3 codes that bracket each |y| (float32, <= 448): 2^(max(E, -6) - 3) for y's
    binade 2^E, whichever of the two is y's nearest (below a power of two the step is the lower binade's).
    `_balanced_keys` computes it the same way, from y's exponent bits."""
    binade = (y.view(torch.int32) & 0x7F800000).view(torch.float32)
    return torch.clamp_min(binade * 0.125, 2.0**-9)


def _free_keys(rows: torch.Tensor) -> torch.Tensor:
    """Which keys of each block may move, from their largest |values| `rows` (..., BALANCE_KEYS, ...) float32,
    keys on dim 2: each key's in fixed point against its block's largest's binade 2^E (2^(BALANCE_ROW_BITS - E),
    exact: a power of two; E floored so that the unit stays finite), times BALANCE_SKIP x BALANCE_KEYS, at least
    the block's sum. `_amax_kernel` computes the same from the same rows."""
    top = rows.amax(dim=2, keepdim=True)
    e = ((top.view(torch.int32) >> 23) & 0xFF).clamp_min(BALANCE_ROW_BITS + 1)
    unit = ((127 + BALANCE_ROW_BITS + 127 - e) << 23).view(torch.float32)  # 2^(BALANCE_ROW_BITS - (e - 127))
    fixed = (rows * unit).to(torch.int32)
    return fixed * (BALANCE_SKIP * BALANCE_KEYS) >= fixed.sum(dim=2, keepdim=True, dtype=torch.int32)


def balanced_codes(y: torch.Tensor, x: torch.Tensor | None = None, weight: torch.Tensor | None = None) -> torch.Tensor:
    """e4m3 codes of y (B, S, H, D) float32 in [-448, 448] whose rounding errors cancel along the keys. `x`:
    the unscaled values y came from (same shape), whose rows decide which keys may move (default y's).
    `weight` (B, H) float32 >= 0, kappa (default 0): how much a moved code's own squared error counts against
    the squared error sum it removes (`balance_weights`: P's spread within a block over its mean).

    Round to nearest leaves each channel's error summed over n keys growing as sqrt(n) ulps, and P's
    rows weight V's keys with a common positive mean: that sum is what the mean of P multiplies (on
    Gaussian scores 1/e of V's error in O, nearly all of it on flat rows). Here, per block of
    BALANCE_KEYS keys and channel, codes move to their other e4m3 neighbour, cheapest first (the one
    costing least squared error per unit of the sum: |d| - 2|e|), while that shrinks the block's error sum:
    each of BALANCE_STEPS steps takes the cheapest code that moves the sum towards zero and moves it if that
    removes more squared sum than kappa times the squared error it adds (|d| + kappa (|d| - 2|e|) < 2 |sum|; at
    kappa 0: if it does not overshoot), else passes over it for good (the sum only shrinks). A key far smaller
    than its block's keys on average (an attention sink's small value: one key weighted like thousands,
    where only its own error matters) is left at nearest (`_free_keys`).

    Each code's candidacy is one int32 sort key: its direction (the sign of its error, bit 31), its cost's
    float32 bits (non-negative: they order as the cost; the low 8 dropped) and in those low bits log2 of its
    step and its position in the block (unique: the first key wins a tie). A step is one add and one unsigned
    minimum per code: the add turns bit 31 so that the wanted direction's keys lie below the rest and subtracts
    that direction's last winner + 1, so that its earlier winners (all smaller: each was the least then) wrap to
    the top. The sum moves by the step read off the winner's key, and a bit per position records the moves
    (`_balanced_keys`, the GPU's, is this arithmetic). Errors are integers in units of 2^-22, so the result
    does not depend on summation order: a GPU gives the CPU's codes."""
    b, s, h, d = y.shape
    n = -(-s // BALANCE_KEYS) * BALANCE_KEYS
    yb = torch.zeros(b, n, h, d, dtype=torch.float32, device=y.device)
    yb[:, :s] = y
    yb = yb.view(b, n // BALANCE_KEYS, BALANCE_KEYS, h, d)
    qf = yb.to(torch.float8_e4m3fn).float()
    ef = yb - qf  # the nearest code's error (exact)
    step = _e4m3_step(yb)
    alt = torch.copysign(qf + torch.copysign(step, ef), yb)  # the other neighbour (exact; a zero signed as y)
    err = (ef * BALANCE_FIXED).to(torch.int32)
    k = ((step.view(torch.int32) >> 23) & 0xFF) - 118  # step = 2^(k - 9), k in [0, 14]
    cost = (step - 2 * ef.abs()).view(torch.int32)  # >= 0 (|ef| <= step / 2): its bits order as it does
    pos = torch.arange(BALANCE_KEYS, dtype=torch.int32, device=y.device).view(1, 1, BALANCE_KEYS, 1, 1)
    key = (ef.view(torch.int32) & -(1 << 31)) | (cost & -256) | (k << 4) | pos
    rows = torch.zeros(b, n, h, dtype=torch.float32, device=y.device)
    rows[:, :s] = (y if x is None else x).float().abs().amax(dim=3)
    free = _free_keys(rows.view(b, n // BALANCE_KEYS, BALANCE_KEYS, h, 1)) & (ef != 0)
    key = torch.where(free, key, BALANCE_DEAD).to(torch.int64) & 0xFFFFFFFF  # uint32, in int64
    total = err.sum(dim=2, keepdim=True, dtype=torch.int32)
    kappa = torch.zeros(b, h, dtype=torch.float32, device=y.device) if weight is None else weight.float()
    kappa = kappa.view(b, 1, 1, h, 1)
    above = [torch.zeros_like(total, dtype=torch.int64) for _ in range(2)]  # per direction: last winner + 1
    moved = torch.zeros_like(total, dtype=torch.int64)  # a bit per position
    for _ in range(BALANCE_STEPS):
        neg = total < 0  # wanted: codes whose error is below zero (bit 31), whose move raises the sum
        c = torch.where(neg, above[1], above[0])
        least = ((key + torch.where(neg, 1 << 31, 0) - c) & 0xFFFFFFFF).amin(dim=2, keepdim=True)
        win = (least + c) & 0xFFFFFFFF  # the winner's key less its direction bit
        # (a channel whose only unfrozen codes are this direction's earlier winners takes a wrapped one again:
        # valid, it moves only the sum, no code: no candidate is left in either direction)
        valid = win < BALANCE_CANDIDATE
        dk = torch.ones_like(total) << (((win >> 4) & 15) + 13).to(torch.int32)  # the winner's |d|
        apply = valid & (((dk + _weighed_cost(win, kappa)) >> 1) < total.abs())
        total = total + torch.where(apply, torch.where(neg, dk, -dk), 0)
        c = torch.where(valid, win + 1, c)
        above = [torch.where(neg, above[0], c), torch.where(neg, c, above[1])]
        moved |= torch.where(apply, 1 << (win & 15), 0)
    out = torch.where((moved >> pos) & 1 != 0, alt, qf)
    return out.view(b, n, h, d)[:, :s].to(torch.float8_e4m3fn)


@triton.jit
def _balanced_keys(y, free, kappa):
    """`balanced_codes` of one block of keys, (channels, keys) as _load_keys lays it out (rows past S and padded
    columns zero), `free` the keys that may move (a bit each, pass 1's `_free_keys`), `kappa` its (batch, kv
    head)'s weight: the same arithmetic (`_weighed_cost` too), so the same codes; returns each element's chosen
    neighbour as float32 (its e4m3 conversion is exact). No code is read as a byte (Triton 3.6 gave a wrong byte
    for one element in eight when e4m3 codes were bitcast to uint8 and widened): the other neighbour
    is y's nearest plus the step, from y's exponent bits."""
    SIGN: tl.constexpr = -2147483648
    qf = y.to(tl.float8e4nv).to(tl.float32)
    ef = y - qf
    binade = (y.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    step = tl.maximum(binade * 0.125, 0.001953125)  # _e4m3_step
    sbits = step.to(tl.int32, bitcast=True)
    alt = qf + (sbits | (ef.to(tl.int32, bitcast=True) & SIGN)).to(tl.float32, bitcast=True)  # + copysign
    alt = (alt.to(tl.int32, bitcast=True) | (y.to(tl.int32, bitcast=True) & SIGN)).to(tl.float32, bitcast=True)
    err = (ef * _BALANCE_FIXED).to(tl.int32)
    cost = (step - 2.0 * tl.abs(ef)).to(tl.int32, bitcast=True)
    k = ((sbits >> 23) & 0xFF) - 118
    key = (ef.to(tl.int32, bitcast=True) & SIGN) | (cost & -256) | (k << 4) | tl.arange(0, _BALANCE_KEYS)[None, :]
    bit = 1 << tl.arange(0, _BALANCE_KEYS)[None, :]
    key = tl.where(((free & bit) != 0) & (ef != 0), key, _BALANCE_DEAD)
    key = key.to(tl.uint32, bitcast=True)
    total = tl.sum(err, axis=1)
    above0 = tl.zeros_like(total).to(tl.uint32)
    above1 = above0
    moved = tl.zeros_like(total)
    for _ in tl.static_range(_BALANCE_STEPS):
        neg = total < 0
        c = tl.where(neg, above1, above0)
        off = (total & SIGN).to(tl.uint32, bitcast=True) - c  # bit 31 turned so that the wanted are below
        win = tl.min(key + off[:, None], axis=1) + c
        valid = win < _BALANCE_CANDIDATE
        dk = 1 << (((win >> 4) & 15).to(tl.int32) + 13)
        cost = (win & 0x7FFFFF00).to(tl.int32, bitcast=True).to(tl.float32, bitcast=True)
        weighed = (tl.minimum(kappa * cost, _BALANCE_COST_CAP) * _BALANCE_FIXED).to(tl.int32)
        apply = valid & (((dk + weighed) >> 1) < tl.abs(total))
        total += tl.where(apply, tl.where(neg, dk, -dk), 0)
        c = tl.where(valid, win + 1, c)
        above0 = tl.where(neg, above0, c)
        above1 = tl.where(neg, c, above1)
        moved |= tl.where(apply, 1 << (win & 15).to(tl.int32), 0)
    return tl.where((moved[:, None] & bit) != 0, alt, qf)
