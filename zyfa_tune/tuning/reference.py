"""The one float64 reference attention every check in the project compares against."""

from __future__ import annotations

import torch

from zyfa_tune.quantize import dequantize

#: rows of queries per float64 chunk: bounds memory to chunk * seqlen_k * 8 bytes per head
_CHUNK = 1024
_DESCALES = ("q_descale", "k_descale", "v_descale")


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
    window_size: tuple[int, int] = (-1, -1),
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Float64 attention on (batch, seqlen, heads, dim) inputs, on the inputs' device.

    Descales are (batch, kv_heads) float tensors multiplied into the dequantised inputs, as in
    FlashAttention-3. Causal masking is bottom-right aligned (query i sees keys j <= i + Sk - Sq);
    window_size=(left, right) as FlashAttention-3's (keys i + Sk - Sq - left <= j <= i + Sk - Sq +
    right, -1 unbounded, causal makes right 0); a query row that sees no key yields zeros. Returns
    float64 (batch, seqlen_q, heads, dim_v); with return_lse also the natural-log sum of exp(scores)
    (batch, heads, seqlen_q), -inf for a row that sees no key.
    """
    b, sq, h, dqk = q.shape
    sk, hk, dv = k.shape[1], k.shape[2], v.shape[3]
    group = h // hk
    scale = dqk**-0.5 if softmax_scale is None else float(softmax_scale)
    qf, kf, vf = dequantize(q, q_descale), dequantize(k, k_descale), dequantize(v, v_descale)
    out = torch.zeros(b, sq, h, dv, dtype=torch.float64, device=q.device)
    lse = torch.full((b, h, sq), float("-inf"), dtype=torch.float64, device=q.device)
    key_idx = torch.arange(sk, device=q.device)
    for hi in range(h):
        kh, vh = kf[:, :, hi // group], vf[:, :, hi // group]  # (b, sk, d)
        for r0 in range(0, sq, _CHUNK):
            r1 = min(sq, r0 + _CHUNK)
            s = torch.einsum("bqd,bkd->bqk", qf[:, r0:r1, hi], kh) * scale
            hidden = _hidden(torch.arange(r0, r1, device=q.device) + (sk - sq), key_idx, causal, window_size)
            if hidden is not None:
                s = s.masked_fill(hidden, float("-inf"))
            if return_lse:
                lse[:, hi, r0:r1] = torch.logsumexp(s, dim=-1)
            p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # fully masked rows -> zeros
            out[:, r0:r1, hi] = torch.einsum("bqk,bkd->bqd", p, vh)
    return (out, lse) if return_lse else out


def _hidden(diag: torch.Tensor, keys: torch.Tensor, causal: bool, window: tuple[int, int]) -> torch.Tensor | None:
    """(rows, keys) mask of the keys a row does not see; `diag`: each row's i + Sk - Sq."""
    left, right = window
    if causal:
        right = 0
    hidden = None
    if right >= 0:
        hidden = keys[None, :] > diag[:, None] + right
    if left >= 0:
        before = keys[None, :] < diag[:, None] - left
        hidden = before if hidden is None else hidden | before
    return hidden


def attention_reference_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    return_lse: bool = False,
    **options,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`attention_reference` over packed sequences (FlashAttention-3's varlen layout): q (total_q,
    heads, dim), k and v (total_k, kv_heads, dim), cumulative lengths (batch + 1,), descales
    (batch, kv_heads). Each sequence is its own batch of one (causal masks and windows align to its
    own lengths); `options` are attention_reference's. Returns float64 (total_q, heads, dim_v); with
    return_lse also (heads, total_q)."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    h, dv = q.shape[1], v.shape[2]
    out = torch.zeros(q.shape[0], h, dv, dtype=torch.float64, device=q.device)
    lse = torch.full((h, q.shape[0]), float("-inf"), dtype=torch.float64, device=q.device)
    for i in range(len(cq) - 1):
        rows, keys = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        if cq[i + 1] == cq[i]:
            continue
        ds = {n: None if d is None else d[i : i + 1] for n, d in zip(_DESCALES, (q_descale, k_descale, v_descale))}
        got = attention_reference(q[None, rows], k[None, keys], v[None, keys], return_lse=True, **ds, **options)
        out[rows], lse[:, rows] = got[0][0], got[1][0]
    return (out, lse) if return_lse else out


def gather_pages(cache: torch.Tensor, page_table: torch.Tensor, cache_seqlens: torch.Tensor) -> list[torch.Tensor]:
    """Each sequence's keys (or values) from a paged cache (pages, page_size, kv_heads, dim): the first
    cache_seqlens[b] rows of its pages page_table[b] in order, as a (seqlen_k, kv_heads, dim) tensor."""
    page_size = cache.shape[1]
    out = []
    for pages, n in zip(page_table.tolist(), cache_seqlens.tolist()):
        used = torch.tensor(pages[: -(-n // page_size)], dtype=torch.long, device=cache.device)
        out.append(cache[used].flatten(0, 1)[:n])
    return out


def attention_reference_paged(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor | None = None,
    **options,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`attention_reference` with keys and values in a paged cache (FlashAttention-3's
    flash_attn_with_kvcache layout): k_cache / v_cache (pages, page_size, kv_heads, dim), page_table
    (batch, max_pages), cache_seqlens (batch,) keys per sequence. q is (batch, seqlen_q, heads, dim),
    or packed (total_q, heads, dim) with cu_seqlens_q; the queries are the last positions of each
    sequence's keys (bottom-right aligned). `options` are attention_reference_varlen's. Returns
    what attention_reference (or, packed, attention_reference_varlen) returns for those shapes."""
    ks, vs = gather_pages(k_cache, page_table, cache_seqlens), gather_pages(v_cache, page_table, cache_seqlens)
    cu_k = torch.tensor([0, *torch.tensor(cache_seqlens.tolist()).cumsum(0).tolist()], dtype=torch.int32)
    k, v = torch.cat(ks), torch.cat(vs)
    if cu_seqlens_q is not None:
        return attention_reference_varlen(q, k, v, cu_seqlens_q, cu_k, **options)
    b, sq = q.shape[:2]
    cu_q = torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32)
    got = attention_reference_varlen(q.flatten(0, 1), k, v, cu_q, cu_k, **options)
    if not options.get("return_lse"):
        return got.unflatten(0, (b, sq))
    out, lse = got
    return out.unflatten(0, (b, sq)), lse.unflatten(1, (b, sq)).transpose(0, 1)


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (NaN anywhere gives NaN)."""
    o = out.to(torch.float64)
    r = ref.to(torch.float64)
    return float(torch.linalg.vector_norm(o - r) / torch.linalg.vector_norm(r))


def max_abs_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.to(torch.float64) - ref.to(torch.float64)).abs().max())
