"""Per-(batch, kv head) FP8 quantisation of attention inputs: two Triton passes, optionally after
K's token mean is removed and after a Hadamard rotation of the head dim, and for V optionally with
rounding errors that cancel along the keys (`balanced_codes`).

Why a kernel: in torch ops each tensor went through float32 copies of itself (x.float(), |x|,
x / descale, the clamp) and, rotated, a float32 matmul: on the H200 at hd128 and 16K tokens x 32
heads, 2.7 ms for Q, K and V, more than the 2.1 ms attention it feeds (docs/PERF.md, session 24).
Here pass 1 reads a block of rows and folds its amax into its (batch, kv head)'s by an atomic max
(of non-negative floats: the result does not depend on the order); pass 2 makes the descale from it,
reads the rows again and writes their e4m3 codes. Only the codes (and the descales) are written.
Q, K and V that take the same passes share one launch of each (`quantize_tensors`: segments of one grid).

The numbers are the torch path's (`quantize_heads_reference`: the CPU path and the tests'
reference): descale = max(amax, 1e-12) * float32(1 / 448), codes = e4m3 round-to-nearest-even of
clamp(x * scale, -448, 448) with scale = float32(1 / descale) (IEEE division, once a program: a division
per element cost V's balanced pass about 8 instructions a code), so without the rotation the two are
bitwise equal. The rotation is a tensor-core product with the +-1 Sylvester matrix (block-diagonal where the
head dim is not a power of two, as `hadamard_matrix`), then one float32 multiply by 1/sqrt(block).
Rows are split into bf16 parts that sum to them exactly (one for bf16, two for fp16, three for
float32 and centred rows), so every product is exact and only the order of the float32 sums differs
from torch's matmul: a code can differ where x * scale lies within a float32 rounding of a
rounding boundary. A balanced V (`balanced_codes`) also needs to know which keys of a block may move
(from each key's largest |value|): pass 1 has the rows and writes that as a 16-bit mask a block (FREE,
(B, H, S / 16) int32), so pass 2 reads one int a block where it reduced over the head dim across threads.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .fastlaunch import Bound, run
from .transpose import padded_keys, transpose_v

E4M3_MAX = 448.0
_E4M3_MAX = tl.constexpr(E4M3_MAX)
#: descale = max(amax, 1e-12) times the float32 reciprocal of 448 (what torch's CUDA division by a scalar
#: computes; written out so that the CPU path, whose division by a scalar is exact, gives the same descales)
INV_E4M3_MAX = float(torch.tensor(1.0) / torch.tensor(E4M3_MAX))
_INV_E4M3_MAX = tl.constexpr(INV_E4M3_MAX)
AMAX_FLOOR = 1e-12
_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)
#: rows x padded head dim per program (4096 values: 32 a thread at four warps), at most 32 rows (at
#: hd64, 64-row blocks made ptxas spill the centred amax pass at 64 registers)
TILE = 4096
NUM_WARPS = 4
#: rotating: rows x padded head dim per program at eight warps (128 x 128, 64 x 256): each program reads
#: the whole +-1 matrix, so more rows a program means less of that traffic per row (the wgmma tile)
ROT_TILE, ROT_ROWS, ROT_WARPS = 16384, 128, 8
#: output columns per rotation product: the +-1 matrix's (padded dim x 64) slice is at most 64 KB
ROT_N = 64
#: dtypes the kernel reads as they are (others are made float32 first, as the torch path does), and the
#: bf16 parts a row of each splits into exactly for the rotation (8 significant bits a part)
_TERMS = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}
KERNEL_DTYPES = tuple(_TERMS)


@functools.lru_cache(maxsize=32)
def _sylvester(n: int) -> torch.Tensor:
    """The n x n +-1 Sylvester-Hadamard matrix (n a power of two), float64."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def rotation_block(dim: int) -> int:
    """Size of the Hadamard blocks on the diagonal: the largest power of two dividing `dim`."""
    if type(dim) is not int or dim <= 0:
        raise ValueError(f"dim: expected a positive head dim, got {dim!r}")
    return dim & -dim


