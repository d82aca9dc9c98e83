"""FP8 quantisation of attention inputs with per-(batch, kv-head) descales, optionally after a
normalised Hadamard rotation of Q and K (QK^T is unchanged, outliers are spread over channels) or
K smoothing. The arithmetic is kernels/quantize.py's: Triton passes on a GPU, torch ops elsewhere."""

from __future__ import annotations

import torch

from zyfa_tune.kernels.quantize import (
    BALANCE_WEIGHT_MAX,
    E4M3_MAX,
    KERNEL_DTYPES,
    balance_weights,
    hadamard_matrix,
    quantize_packed,
    quantize_tensors,
)

__all__ = ["E4M3_MAX", "V_ROUNDINGS", "dequantize_fp8", "hadamard_matrix", "quantize_fp8", "quantize_fp8_varlen"]

#: how `quantize_fp8` rounds V: to nearest (as FlashAttention-3's users do), or balanced along the keys
V_ROUNDINGS = ("nearest", "balanced")


def quantize_fp8(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    hadamard: bool = False,
    v_layout: str = "natural",
    smooth_k: bool = False,
    v_rounding: str = "nearest",
    softmax_scale: float | None = None,
    v_weight: float | None = None,
):
    """Return (q8, k8, v8, q_descale, k_descale, v_descale) for `flash_attn_func`.

    Inputs are (batch, seqlen, heads, dim) floating tensors of one dtype and device; descales are
    float32 (batch, kv_heads) as FlashAttention-3 expects (the q heads of one GQA group share one
    descale). With `hadamard=True`, Q and K are first multiplied by the same orthonormal Hadamard matrix.
    `smooth_k=True` first subtracts K's mean over tokens (per batch, kv head and channel): q.mean(k)
    is the same for every key of a query row, so softmax, and the attention output, are unchanged in
    exact arithmetic, while the nearly constant outlier channels of real keys, which otherwise set the
    FP8 scale and leave the rest of K a few codes, are removed (SageAttention's K smoothing; on the
    `outliers` input family it cuts the input-quantisation error ~9x: docs/results.md). k8 is
    then the smoothed K. Hadamard rotation does not help that family (it spreads Q's constant outlier
    channels into every channel); it helps outliers in random entries.
    `v_layout="k_major"` writes v8 keys-fastest: still a (batch, seqlen, kv_heads, dim) tensor, but
    a view of a (batch, kv_heads, dim, seqlen) buffer (rows padded to 16 bytes), written so by the
    quantisation pass itself (no extra pass). FP8 kernels read V that way (the P@V wgmma wants V
    K-major); given it, `flash_attn_func` skips its V^T copy (key-relabelling Gluon kernels then
    relabel the keys on K: k_perm, where the key count is a multiple of 16).
    `v_rounding="balanced"` rounds V so that, per channel and block of 16 keys, the rounding errors
    cancel (`kernels.balanced_v.balanced_codes`: a few codes a block go to their other e4m3 neighbour).
    P's rows average V's keys with a positive mean weight, which round to nearest leaves adding up:
    V's part of the error falls by about a third on Gaussian rows, most of it on flat rows
    (docs/results.md). The descales and the other tensors are unchanged and the attention costs the
    same; V's pass costs more (0.471 ms against 0.347 for Q, K and V of 16K tokens x 32 heads on the
    H100, 0.551 ms with kappa estimated: docs/results.md), hence opt-in. A move is made only where
    the squared error sum it removes outweighs kappa times the code's own squared error it adds: rows
    that a few keys rule (peaky scores) need each key's own error small, flat rows only the sums.
    `v_weight` sets kappa; by default it is estimated per (batch, kv head) from the spread of Q K^T
    (`kernels.balanced_v.balance_weights`, at `softmax_scale`, default 1/sqrt(head_dim)): 1.7 on
    Gaussian scores, so large on peaky ones that no code moves; 0 moves every code that shrinks a sum.
    """
    if v_layout not in ("natural", "k_major"):
        raise ValueError(f"v_layout: expected 'natural' or 'k_major', got {v_layout!r}")
    if v_rounding not in V_ROUNDINGS:
        raise ValueError(f"v_rounding: expected one of {V_ROUNDINGS}, got {v_rounding!r}")
    _check_floating(q, k, v, "(batch, seqlen, heads, head_dim)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.numel() == 0:
            raise ValueError(
                f"{name}: expected a non-empty tensor (each (batch, kv head) needs a scale), got shape {tuple(t.shape)}"
            )
    if not q.device == k.device == v.device:
        raise ValueError(f"q/k/v: expected tensors on one device, got {q.device}, {k.device}, {v.device}")
    if not q.shape[0] == k.shape[0] == v.shape[0]:
        raise ValueError(f"q/k/v: expected one batch size, got {q.shape[0]}, {k.shape[0]}, {v.shape[0]}")
    hk = k.shape[2]
    if v.shape[2] != hk or q.shape[2] % hk:
        raise ValueError(f"k/v: kv_heads={hk} (v has {v.shape[2]}) must divide q's heads={q.shape[2]}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"k: head_dim {k.shape[3]} differs from q's {q.shape[3]}")
    if not isinstance(smooth_k, bool) or not isinstance(hadamard, bool):
        raise TypeError("hadamard, smooth_k: expected bool")
    number = lambda x: isinstance(x, (int, float)) and not isinstance(x, bool)
    if softmax_scale is not None and not (number(softmax_scale) and 0 < softmax_scale < float("inf")):
        raise ValueError(f"softmax_scale: expected a number in (0, inf) or None, got {softmax_scale!r}")
    if v_weight is not None and not (number(v_weight) and 0 <= v_weight <= BALANCE_WEIGHT_MAX):
        raise ValueError(f"v_weight: expected a number in [0, {BALANCE_WEIGHT_MAX:g}] or None, got {v_weight!r}")
    weight = None
    if v_rounding == "balanced":
        weight = (
            balance_weights(q, k, softmax_scale)
            if v_weight is None
            else torch.full((q.shape[0], hk), float(v_weight), dtype=torch.float32, device=q.device)
        )
    mean = None
    if smooth_k:  # (batch, kv_heads, dim), float32 like the rest of the arithmetic
        mean = (k if k.dtype in KERNEL_DTYPES else k.float()).mean(dim=1, dtype=torch.float32).contiguous()
    (q8, k8, v8), (qd, kd, vd) = quantize_tensors(
        ((q, hadamard, None), (k, hadamard, mean), (v, False, None)),
        hk,
        k_major_last=v_layout == "k_major",
        balance_last=v_rounding == "balanced",
        balance_weight=weight,
    )
    return q8, k8, v8, qd, kd, vd


def _check_floating(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str) -> None:
    """q, k and v: tensors with the dims `layout` names, of one floating dtype (q's)."""
    dims = layout.count(",") + 1
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != dims:
            raise ValueError(f"{name}: expected {dims} dims {layout}, got {tuple(t.shape)}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name}: expected a floating dtype, got {t.dtype}")
        if t.dtype != q.dtype:
            raise TypeError(f"{name}: dtype {t.dtype} differs from q's {q.dtype}")


def quantize_fp8_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor
):
    """Return (q8, k8, v8, q_descale, k_descale, v_descale) for `flash_attn_varlen_func`: packed
    (total, heads, dim) floating tensors of one dtype and device, sequence i rows cu_seqlens[i]:
    cu_seqlens[i + 1] (int32 (batch + 1,) cumulative lengths on that device). `quantize_fp8`'s plain
    recipe (round to nearest, natural V) with one scale per (sequence, kv head), so that one
    sequence's outliers do not coarsen another's codes: each sequence's codes and descales are
    bitwise `quantize_fp8`'s on that sequence alone; an empty sequence's descale is the floor's
    (1e-12 / 448). Descales float32 (batch, kv_heads). On a GPU: one launch per pass for Q, K and V
    together (per head dim where Q/K's and V's differ) and no read of the lengths on the host, so a
    call is CUDA-graph capturable; the lengths are trusted (flash_attn_varlen_func checks them),
    and bad ones never move a load or store outside the tensors."""
    _check_floating(q, k, v, "(total_tokens, heads, head_dim)")
    for name, t in (("k", k), ("v", v)):
        if t.device != q.device:
            raise ValueError(f"{name}: on {t.device}, but q is on {q.device}")
    hk = k.shape[1]
    if v.shape[:2] != k.shape[:2] or hk == 0 or q.shape[1] % hk:
        raise ValueError(
            f"k/v: expected (total_k, kv_heads) alike with kv_heads dividing q's heads={q.shape[1]}, "
            f"got k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"k: head_dim {k.shape[2]} differs from q's {q.shape[2]}")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or cu.shape[0] < 1:
            got = f"{cu.dtype} {tuple(cu.shape)}" if isinstance(cu, torch.Tensor) else type(cu).__name__
            raise TypeError(f"{name}: expected an int32 tensor of shape (batch + 1,), got {got}")
        if cu.device != q.device:
            raise ValueError(f"{name}: on {cu.device}, but q is on {q.device}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_k: {cu_seqlens_k.shape[0]} entries, cu_seqlens_q {cu_seqlens_q.shape[0]}")
    (q8, k8, v8), (qd, kd, vd) = quantize_packed(((q, cu_seqlens_q), (k, cu_seqlens_k), (v, cu_seqlens_k)), hk)
    return q8, k8, v8, qd, kd, vd


def dequantize_fp8(x8: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    """float64 values of one of `quantize_fp8`'s outputs: the codes times their (batch, kv head)
    descale, the q heads of a GQA group sharing their kv head's. A Hadamard-rotated or smoothed
    input comes back rotated or smoothed (attention on them is unchanged)."""
    b, _, h, _ = x8.shape
    if descale.dim() != 2 or descale.shape[0] != b or h % descale.shape[1]:
        raise ValueError(f"descale: expected (batch={b}, kv_heads dividing heads={h}), got {tuple(descale.shape)}")
    return dequantize(x8, descale)


def dequantize(x: torch.Tensor, descale: torch.Tensor | None) -> torch.Tensor:
    """x (batch, seqlen, heads, dim) in float64 times its (batch, kv_heads) descale, the heads of a GQA
    group sharing their kv head's (x as it is where descale is None)."""
    xf = x.to(torch.float64)
    if descale is None:
        return xf
    b, _, h, _ = x.shape
    return xf * descale.to(torch.float64).repeat_interleave(h // descale.shape[1], dim=1).view(b, 1, h, 1)
