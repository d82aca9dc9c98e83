"""V -> V^T for the FP8 P@V wgmma (which reads V K-major): one Triton kernel for both backends.

(B, Sk, Hkv, D) -> (B, Hkv, D, Skp), keys contiguous, Skp = Sk padded to 16 keys (16-byte TMA rows)
or, with `permute`, to 32 keys with the keys of every 32-key chunk stored in `key_permutation`
order (the Gluon kernel's v_permute: slot 16h + 4q + 2s + b holds key 16h + 8s + 2q + b, the order
in which a thread's QK^T accumulator registers are laid out). Padding keys are zeros.

Why a kernel: torch's permute().contiguous() of 1-byte elements ran at a fraction of the memory
bandwidth on the H200 (about 48 us of device time at B=4 S=1024 H=16; a gather with the key
permutation took 0.45 ms at 8K). Here each program reads a (keys x dims) tile with rows of dims
contiguous, and writes it transposed with keys contiguous; Triton's layout conversion between the
two goes through shared memory, so both sides are coalesced. The key permutation only reorders
which rows a program reads (each row is still one contiguous run of bytes).

Launch cost: the kernel is compiled once per specialisation and launched as a CompiledKernel
(kernels/fastlaunch.py), not through Triton's `kernel[grid]` binding on every call.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from .fastlaunch import Bound, run

#: Keys per program (a multiple of 32, so a permuted chunk never straddles two programs) and head
#: dims per program: 128 x 64 bytes of fp8 per tile, four warps.
BLOCK_K = 128
BLOCK_D = 64
NUM_WARPS = 4


@triton.jit
def _transpose_v_kernel(
    V,
    VT,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    SEQ_K,
    SEQ_KP,
    HKV,
    DIM: tl.constexpr,
    PERMUTE: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid_k = tl.program_id(0)
    bh = tl.program_id(1)
    pid_d = tl.program_id(2)
    slots = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    if PERMUTE:  # slot 16h + 4q + 2s + b of a 32-key chunk holds key 16h + 8s + 2q + b
        r = slots % 32
        keys = slots - r + (r & 16) + ((r >> 1) & 1) * 8 + ((r >> 2) & 3) * 2 + (r & 1)
    else:
        keys = slots
    dims = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    src = V + (bh // HKV).to(tl.int64) * stride_vb + (bh % HKV) * stride_vh
    tile = tl.load(
        src + keys[:, None] * stride_vs + dims[None, :] * stride_vd,
        mask=(keys < SEQ_K)[:, None] & (dims < DIM)[None, :],
        other=0.0,
    )
    dst = VT + bh.to(tl.int64) * DIM * SEQ_KP
    tl.store(
        dst + dims[:, None] * SEQ_KP + slots[None, :],
        tl.trans(tile),
        mask=(dims < DIM)[:, None] & (slots < SEQ_KP)[None, :],
    )


def transpose_v(v: torch.Tensor, permute: bool = False) -> torch.Tensor:
    """(B, Sk, Hkv, D) -> (B, Hkv, D, Sk) with keys contiguous and rows 16-byte aligned (TMA): a
    view when v is already stored that way (`quantize_fp8(..., v_layout="k_major")`) and no key
    permutation is asked, else a copy by the kernel above (torch ops for tensors not on a GPU).
    With `permute` the result is (B, Hkv, D, Skp): keys permuted within 32-key chunks, Skp = Sk
    padded to 32 with zero keys (the permuted padding must stay readable)."""
    if not permute:
        view = k_major_view(v)
        if view is not None:
            return view
    if v.device.type != "cuda":
        out = transpose_v_reference(v, permute)
    else:
        b, sk, hk, d = v.shape
        out = torch.empty(b, hk, d, padded_keys(sk, permute), dtype=v.dtype, device=v.device)
        _launch(v, out, permute)
    return out if permute else out[..., : v.shape[1]]


def bind_transpose(v: torch.Tensor, permute: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """`transpose_v(., permute)` for tensors of v's layout (shape, strides, dtype, device, 16-byte
    aligned pointers): the view, or an allocation and a direct launch of the compiled kernel."""
    if not permute and k_major_view(v) is not None:
        return k_major_view
    b, sk, hk, d = v.shape
    out = torch.empty(b, hk, d, padded_keys(sk, permute), dtype=v.dtype, device=v.device)
    grid, args, constexprs = _arguments(v, out, permute)
    return _BoundTranspose(
        _launch(v, out, permute),
        grid,
        v.device.index,
        tuple(out.shape),
        v.dtype,
        (*args[2:], *constexprs.values()),
        None if permute else sk,
    )


class _BoundTranspose:
    __slots__ = ("launch", "shape", "dtype", "tail", "keys")

    def __init__(
        self, compiled, grid: tuple, device: int, shape: tuple, dtype: torch.dtype, tail: tuple, keys: int | None
    ):
        self.launch = Bound(compiled, grid, device)
        self.shape, self.dtype, self.tail, self.keys = shape, dtype, tail, keys

    def __call__(self, v: torch.Tensor) -> torch.Tensor:
        out = torch.empty(self.shape, dtype=self.dtype, device=v.device)
        self.launch((v, out, *self.tail))
        return out if self.keys is None else out[..., : self.keys]


def k_major_view(v: torch.Tensor) -> torch.Tensor | None:
    """v's (B, Hkv, D, Sk) view when v is stored keys-fastest with 16-byte aligned rows, else None."""
    b, sk, hk, dv = v.shape
    vt = v.permute(0, 2, 3, 1)
    row = vt.stride(2)
    if (
        vt.stride(3) == 1
        and (row * v.element_size()) % 16 == 0
        and row >= sk
        and vt.stride(1) == dv * row
        and vt.stride(0) == hk * dv * row
        and v.data_ptr() % 16 == 0
    ):
        return vt
    return None


