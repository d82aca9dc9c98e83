"""The normalised Hadamard rotation of the quantiser: the orthonormal matrix (torch) and its product on the
tensor cores inside the quantiser passes (`_columns`, called by kernels/quantize.py's Triton passes).

Rotating Q and K by the same orthonormal matrix leaves QK^T unchanged and spreads an outlier entry over its
row's channels. The kernel multiplies by the +-1 Sylvester matrix (block-diagonal where the head dim is not a
power of two) and then by 1/sqrt(block) once, so every product is exact (`_columns`).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

__all__ = ["hadamard_matrix", "rotation_block"]


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
    h = torch.block_diag(*[_sylvester(block) / block**0.5] * (dim // block))
    return h.to(device=device, dtype=dtype)


@functools.lru_cache(maxsize=32)
def _pm1_matrix(d: int, device: torch.device) -> torch.Tensor:
    """`hadamard_matrix(d)` times sqrt(block): +-1 blocks, zero-padded to the next power of two, bf16."""
    dp = triton.next_power_of_2(d)
    block = rotation_block(d)
    out = torch.zeros(dp, dp, dtype=torch.float64)
    out[:d, :d] = torch.block_diag(*[_sylvester(block)] * (d // block))
    return out.to(device=device, dtype=torch.bfloat16)


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
