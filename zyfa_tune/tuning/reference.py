"""The one float64 reference attention every check in the project compares against."""

from __future__ import annotations

import torch

from zyfa_tune.quantize import dequantize

#: rows of queries per float64 chunk: bounds memory to chunk * seqlen_k * 8 bytes per head
_CHUNK = 1024


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Float64 attention on (batch, seqlen, heads, dim) inputs, on the inputs' device.

    Descales are (batch, kv_heads) float tensors multiplied into the dequantised inputs, as in
    FlashAttention-3. Causal masking is bottom-right aligned (query i sees keys j <= i + Sk - Sq);
    a query row that sees no key yields zeros. Returns float64 (batch, seqlen_q, heads, dim_v).
    """
    b, sq, h, dqk = q.shape
    sk, hk, dv = k.shape[1], k.shape[2], v.shape[3]
    group = h // hk
    scale = dqk**-0.5 if softmax_scale is None else float(softmax_scale)
    qf, kf, vf = dequantize(q, q_descale), dequantize(k, k_descale), dequantize(v, v_descale)
    out = torch.zeros(b, sq, h, dv, dtype=torch.float64, device=q.device)
    key_idx = torch.arange(sk, device=q.device)
    for hi in range(h):
        kh, vh = kf[:, :, hi // group], vf[:, :, hi // group]  # (b, sk, d)
        for r0 in range(0, sq, _CHUNK):
            r1 = min(sq, r0 + _CHUNK)
            s = torch.einsum("bqd,bkd->bqk", qf[:, r0:r1, hi], kh) * scale
            if causal:
                rows = torch.arange(r0, r1, device=q.device) + (sk - sq)
                s = s.masked_fill(key_idx[None, :] > rows[:, None], float("-inf"))
            p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # fully masked rows -> zeros
            out[:, r0:r1, hi] = torch.einsum("bqk,bkd->bqd", p, vh)
    return out


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (NaN anywhere gives NaN)."""
    o = out.to(torch.float64)
    r = ref.to(torch.float64)
    return float(torch.linalg.vector_norm(o - r) / torch.linalg.vector_norm(r))


def max_abs_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.to(torch.float64) - ref.to(torch.float64)).abs().max())