def padded_keys(sk: int, permute: bool) -> int:
    """Key stride of the V^T copy: a multiple of 16 (TMA rows of 16 bytes), of 32 when permuted."""
    unit = 32 if permute else 16
    return -(-sk // unit) * unit


def _arguments(v: torch.Tensor, out: torch.Tensor, permute: bool) -> tuple[tuple, tuple, dict]:
    b, sk, hk, d = v.shape
    skp = out.shape[3]
    grid = (triton.cdiv(skp, BLOCK_K), b * hk, triton.cdiv(d, BLOCK_D))
    args = (v, out, v.stride(0), v.stride(1), v.stride(2), v.stride(3), sk, skp, hk)
    return grid, args, dict(DIM=d, PERMUTE=bool(permute), BLOCK_K=BLOCK_K, BLOCK_D=BLOCK_D)


def _launch(v: torch.Tensor, out: torch.Tensor, permute: bool):
    """Write V^T of `v` into `out` (B, Hkv, D, Skp) contiguous; returns the CompiledKernel."""
    grid, args, constexprs = _arguments(v, out, permute)
    return run(
        ("transpose_v", v.shape[3], bool(permute)),
        _transpose_v_kernel,
        grid,
        args,
        constexprs,
        dict(num_warps=NUM_WARPS),
        v.device.index,
    )


def transpose_v_reference(v: torch.Tensor, permute: bool = False) -> torch.Tensor:
    """The same (B, Hkv, D, Skp) tensor with torch ops (CPU tensors, and the tests' reference)."""
    b, sk, hk, d = v.shape
    skp = padded_keys(sk, permute)
    bits = v.view(torch.uint8 if v.element_size() == 1 else torch.int16)  # copies and gathers of raw bits
    out = torch.zeros(b, hk, d, skp, dtype=bits.dtype, device=v.device)
    out[..., :sk] = bits.permute(0, 2, 3, 1)
    if permute:
        out = out[..., key_permutation(skp, v.device)]
    return out.view(v.dtype)


def key_permutation(n: int, device: torch.device | str | None = None) -> torch.Tensor:
    """slot -> key over [0, n) (n a multiple of 32): within each 32-key chunk, slot 16h + 4q + 2s + b
    holds key 16h + 8s + 2q + b."""
    slot = torch.arange(n, device=device)
    r = slot % 32
    return slot - r + (r & 16) + ((r >> 1) & 1) * 8 + ((r >> 2) & 3) * 2 + (r & 1)