def hadamard_matrix(dim: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Orthonormal (dim x dim) rotation: Sylvester-Hadamard blocks of the largest power of two
    dividing `dim` on the diagonal (96 -> three 32 x 32 blocks)."""
    block = rotation_block(dim)
    h = torch.block_diag(*[_sylvester(block) / block ** 0.5] * (dim // block))
    return h.to(device=device, dtype=dtype)


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
BALANCE_FIXED = 2.0 ** 22
#: sort key (uint32) of a code that cannot move: above every candidate's whichever way bit 31 is turned
BALANCE_DEAD = 0x7FFFFFFF
#: a step's winner is a candidate if its key less the direction bit is below this (a cost under 32.0's bits)
BALANCE_CANDIDATE = 0x42000000
#: a move's weighed cost (kappa (|d| - 2|e|), `balanced_codes`) is capped here, so that in units of 2^-22 it stays
#: under 2^30 (|d| + it, an int32); a block's error sum reaches 2^29 units only with codes near 448 all erring alike
BALANCE_COST_CAP = 256.0
#: kappa is at most this (`balance_weights`; finite, so kappa times a cost of 0, a tie, is 0)
BALANCE_WEIGHT_MAX = 2.0 ** 20
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
    lognormal and kappa = exp(sigma^2) - 1: 1.7 on Gaussian scores (sigma 1; session 48's emulation has its
    optimum at 2-4), 0.04 on flat rows, the cap on peaky ones (sigma 8: a few keys rule, their own errors
    are what counts, and balanced V then keeps nearest codes). sigma^2 is the mean over WEIGHT_SAMPLES
    queries of their scores' variance over WEIGHT_SAMPLES keys (every n-th token of each; one small batched
    product, the rows' means removed, so Q's and K's means drop out as in the softmax); a GQA group's kappa is
    its q heads' mean."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    (step_q, nq), (step_k, nk) = _weight_sample(sq), _weight_sample(sk)
    if q.device.type == "cuda":  # one launch (the torch ops below cost ~0.3 ms of host time a call)
        return _balance_weights_gpu(q, k, scale, step_q, nq, step_k, nk)
    qs = q[:, ::step_q][:, :nq].permute(0, 2, 1, 3)   # (b, h, nq, d)
    ks = k[:, ::step_k][:, :nk].permute(0, 2, 3, 1)   # (b, hk, d, nk)
    # float32 scores: rows with means of hundreds (channel outliers) keep their spread
    scores = torch.matmul(qs.float().reshape(b, hk, (h // hk) * nq, d), ks.float())
    sigma2 = scores.var(dim=3, unbiased=False).view(b, hk, h // hk, nq).mean(dim=3) * scale ** 2
    kappa = torch.expm1(sigma2.clamp(0.0, _SIGMA2_MAX)).mean(dim=2)
    return kappa.nan_to_num(BALANCE_WEIGHT_MAX).clamp(0.0, BALANCE_WEIGHT_MAX)


def _weight_sample(n: int) -> tuple[int, int]:
    """(step, count): `balance_weights` reads every step-th of n tokens, count of them (at most WEIGHT_SAMPLES)."""
    step = max(1, n // WEIGHT_SAMPLES)
    return step, min(WEIGHT_SAMPLES, -(-n // step))


def _balance_weights_gpu(q: torch.Tensor, k: torch.Tensor, scale: float, step_q: int, nq: int, step_k: int,
                         nk: int) -> torch.Tensor:
    """`balance_weights` on a GPU: `_kappa_kernel`, one program per (batch, kv head)."""
    b, _, h, d = q.shape
    hk = k.shape[2]
    out = torch.empty(b, hk, dtype=torch.float32, device=q.device)
    args = (q, k, out, nq, nk, step_q * q.stride(1), step_k * k.stride(1), q.stride(0), q.stride(2), q.stride(3),
            k.stride(0), k.stride(2), k.stride(3), h // hk, hk, d, float(scale) ** 2)
    consts = dict(BQ=_KAPPA_ROWS, BK=_KAPPA_KEYS)
    run(("balance_weights",), _kappa_kernel, (b, hk), args, consts, dict(num_warps=4, num_stages=1), q.device.index)
    return out


#: query rows and keys `_kappa_kernel` multiplies at a time (64 x 64 float32 scores over 4 warps)
_KAPPA_ROWS = 64
_KAPPA_KEYS = 64
#: head-dim columns it multiplies at a time (a loop over the head dim, not unrolled)
_KAPPA_COLS = tl.constexpr(32)
_SIGMA2_MAX_C = tl.constexpr(_SIGMA2_MAX)
_BALANCE_WEIGHT_MAX = tl.constexpr(BALANCE_WEIGHT_MAX)


@triton.jit
def _kappa_kernel(Q, K, OUT, NQ, NK, SQ_STEP, SK_STEP, sqb, sqh, sqd, skb, skh, skd, GROUP, HK, D, scale2,
                  BQ: tl.constexpr, BK: tl.constexpr):
    """kappa of one (batch, kv head) as `balance_weights`: per q head of the group the mean over NQ sampled
    queries (every SQ_STEP-th element row) of the variance of their float32 scores against NK sampled keys,
    times scale2; expm1 of it clamped; the group's mean, NaN to the cap, clamped to [0, cap]. The scores come
    BQ x BK at a time (TF32 x3 products: float32's precision) and each row's variance is merged chunk by chunk
    from the chunks' own means and centred sums (Chan et al.), so rows with means of hundreds keep their spread."""
    b, g = tl.program_id(0), tl.program_id(1)
    rows0, keys0 = tl.arange(0, BQ), tl.arange(0, BK)
    k_head = K + b.to(tl.int64) * skb + g * skh
    total = 0.0
    for j in range(GROUP):
        q_head = Q + b.to(tl.int64) * sqb + (g * GROUP + j) * sqh
        var_sum = 0.0
        for q0 in range(0, NQ, BQ):
            rows = q0 + rows0
            qmask = rows < NQ
            n = tl.zeros([BQ], dtype=tl.float32)
            mean = tl.zeros([BQ], dtype=tl.float32)
            m2 = tl.zeros([BQ], dtype=tl.float32)
            for k0 in range(0, NK, BK):
                keys = k0 + keys0
                kmask = keys < NK
                acc = tl.zeros([BQ, BK], dtype=tl.float32)
                for c0 in range(0, D, _KAPPA_COLS):   # (not unrolled: 256 columns would spill)
                    cols = c0 + tl.arange(0, _KAPPA_COLS)
                    qt = tl.load(q_head + rows[:, None].to(tl.int64) * SQ_STEP + cols[None, :] * sqd,
                                 mask=qmask[:, None] & (cols[None, :] < D), other=0.0)
                    kt = tl.load(k_head + keys[None, :].to(tl.int64) * SK_STEP + cols[:, None] * skd,
                                 mask=kmask[None, :] & (cols[:, None] < D), other=0.0)
                    acc = tl.dot(qt.to(tl.float32), kt.to(tl.float32), acc, input_precision="tf32x3")
                nc = tl.minimum(NK - k0, BK).to(tl.float32)
                mc = tl.sum(tl.where(kmask[None, :], acc, 0.0), axis=1) / nc
                dev = tl.where(kmask[None, :], acc - mc[:, None], 0.0)
                delta = mc - mean
                both = n + nc
                mean += delta * (nc / both)
                m2 += tl.sum(dev * dev, axis=1) + delta * delta * (n * nc / both)
                n = both
            var_sum += tl.sum(tl.where(qmask, m2 / NK, 0.0), axis=0)
        sigma2 = var_sum / NQ * scale2
        kappa = tl.exp(tl.minimum(tl.maximum(sigma2, 0.0), _SIGMA2_MAX_C)) - 1.0
        total += tl.where(sigma2 != sigma2, float("nan"), kappa)
    kappa = total / GROUP
    kappa = tl.where(kappa != kappa, _BALANCE_WEIGHT_MAX, tl.minimum(tl.maximum(kappa, 0.0), _BALANCE_WEIGHT_MAX))
    tl.store(OUT + b * HK + g, kappa)


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
    return torch.clamp_min(binade * 0.125, 2.0 ** -9)


def _free_keys(rows: torch.Tensor) -> torch.Tensor:
    """Which keys of each block may move, from their largest |values| `rows` (..., BALANCE_KEYS, ...) float32,
    keys on dim 2: each key's in fixed point against its block's largest's binade 2^E (2^(BALANCE_ROW_BITS - E),
    exact: a power of two; E floored so that the unit stays finite), times BALANCE_SKIP x BALANCE_KEYS, at least
    the block's sum. `_amax_kernel` computes the same from the same rows."""
    top = rows.amax(dim=2, keepdim=True)
    e = ((top.view(torch.int32) >> 23) & 0xFF).clamp_min(BALANCE_ROW_BITS + 1)
    unit = ((127 + BALANCE_ROW_BITS + 127 - e) << 23).view(torch.float32)      # 2^(BALANCE_ROW_BITS - (e - 127))
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
    ef = yb - qf                                         # the nearest code's error (exact)
    step = _e4m3_step(yb)
    alt = torch.copysign(qf + torch.copysign(step, ef), yb)   # the other neighbour (exact; a zero signed as y)
    err = (ef * BALANCE_FIXED).to(torch.int32)
    k = ((step.view(torch.int32) >> 23) & 0xFF) - 118    # step = 2^(k - 9), k in [0, 14]
    cost = (step - 2 * ef.abs()).view(torch.int32)     # >= 0 (|ef| <= step / 2): its bits order as it does
    pos = torch.arange(BALANCE_KEYS, dtype=torch.int32, device=y.device).view(1, 1, BALANCE_KEYS, 1, 1)
    key = (ef.view(torch.int32) & -(1 << 31)) | (cost & -256) | (k << 4) | pos
    rows = torch.zeros(b, n, h, dtype=torch.float32, device=y.device)
    rows[:, :s] = (y if x is None else x).float().abs().amax(dim=3)
    free = _free_keys(rows.view(b, n // BALANCE_KEYS, BALANCE_KEYS, h, 1)) & (ef != 0)
    key = torch.where(free, key, BALANCE_DEAD).to(torch.int64) & 0xFFFFFFFF     # uint32, in int64
    total = err.sum(dim=2, keepdim=True, dtype=torch.int32)
    kappa = torch.zeros(b, h, dtype=torch.float32, device=y.device) if weight is None else weight.float()
    kappa = kappa.view(b, 1, 1, h, 1)
    above = [torch.zeros_like(total, dtype=torch.int64) for _ in range(2)]     # per direction: last winner + 1
    moved = torch.zeros_like(total, dtype=torch.int64)                          # a bit per position
    for _ in range(BALANCE_STEPS):
        neg = total < 0            # wanted: codes whose error is below zero (bit 31), whose move raises the sum
        c = torch.where(neg, above[1], above[0])
        least = ((key + torch.where(neg, 1 << 31, 0) - c) & 0xFFFFFFFF).amin(dim=2, keepdim=True)
        win = (least + c) & 0xFFFFFFFF           # the winner's key less its direction bit
        # (a channel whose only unfrozen codes are this direction's earlier winners takes a wrapped one again:
        # valid, it moves only the sum, no code: no candidate is left in either direction)
        valid = win < BALANCE_CANDIDATE
        dk = torch.ones_like(total) << (((win >> 4) & 15) + 13).to(torch.int32)   # the winner's |d|
        apply = valid & (((dk + _weighed_cost(win, kappa)) >> 1) < total.abs())
        total = total + torch.where(apply, torch.where(neg, dk, -dk), 0)
        c = torch.where(valid, win + 1, c)
        above = [torch.where(neg, above[0], c), torch.where(neg, c, above[1])]
        moved |= torch.where(apply, 1 << (win & 15), 0)
    out = torch.where((moved >> pos) & 1 != 0, alt, qf)
    return out.view(b, n, h, d)[:, :s].to(torch.float8_e4m3fn)


def quantize_heads_reference(x: torch.Tensor, kv_heads: int, rotate: bool = False,
                             mean: torch.Tensor | None = None, balance: bool = False,
                             weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, S, H, D) floating -> (e4m3 codes (B, S, H, D), float32 descales (B, kv_heads)), one scale
    per kv head shared by its GQA group, in torch ops. `mean` (B, kv_heads, D) float32 is subtracted
    first (K smoothing), then the rows are rotated by `hadamard_matrix(D)` if `rotate`; `balance`
    rounds as `balanced_codes` (V) with kappa `weight` (B, kv_heads), else to nearest."""
    b, s, h, d = x.shape
    xf = x.float()
    if mean is not None:
        xf = xf - mean.view(b, 1, kv_heads, d).repeat_interleave(h // kv_heads, dim=2)
    if rotate:
        xf = xf @ hadamard_matrix(d, device=x.device)
    xf = xf.reshape(b, s, kv_heads, h // kv_heads, d)
    descale = xf.abs().amax(dim=(1, 3, 4)).clamp_min(AMAX_FLOOR) * INV_E4M3_MAX  # (b, kv_heads)
    scale = 1.0 / descale
    codes = (xf * scale.view(b, 1, kv_heads, 1, 1)).clamp(-E4M3_MAX, E4M3_MAX).view(b, s, h, d)
    if balance:   # kappa per (batch, kv head), each of its heads'
        weight = None if weight is None else weight.repeat_interleave(h // kv_heads, dim=1)
        codes = balanced_codes(codes, xf.view(b, s, h, d), weight)
    else:
        codes = codes.to(torch.float8_e4m3fn)
    return codes, descale.contiguous()


def quantize_heads(x: torch.Tensor, kv_heads: int, rotate: bool = False,
                   mean: torch.Tensor | None = None, balance: bool = False,
                   weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_heads_reference`'s result; on a GPU by the two passes below."""
    codes, descales = quantize_tensors(((x, rotate, mean),), kv_heads, balance_last=balance, balance_weight=weight)
    return codes[0], descales[0]


def quantize_tensors(items, kv_heads: int, k_major_last: bool = False,
                     balance_last: bool = False,
                     balance_weight: torch.Tensor | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(codes, descales) of each (x, rotate, mean) in `items` (at most three tensors of one batch size
    and kv head count), as `quantize_heads`. `k_major_last`: the last tensor's codes are written
    keys-fastest, a (B, S, H, D) view of a (B, H, D, Sp) buffer (Sp: S padded to 16 bytes, what
    transpose_v would make): the codes pass stores them there itself (transposed through shared
    memory), so the FP8 kernels' V^T costs no pass of its own. `balance_last`: the last tensor (V,
    neither rotated nor centred) is rounded as `balanced_codes`, alone in its launch (16-key programs), with
    kappa `balance_weight` ((B, kv_heads) float32, finite, >= 0; default 0).

    On a GPU, tensors that take the same compiled passes (head dim, dtype, options, last stride) are
    one launch per pass: each program finds its tensor from its index (quantize_fp8's plain Q, K and
    V: two launches in all). The amaxes of all tensors are one zeroed buffer and their descales
    views of one more. What depends only on the layouts is kept in a plan per layout: a call costs
    four allocations and the launches (host time: docs/PERF.md, session 25)."""
    if balance_last and (items[-1][1] or items[-1][2] is not None):
        raise ValueError("balance_last: the balanced tensor (V) cannot be rotated or centred")
    last = len(items) - 1
    b = items[0][0].shape[0]
    if balance_weight is not None and (balance_weight.shape != (b, kv_heads) or balance_weight.dtype != torch.float32):
        raise ValueError(f"balance_weight: expected float32 ({b}, {kv_heads}), got {balance_weight.dtype} "
                         f"{tuple(balance_weight.shape)}")
    if items[0][0].device.type != "cuda":
        out = [quantize_heads_reference(x, kv_heads, rotate, mean, balance_last and i == last, balance_weight)
               for i, (x, rotate, mean) in enumerate(items)]
        codes = [c for c, _ in out]
        if k_major_last:
            codes[-1] = transpose_v(codes[-1]).permute(0, 3, 1, 2)
        return codes, [d for _, d in out]
    if len(items) > MAX_SEGMENTS:
        raise ValueError(f"items: at most {MAX_SEGMENTS} tensors a call, got {len(items)}")
    xs = [x if x.dtype in KERNEL_DTYPES else x.float() for x, _, _ in items]
    means = [None if m is None else m.contiguous() for _, _, m in items]
    key = (kv_heads, xs[0].device.index, bool(k_major_last), bool(balance_last), *((x.shape, x.stride(), x.dtype, bool(r), m is not None,
                                            x.data_ptr() % 16 == 0, m is None or m.data_ptr() % 16 == 0)
                                           for x, (_, r, _), m in zip(xs, items, means)))
    plan = _plans.get(key)
    if plan is None:
        if len(_plans) >= PLAN_LIMIT:
            _plans.clear()
        plan = _plans[key] = _Plan(xs, [bool(r) for _, r, _ in items], [m is not None for m in means], kv_heads,
                                   last if k_major_last else -1, last if balance_last else -1)
    amax = torch.zeros(len(xs) * b * kv_heads, dtype=torch.float32, device=xs[0].device)
    descales = torch.empty(len(xs), b, kv_heads, dtype=torch.float32, device=xs[0].device)
    codes = [_codes_buffer(x, k_major_last and i == len(xs) - 1) for i, x in enumerate(xs)]
    free = weight = amax   # (placeholders where nothing is balanced)
    if balance_last:  # which keys of each block may move, pass 1 to pass 2 (every entry written by pass 1)
        free = torch.empty(b * xs[-1].shape[2] * (padded_keys(xs[-1].shape[1], False) // BALANCE_KEYS),
                           dtype=torch.int32, device=xs[0].device)
        weight = (torch.zeros(b, kv_heads, dtype=torch.float32, device=xs[0].device) if balance_weight is None
                  else balance_weight.contiguous())
    plan(xs, means, amax, descales, codes, free, weight)
    return codes, list(descales.unbind(0))


def _codes_buffer(x: torch.Tensor, k_major: bool) -> torch.Tensor:
    """The e4m3 codes of x (B, S, H, D): contiguous, or k_major the keys-fastest (B, S, H, D) view of a
    (B, H, D, Sp) buffer, whose base the codes pass writes (LAST_K_MAJOR)."""
    if not k_major:
        return torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    b, s, h, d = x.shape
    return torch.empty(b, h, d, padded_keys(s, False), dtype=torch.float8_e4m3fn,
                       device=x.device)[..., :s].permute(0, 3, 1, 2)


#: tensors one launch can take (Q, K and V)
MAX_SEGMENTS = 3
#: plans kept (one per layout of the call's tensors and option set: a prefill with varying lengths
#: makes one per length); beyond it the cache starts over
PLAN_LIMIT = 256
_plans: dict[tuple, "_Plan"] = {}


class _Plan:
    """The launches of one call layout: its tensors grouped by the compiled passes they take (a
    centred tensor alone: the mean is one argument)."""

    __slots__ = ("groups",)

    def __init__(self, xs: list, rotates: list, centres: list, kv_heads: int, k_major: int = -1,
                 balanced: int = -1):
        by_kind: dict[tuple, list[int]] = {}
        for i, (x, r, c) in enumerate(zip(xs, rotates, centres)):
            bal = i == balanced  # alone, as a centred tensor (its mean is one argument): its tiles are its own
            by_kind.setdefault((x.shape[3], x.dtype, x.stride(3), r, c, bal, i if c or bal else -1), []).append(i)
        # (items keep their order in a group, so the K-major tensor, the last item, is its group's last)
        self.groups = [_Group(xs, members, kv_heads, r, c, members[-1] == k_major, bal)
                       for (_, _, _, r, c, bal, _), members in by_kind.items()]

    def __call__(self, xs: list, means: list, amax: torch.Tensor, descales: torch.Tensor, codes: list,
                 free: torch.Tensor, weight: torch.Tensor) -> None:
        for group in self.groups:
            group(xs, means, amax, descales, codes, free, weight)


class _Group:
    """The two passes over up to three tensors (segments) of one head dim, dtype and option set: the
    grid and every argument that is not a tensor. The passes are compiled (through `run`) at the
    first call and launched directly (`Bound`) after it."""

    __slots__ = ("members", "grid", "tail", "consts", "options", "head", "amax_pass", "codes_pass")

    def __init__(self, xs: list, members: list[int], kv_heads: int, rotate: bool, centre: bool,
                 last_k_major: bool = False, balanced: bool = False):
        x0 = xs[members[0]]
        b, d = x0.shape[0], x0.shape[3]
        block_s, dp, bn, warps = _tiles(d, rotate, balanced)
        starts, fields = [0], []   # per segment: S, H, GROUP, stride_b, stride_s, stride_h
        for i in members:
            x = xs[i]
            starts.append(starts[-1] + triton.cdiv(x.shape[1], block_s) * b * x.shape[2])
            fields.append((x.shape[1], x.shape[2], x.shape[2] // kv_heads, *x.stride()[:3]))
        pad = MAX_SEGMENTS - len(members)   # unused segments repeat the first
        self.members = tuple(members + members[:1] * pad)
        fields += fields[:1] * pad
        self.grid = (starts[-1],)
        self.tail = (starts[1], starts[min(2, len(members))],            # P1, P2: where segments 1, 2 start
                     *(i * b * kv_heads for i in self.members),              # F0, F1, F2: their first scales
                     *(f[k] for k in range(6) for f in fields), x0.stride(3), d, rotation_block(d) ** -0.5,
                     padded_keys(xs[members[-1]].shape[1], False))  # SKP: the K-major buffer's key stride
        self.consts = dict(NSEG=len(members), DP=dp, BN=bn, BLOCK_S=block_s, CENTER=centre, ROTATE=rotate,
                           TERMS=3 if centre else _TERMS[x0.dtype], LAST_K_MAJOR=bool(last_k_major),
                           BALANCED=bool(balanced))
        self.options = dict(num_warps=warps, num_stages=1)
        self.head = (d, str(x0.dtype), centre, rotate, bool(last_k_major), bool(balanced))
        self.amax_pass = self.codes_pass = None

    def __call__(self, xs: list, means: list, amax: torch.Tensor, descales: torch.Tensor, codes: list,
                 free: torch.Tensor, weight: torch.Tensor) -> None:
        x0 = xs[self.members[0]]
        r = _pm1_matrix(x0.shape[3], x0.device) if self.consts["ROTATE"] else x0
        m = means[self.members[0]] if self.consts["CENTER"] else x0
        ins = (*(xs[i] for i in self.members), r, m, amax, free)
        outs = (descales, *(codes[i] for i in self.members))
        if self.amax_pass is None:   # first call: compile through Triton's path, then launch directly
            dev = x0.device.index
            self.amax_pass = Bound(run(("quantize_amax", *self.head), _amax_kernel, self.grid, (*ins, *self.tail),
                                       self.consts, self.options, dev), self.grid, dev)
            self.codes_pass = Bound(run(("quantize_codes", *self.head), _codes_kernel, self.grid,
                                        (*ins, weight, *outs, *self.tail), self.consts, self.options, dev),
                                    self.grid, dev)
        else:
            self.amax_pass((*ins, *self.tail, *self.consts.values()))
            self.codes_pass((*ins, weight, *outs, *self.tail, *self.consts.values()))


def _tiles(d: int, rotate: bool, balanced: bool = False) -> tuple[int, int, int, int]:
    """(rows per program, head dim padded to a power of two, columns per rotation step, warps).
    Balanced: one block of keys a program, each thread all its keys of one channel (DP / 32 warps)."""
    dp = triton.next_power_of_2(d)
    if rotate:
        return max(16, min(ROT_ROWS, ROT_TILE // dp)), dp, min(dp, ROT_N), ROT_WARPS
    if balanced:
        return BALANCE_KEYS, dp, dp, max(1, dp // 32)
    return max(16, min(32, TILE // dp)), dp, dp, NUM_WARPS


@functools.lru_cache(maxsize=32)
def _pm1_matrix(d: int, device: torch.device) -> torch.Tensor:
    """`hadamard_matrix(d)` times sqrt(block): +-1 blocks, zero-padded to the next power of two, bf16."""
    dp = triton.next_power_of_2(d)
    block = rotation_block(d)
    out = torch.zeros(dp, dp, dtype=torch.float64)
    out[:d, :d] = torch.block_diag(*[_sylvester(block)] * (d // block))
    return out.to(device=device, dtype=torch.bfloat16)


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
def _program_rows(X0, X1, X2, MEAN, P1, P2, F0, F1, F2, S0, S1, S2, H0, H1, H2, G0, G1, G2, SB0, SB1, SB2,
                  SS0, SS1, SS2, SH0, SH1, SH2, stride_d, D,
                  NSEG: tl.constexpr, DP: tl.constexpr, BLOCK_S: tl.constexpr, CENTER: tl.constexpr,
                  LOAD: tl.constexpr = True):
    """This program's tensor (segment: programs [0, P1) the first, [P1, P2) the second, then the
    third) and its rows there (a one-dimensional grid, row blocks of one head after another: no grid
    dimension limits batch x heads), the head dim padded to DP with zeros (as are rows past S);
    centred (float32) with CENTER, else in the input's dtype. Returns (rows, segment, batch, head,
    index of the (batch, kv head) in the amax and descale buffers, first row, S, H, GROUP, the block's
    first row's address and the row stride). LOAD=False: the rows are not loaded (x is 0; BALANCED loads
    its keys one by one)."""
    pid = tl.program_id(0)
    seg = 0
    if NSEG > 1:
        seg = (pid >= P1).to(tl.int32)
    if NSEG > 2:
        seg += (pid >= P2).to(tl.int32)
    pid -= _pick(seg, 0, P1, P2, NSEG)
    S = _pick(seg, S0, S1, S2, NSEG)
    H = _pick(seg, H0, H1, H2, NSEG)
    GROUP = _pick(seg, G0, G1, G2, NSEG)
    blocks = tl.cdiv(S, BLOCK_S)
    bh = pid // blocks
    b = bh // H
    h = bh % H
    kv = _pick(seg, F0, F1, F2, NSEG) + b * (H // GROUP) + h // GROUP
    s0 = (pid % blocks) * BLOCK_S
    rows = s0 + tl.arange(0, BLOCK_S)
    cols = tl.arange(0, DP)
    ok = (rows < S)[:, None] & (cols < D)[None, :]
    stride_s = _pick(seg, SS0, SS1, SS2, NSEG)
    src = _pick(seg, X0, X1, X2, NSEG) + b.to(tl.int64) * _pick(seg, SB0, SB1, SB2, NSEG) \
        + h.to(tl.int64) * _pick(seg, SH0, SH1, SH2, NSEG) + s0.to(tl.int64) * stride_s
    x = 0.0
    if LOAD:
        x = tl.load(src + tl.arange(0, BLOCK_S)[:, None] * stride_s + cols[None, :] * stride_d, mask=ok, other=0.0)
    if CENTER:  # (a centred segment is alone in its launch: its kv index is its own)
        mean = tl.load(MEAN + (kv - F0) * D + cols, mask=cols < D, other=0.0)
        x = tl.where(ok, x.to(tl.float32) - mean[None, :], 0.0)
    return x, seg, b, h, kv, s0, S, H, GROUP, src, stride_s


@triton.jit
def _columns(x, R, c0, inv_sqrt, DP: tl.constexpr, BN: tl.constexpr, ROTATE: tl.constexpr, TERMS: tl.constexpr):
    """Columns c0..c0+BN of the rows x rotated, or x itself (then BN = DP), float32. The rotation:
    x split into TERMS bf16 parts that add up to it exactly (1 for bf16 rows, 2 for fp16, 3 for
    float32), each times the +-1 matrix R on the tensor cores (exact products, float32 sums), times
    1/sqrt(block)."""
    if ROTATE:
        r = tl.load(R + tl.arange(0, DP)[:, None] * DP + (c0 + tl.arange(0, BN))[None, :])
        hi = x.to(tl.bfloat16)
        acc = tl.dot(hi, r, out_dtype=tl.float32)
        if TERMS > 1:
            rest = x.to(tl.float32) - hi.to(tl.float32)
            mid = rest.to(tl.bfloat16)
            acc = tl.dot(mid, r, acc)
            if TERMS > 2:
                acc = tl.dot((rest - mid.to(tl.float32)).to(tl.bfloat16), r, acc)
        return acc * inv_sqrt
    else:
        return x.to(tl.float32)


#: the segment starts and buffer offsets are not specialised on: one compiled kernel for any of them
_SEGMENT_ARGS = ["P1", "P2", "F0", "F1", "F2"]


@triton.jit
def _free_slot(b, h, H, s0, SKP):
    """Where the mask of the block of keys from s0 of (batch b, head h) sits in FREE: (B, H, SKP / 16)."""
    return (b.to(tl.int64) * H + h) * (SKP // _BALANCE_KEYS) + s0 // _BALANCE_KEYS


@triton.jit(do_not_specialize=_SEGMENT_ARGS)
def _amax_kernel(X0, X1, X2, R, MEAN, AMAX, FREE, P1, P2, F0, F1, F2, S0, S1, S2, H0, H1, H2, G0, G1, G2,
                 SB0, SB1, SB2, SS0, SS1, SS2, SH0, SH1, SH2, stride_d, D, inv_sqrt, SKP,
                 NSEG: tl.constexpr, DP: tl.constexpr, BN: tl.constexpr, BLOCK_S: tl.constexpr,
                 CENTER: tl.constexpr, ROTATE: tl.constexpr, TERMS: tl.constexpr, LAST_K_MAJOR: tl.constexpr,
                 BALANCED: tl.constexpr):
    x, seg, b, h, kv, s0, S, H, GROUP, _, _ = _program_rows(
        X0, X1, X2, MEAN, P1, P2, F0, F1, F2, S0, S1, S2, H0, H1, H2, G0, G1, G2, SB0, SB1, SB2, SS0, SS1, SS2,
        SH0, SH1, SH2, stride_d, D, NSEG, DP, BLOCK_S, CENTER)
    if ROTATE:
        m = 0.0
        for c0 in range(0, DP, BN):
            m = tl.maximum(m, tl.max(tl.abs(_columns(x, R, c0, inv_sqrt, DP, BN, ROTATE, TERMS))))
    elif BALANCED:  # and which keys may move (`_free_keys`; rows past S are 0), a bit each, for pass 2
        rows = tl.max(tl.abs(x.to(tl.float32)), axis=1)
        m = tl.max(rows)
        e = tl.maximum((m.to(tl.int32, bitcast=True) >> 23) & 0xFF, _BALANCE_ROW_BITS + 1)
        fixed = (rows * ((254 + _BALANCE_ROW_BITS - e) << 23).to(tl.float32, bitcast=True)).to(tl.int32)
        ok = fixed * (_BALANCE_SKIP * _BALANCE_KEYS) >= tl.sum(fixed)
        mask = tl.sum(tl.where(ok, 1 << tl.arange(0, BLOCK_S), 0))
        tl.store(FREE + _free_slot(b, h, H, s0, SKP), mask)
    else:
        m = tl.max(tl.abs(x.to(tl.float32)))
    tl.atomic_max(AMAX + kv, m, sem="relaxed")  # m >= 0: the result does not depend on the order


@triton.jit(do_not_specialize=_SEGMENT_ARGS)
def _codes_kernel(X0, X1, X2, R, MEAN, AMAX, FREE, WEIGHT, DESCALE, OUT0, OUT1, OUT2, P1, P2, F0, F1, F2, S0, S1, S2,
                  H0, H1, H2, G0, G1, G2, SB0, SB1, SB2, SS0, SS1, SS2, SH0, SH1, SH2, stride_d, D, inv_sqrt, SKP,
                  NSEG: tl.constexpr, DP: tl.constexpr, BN: tl.constexpr, BLOCK_S: tl.constexpr,
                  CENTER: tl.constexpr, ROTATE: tl.constexpr, TERMS: tl.constexpr, LAST_K_MAJOR: tl.constexpr,
                  BALANCED: tl.constexpr):
    """The codes of a block of rows. LAST_K_MAJOR: the last segment's go keys-fastest into its (B, H, D,
    SKP) buffer (V for the FP8 kernels' V^T, written by this pass instead of a copy after it).
    BALANCED: rounded as `balanced_codes` (V, alone in its launch, never rotated: one block of keys
    a program, BN = DP), kappa WEIGHT (B, kv heads) float32."""
    x, seg, b, h, kv, s0, S, H, GROUP, src, stride_s = _program_rows(
        X0, X1, X2, MEAN, P1, P2, F0, F1, F2, S0, S1, S2, H0, H1, H2, G0, G1, G2, SB0, SB1, SB2, SS0, SS1, SS2,
        SH0, SH1, SH2, stride_d, D, NSEG, DP, BLOCK_S, CENTER, not BALANCED)
    descale = tl.maximum(tl.load(AMAX + kv), _AMAX_FLOOR) * _INV_E4M3_MAX  # as the reference
    if (s0 == 0) & (h % GROUP == 0):
        tl.store(DESCALE + kv, descale)
    scale = tl.math.div_rn(tl.full([], 1.0, tl.float32), descale)
    out = _pick(seg, OUT0, OUT1, OUT2, NSEG)
    k_major = False
    if LAST_K_MAJOR:
        k_major = seg == NSEG - 1
    if BALANCED:  # keys one by one into registers, each thread all 16 keys of its channels (_balanced_keys)
        cols = tl.arange(0, DP)
        keys = tl.arange(0, _BALANCE_KEYS)
        free = tl.load(FREE + _free_slot(b, h, H, s0, SKP))
        kappa = tl.load(WEIGHT + b.to(tl.int64) * (H // GROUP) + h // GROUP)   # its (batch, kv head)'s
        y8 = _balanced_keys(_load_keys(src, stride_s, cols * stride_d, S - s0, cols < D, scale, DP), free, kappa)
        y8 = y8.to(tl.float8e4nv)
        ok = (cols < D)[:, None] & (s0 + keys < S)[None, :]
        if k_major:
            tl.store(out + ((b.to(tl.int64) * H + h) * D + cols[:, None]) * SKP + s0 + keys[None, :], y8, mask=ok)
        else:
            tl.store(out + ((b.to(tl.int64) * S + s0) * H + h) * D + keys[None, :] * (H * D) + cols[:, None], y8,
                     mask=ok)
    else:
        _plain_codes(x, R, inv_sqrt, scale, out, s0, S, D, b, h, H, SKP, k_major, DP, BN, ROTATE, TERMS, BLOCK_S)


@triton.jit
def _plain_codes(x, R, inv_sqrt, scale, out, s0, S, D, b, h, H, SKP, k_major, DP: tl.constexpr,
                 BN: tl.constexpr, ROTATE: tl.constexpr, TERMS: tl.constexpr, BLOCK_S: tl.constexpr):
    """Each code the nearest e4m3 of its (rotated) value times the scale, BN columns at a time."""
    rows = s0 + tl.arange(0, BLOCK_S)
    dst = out + ((b.to(tl.int64) * S + s0) * H + h) * D + tl.arange(0, BLOCK_S)[:, None] * (H * D)
    for c0 in range(0, DP, BN):
        y = tl.clamp(_columns(x, R, c0, inv_sqrt, DP, BN, ROTATE, TERMS) * scale, -_E4M3_MAX, _E4M3_MAX)
        cols = c0 + tl.arange(0, BN)
        ok = (rows < S)[:, None] & (cols < D)[None, :]
        y8 = y.to(tl.float8e4nv)
        if k_major:
            tl.store(out + ((b.to(tl.int64) * H + h) * D + cols[None, :]) * SKP + rows[:, None], y8, mask=ok)
        else:
            tl.store(dst + cols[None, :], y8, mask=ok)


@triton.jit
def _key_row(src, stride_s, coff, n, cmask, scale, k: tl.constexpr):
    """Key k of the block (k < n, else 0) times the scale, clamped to e4m3's range: [DP] float32."""
    x = tl.load(src + k * stride_s + coff, mask=cmask & (k < n), other=0.0)
    return tl.clamp(x.to(tl.float32) * scale, -_E4M3_MAX, _E4M3_MAX)


@triton.jit
def _keys2(src, stride_s, coff, n, cmask, scale, k: tl.constexpr, step: tl.constexpr):
    return tl.join(_key_row(src, stride_s, coff, n, cmask, scale, k),
                   _key_row(src, stride_s, coff, n, cmask, scale, k + step))


@triton.jit
def _keys4(src, stride_s, coff, n, cmask, scale, k: tl.constexpr, step: tl.constexpr):
    return tl.join(_keys2(src, stride_s, coff, n, cmask, scale, k, 2 * step),
                   _keys2(src, stride_s, coff, n, cmask, scale, k + step, 2 * step))


@triton.jit
def _keys8(src, stride_s, coff, n, cmask, scale, k: tl.constexpr, step: tl.constexpr):
    return tl.join(_keys4(src, stride_s, coff, n, cmask, scale, k, 2 * step),
                   _keys4(src, stride_s, coff, n, cmask, scale, k + step, 2 * step))


@triton.jit
def _load_keys(src, stride_s, coff, n, cmask, scale, DP: tl.constexpr):
    """The block's 16 keys as (DP, 16) float32, each thread all 16 keys of its channels: tl.join puts its new
    dimension inside each thread, and joining keys k and k + step at every level (odd keys last) makes the
    row-major reshape the keys' order, so every reduction over the keys stays in registers and a K-major store
    is one 16-byte run per channel."""
    keys = tl.join(_keys8(src, stride_s, coff, n, cmask, scale, 0, 2),
                   _keys8(src, stride_s, coff, n, cmask, scale, 1, 2))
    return tl.reshape(keys, [DP, _BALANCE_KEYS])


@triton.jit
def _balanced_keys(y, free, kappa):
    """`balanced_codes` of one block of keys, (channels, keys) as _load_keys lays it out (rows past S and padded
    columns zero), `free` the keys that may move (a bit each, pass 1's `_free_keys`), `kappa` its (batch, kv
    head)'s weight: the same arithmetic (`_weighed_cost` too), so the same codes; returns each element's chosen
    neighbour as float32 (its e4m3 conversion is exact). No code is read as a byte (Triton 3.6 gave a wrong byte
    for one element in eight when e4m3 codes were bitcast to uint8 and widened, session 44): the other neighbour
    is y's nearest plus the step, from y's exponent bits."""
    SIGN: tl.constexpr = -2147483648
    qf = y.to(tl.float8e4nv).to(tl.float32)
    ef = y - qf
    binade = (y.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    step = tl.maximum(binade * 0.125, 0.001953125)                           # _e4m3_step
    sbits = step.to(tl.int32, bitcast=True)
    alt = (qf + (sbits | (ef.to(tl.int32, bitcast=True) & SIGN)).to(tl.float32, bitcast=True))   # + copysign
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
        off = (total & SIGN).to(tl.uint32, bitcast=True) - c      # bit 31 turned so that the wanted are below
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
