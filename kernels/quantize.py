"""Per-(batch, kv head) FP8 quantisation of attention inputs: two Triton passes, optionally after
K's token mean is removed and after a Hadamard rotation of the head dim.

Why a kernel: in torch ops each tensor went through float32 copies of itself (x.float(), |x|,
x / descale, the clamp) and, rotated, a float32 matmul: on the H200 at hd128 and 16K tokens x 32
heads, 2.7 ms for Q, K and V, more than the 2.1 ms attention it feeds (docs/PERF.md, session 24).
Here pass 1 reads a block of rows and folds its amax into its (batch, kv head)'s by an atomic max
(of non-negative floats: the result does not depend on the order); pass 2 makes the descale from it,
reads the rows again and writes their e4m3 codes. Only the codes (and the descales) are written.

The numbers are the torch path's (`quantize_heads_reference`: the CPU path and the tests'
reference): descale = max(amax, 1e-12) * float32(1 / 448), codes = e4m3 round-to-nearest-even of
clamp(x / descale, -448, 448) with IEEE division, so without the rotation the two are bitwise
equal. The rotation is a tensor-core product with the +-1 Sylvester matrix (block-diagonal where the
head dim is not a power of two, as `hadamard_matrix`), then one float32 multiply by 1/sqrt(block).
Rows are split into bf16 parts that sum to them exactly (one for bf16, two for fp16, three for
float32 and centred rows), so every product is exact and only the order of the float32 sums differs
from torch's matmul: a code can differ where x / descale lies within a float32 rounding of a
rounding boundary.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .fastlaunch import run

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


def quantize_heads_reference(x: torch.Tensor, kv_heads: int, rotate: bool = False,
                             mean: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, S, H, D) floating -> (e4m3 codes (B, S, H, D), float32 descales (B, kv_heads)), one scale
    per kv head shared by its GQA group, in torch ops. `mean` (B, kv_heads, D) float32 is subtracted
    first (K smoothing), then the rows are rotated by `hadamard_matrix(D)` if `rotate`."""
    b, s, h, d = x.shape
    xf = x.float()
    if mean is not None:
        xf = xf - mean.view(b, 1, kv_heads, d).repeat_interleave(h // kv_heads, dim=2)
    if rotate:
        xf = xf @ hadamard_matrix(d, device=x.device)
    xf = xf.reshape(b, s, kv_heads, h // kv_heads, d)
    descale = xf.abs().amax(dim=(1, 3, 4)).clamp_min(AMAX_FLOOR) * INV_E4M3_MAX  # (b, kv_heads)
    codes = (xf / descale.view(b, 1, kv_heads, 1, 1)).clamp(-E4M3_MAX, E4M3_MAX)
    return codes.view(b, s, h, d).to(torch.float8_e4m3fn), descale.contiguous()


def quantize_heads(x: torch.Tensor, kv_heads: int, rotate: bool = False,
                   mean: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_heads_reference`'s result; on a GPU by the two passes below."""
    if x.device.type != "cuda":
        return quantize_heads_reference(x, kv_heads, rotate, mean)
    if x.dtype not in KERNEL_DTYPES:
        x = x.float()
    b, s, h, d = x.shape
    block_s, dp, bn, warps = _tiles(d, rotate)
    group = h // kv_heads
    grid = (triton.cdiv(s, block_s) * b * h,)
    rot = _pm1_matrix(d, x.device) if rotate else x
    centre = mean.contiguous() if mean is not None else x
    consts = dict(DP=dp, BN=bn, BLOCK_S=block_s, CENTER=mean is not None, ROTATE=bool(rotate),
                  TERMS=3 if mean is not None else _TERMS[x.dtype])
    common = (s, d, h, group, *x.stride(), rotation_block(d) ** -0.5)
    head = (d, str(x.dtype), mean is not None, bool(rotate))
    amax = torch.zeros(b, kv_heads, dtype=torch.float32, device=x.device)
    run(("quantize_amax", *head), _amax_kernel, grid, (x, rot, centre, amax, *common), consts,
        dict(num_warps=warps, num_stages=1), x.device.index)
    descale = torch.empty(b, kv_heads, dtype=torch.float32, device=x.device)
    codes = torch.empty(b, s, h, d, dtype=torch.float8_e4m3fn, device=x.device)
    run(("quantize_codes", *head), _codes_kernel, grid, (x, rot, centre, amax, descale, codes, *common), consts,
        dict(num_warps=warps, num_stages=1), x.device.index)
    return codes, descale


def _tiles(d: int, rotate: bool) -> tuple[int, int, int, int]:
    """(rows per program, head dim padded to a power of two, columns per rotation step, warps)."""
    dp = triton.next_power_of_2(d)
    if rotate:
        return max(16, min(ROT_ROWS, ROT_TILE // dp)), dp, min(dp, ROT_N), ROT_WARPS
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
def _program_rows(X, MEAN, S, D, H, GROUP, stride_b, stride_s, stride_h, stride_d,
                  DP: tl.constexpr, BLOCK_S: tl.constexpr, CENTER: tl.constexpr):
    """This program's rows (a one-dimensional grid, row blocks of one head after another: no grid
    dimension limits batch x heads), the head dim padded to DP with zeros (as are rows past S); centred
    (float32) with CENTER, else in the input's dtype. Returns (rows, batch, head, index of the (batch,
    kv head) in the descales, first row)."""
    blocks = tl.cdiv(S, BLOCK_S)
    bh = tl.program_id(0) // blocks
    b = bh // H
    h = bh % H
    kv = b * (H // GROUP) + h // GROUP
    s0 = (tl.program_id(0) % blocks) * BLOCK_S
    rows = s0 + tl.arange(0, BLOCK_S)
    cols = tl.arange(0, DP)
    ok = (rows < S)[:, None] & (cols < D)[None, :]
    src = X + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h + s0.to(tl.int64) * stride_s
    x = tl.load(src + tl.arange(0, BLOCK_S)[:, None] * stride_s + cols[None, :] * stride_d, mask=ok, other=0.0)
    if CENTER:
        mean = tl.load(MEAN + kv * D + cols, mask=cols < D, other=0.0)
        x = tl.where(ok, x.to(tl.float32) - mean[None, :], 0.0)
    return x, b, h, kv, s0


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


@triton.jit
def _amax_kernel(X, R, MEAN, AMAX, S, D, H, GROUP, stride_b, stride_s, stride_h, stride_d, inv_sqrt,
                 DP: tl.constexpr, BN: tl.constexpr, BLOCK_S: tl.constexpr, CENTER: tl.constexpr,
                 ROTATE: tl.constexpr, TERMS: tl.constexpr):
    x, b, h, kv = _program_rows(X, MEAN, S, D, H, GROUP, stride_b, stride_s, stride_h, stride_d, DP, BLOCK_S, CENTER)
    if ROTATE:
        m = 0.0
        for c0 in range(0, DP, BN):
            m = tl.maximum(m, tl.max(tl.abs(_columns(x, R, c0, inv_sqrt, DP, BN, ROTATE, TERMS))))
    else:
        m = tl.max(tl.abs(x.to(tl.float32)))
    tl.atomic_max(AMAX + kv, m, sem="relaxed")  # m >= 0: the result does not depend on the order


@triton.jit
def _codes_kernel(X, R, MEAN, AMAX, DESCALE, OUT, S, D, H, GROUP, stride_b, stride_s, stride_h, stride_d, inv_sqrt,
                  DP: tl.constexpr, BN: tl.constexpr, BLOCK_S: tl.constexpr, CENTER: tl.constexpr,
                  ROTATE: tl.constexpr, TERMS: tl.constexpr):
    x, b, h, kv, s0 = _program_rows(X, MEAN, S, D, H, GROUP, stride_b, stride_s, stride_h, stride_d, DP, BLOCK_S,
                                    CENTER)
    descale = tl.maximum(tl.load(AMAX + kv), _AMAX_FLOOR) * _INV_E4M3_MAX  # as the reference
    if (s0 == 0) & (h % GROUP == 0):
        tl.store(DESCALE + kv, descale)
    rows = s0 + tl.arange(0, BLOCK_S)
    dst = OUT + ((b.to(tl.int64) * S + s0) * H + h) * D + tl.arange(0, BLOCK_S)[:, None] * (H * D)
    for c0 in range(0, DP, BN):
        y = tl.clamp(tl.math.div_rn(_columns(x, R, c0, inv_sqrt, DP, BN, ROTATE, TERMS), descale),
                     -_E4M3_MAX, _E4M3_MAX)
        cols = c0 + tl.arange(0, BN)
        tl.store(dst + cols[None, :], y.to(tl.float8e4nv), mask=(rows < S)[:, None] & (cols < D)[None, :])
