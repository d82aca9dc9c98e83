"""zyfa-tune as an attention backend of Hugging Face transformers models.

    from zyfa_tune.integrations.transformers import register
    register()  # once per process
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="zyfa_tune", dtype=torch.bfloat16)

`register` adds `attention_forward` to transformers' `AttentionInterface`, which models whose
attention layers dispatch through it (Llama, Mistral, Qwen2 and most decoders since transformers
4.53) call with (module, query, key, value, attention_mask, scaling=..., dropout=..., **kwargs),
query/key/value (batch, heads, seqlen, head_dim), expecting ((batch, seqlen, heads, head_dim), weights).
It also registers transformers' flash-attention mask builder under the same name. Without a mask
builder of its name transformers builds no mask and passes None even for a padded batch, which would
let padding tokens be attended to; the flash-attention builder passes None for a causal batch without
padding and the (batch, kv_len) padding mask otherwise: exactly what the kernels can honour.

A call runs one of two ways:
- dense (no padding, no packing): `zyfa_tune.attention`, bf16 / fp16 in, quantised with the recipe
  the tuning databases chose for the shape within `error_budget`, FP8 kernel;
- packed: several sequences of different lengths in one call, given (as flash attention takes them)
  by a padding mask (the tokens are unpadded and the output padded back with zeros), by the
  `cu_seq_lens_q/_k` and `max_length_q/_k` keyword arguments (transformers'
  DataCollatorWithFlattening(return_flash_attn_kwargs=True) makes them), or by position ids that
  restart within a row (DataCollatorWithFlattening's default). The sequences run through
  `zyfa_tune.attention_varlen` in FP8: each is quantised with its own (sequence, kv head) descales, the
  plain recipe of `quantize_fp8` (round to nearest, no rotation; one launch per pass for Q, K and V),
  so that one sequence's outliers do not coarsen another's codes and packing a sequence changes its
  result no more than batching it does.
  The bf16 varlen kernels would skip the quantisation but give up FP8's speed, and a model's
  precision would then depend on whether its batch was packed.

Refused with an error naming the argument: float32 activations, dropout, gradients (the kernels are
forward-only), output_attentions, logit softcapping, attention sinks, a 4-D or other arbitrary mask,
and packed position ids over a KV-cache prefix. A sliding window (Mistral's, Gemma's sliding layers')
runs as the kernels' window_size, on the dense and the packed path alike. Finding the
packing reads values on the host (one synchronisation a layer, as flash attention's own
transformers path does); the dense path has none.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from zyfa_tune.api import ArgumentProblems
from zyfa_tune.attention import INPUT_DTYPES, attention, attention_varlen
from zyfa_tune.kernels.dispatch import FA3_PARITY

__all__ = ["attention_forward", "register"]

#: transformers' own backends, which `register` never replaces
_BUILT_IN = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3", "flash_attention_4")
#: keyword arguments that name packed sequences directly (all four or none)
_VARLEN_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def register(name: str = "zyfa_tune", *, error_budget: float = FA3_PARITY) -> str:
    """Register zyfa-tune's attention (and the flash-attention mask builder) under `name` with
    transformers; models then take `attn_implementation=name`. error_budget: as `zyfa_tune.attention`'s,
    for the dense path. Registering again replaces the earlier registration. Returns `name`."""
    if not isinstance(name, str) or not name or "/" in name or name.startswith("paged|"):
        raise ValueError(f"name: expected a non-empty attention name without '/' or a 'paged|' prefix, got {name!r}")
    if name in _BUILT_IN:
        raise ValueError(f"name: {name!r} is one of transformers' own attention implementations; choose another")
    if isinstance(error_budget, bool) or not isinstance(error_budget, (int, float)) or not error_budget > 0:
        raise ValueError(f"error_budget: expected a positive finite number, got {error_budget!r}")
    if not math.isfinite(error_budget):
        raise ValueError(f"error_budget: expected a positive finite number, got {error_budget!r}")
    interface, mask_interface, flash_mask = _transformers_registries()
    budget = float(error_budget)

    def zyfa_tune_attention(module, query, key, value, attention_mask, **kwargs):
        return attention_forward(module, query, key, value, attention_mask, error_budget=budget, **kwargs)

    interface.register(name, zyfa_tune_attention)
    mask_interface.register(name, flash_mask)
    return name


def _transformers_registries() -> tuple[type, type, Callable]:
    """transformers' attention and mask registries and its flash-attention mask builder (imported
    here, so that zyfa_tune imports without transformers)."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
    except ImportError as exc:
        raise ImportError(
            "zyfa_tune.integrations.transformers.register needs transformers >= 4.53 "
            "(AttentionInterface and AttentionMaskInterface): pip install 'zyfa-tune[hf]'"
        ) from exc
    return AttentionInterface, AttentionMaskInterface, flash_attention_mask


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    *,
    error_budget: float = FA3_PARITY,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function call: query (batch, heads, seqlen_q, head_dim), key and value
    (batch, kv_heads, seqlen_k, head_dim), bf16 or fp16; returns ((batch, seqlen_q, heads, head_dim_v)
    in query's dtype, None). Causal unless `is_causal=False` is passed or `module.is_causal` is False;
    causal masks are bottom-right aligned (a decode step's query sees every cached key). A
    `sliding_window` of W (as transformers' sliding layers pass it) lets a query see its own key and the
    W - 1 before it."""
    _refuse_unsupported(query, key, value, attention_mask, dropout, kwargs)
    causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if causal is None else causal)
    window = _window_size(kwargs.get("sliding_window"), key.shape[2])
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (batch, seqlen, heads, dim), FA3's layout
    segments = _segments(q, k, attention_mask, kwargs)
    if segments is None:
        out = attention(q, k, v, causal=causal, softmax_scale=scaling, window_size=window, error_budget=error_budget)
    else:
        out = _packed_attention(q, k, v, segments, scaling, causal, window, error_budget)
    return out, None


def _window_size(sliding_window: int | None, keys: int) -> tuple[int, int]:
    """transformers' `sliding_window` as FlashAttention's window_size. A window of W is W keys: the
    query's own and the W - 1 before it (transformers' sliding-window masks let query i see key j where
    i - W < j <= i), FlashAttention's (W - 1, 0); transformers' flash-attention path passes
    (W - 1, W - 1), causal masking making the right side 0, and so does this (a non-causal layer then
    sees W - 1 keys on either side, as there). (-1, -1) where the window holds all `keys`."""
    if sliding_window is None or keys <= sliding_window:
        return -1, -1
    return sliding_window - 1, sliding_window - 1


def _refuse_unsupported(query, key, value, attention_mask, dropout, kwargs: dict) -> None:
    """Everything the FP8 forward kernels cannot do, all reported at once."""
    problems = ArgumentProblems()
    if query.dtype not in INPUT_DTYPES:
        problems.add(
            TypeError,
            f"query: dtype {query.dtype}; zyfa_tune attention takes bfloat16 or float16 activations "
            "(load the model with dtype=torch.bfloat16)",
        )
    if dropout:
        problems.add(ValueError, f"dropout: {dropout}; zyfa_tune attention has no dropout (call model.eval())")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        problems.add(
            RuntimeError,
            "query: requires grad; zyfa_tune attention is forward-only (run under torch.inference_mode())",
        )
    if kwargs.get("output_attentions"):
        problems.add(
            ValueError,
            "output_attentions: zyfa_tune never forms the attention weights; use attn_implementation='eager'",
        )
    for name in ("softcap", "s_aux"):
        if kwargs.get(name) is not None:
            problems.add(ValueError, f"{name}: not supported by zyfa_tune attention")
    window = kwargs.get("sliding_window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        problems.add(
            ValueError, f"sliding_window: expected a positive int (keys in the window) or None, got {window!r}"
        )
    if attention_mask is not None and not (isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2):
        shape = tuple(attention_mask.shape) if hasattr(attention_mask, "shape") else type(attention_mask).__name__
        problems.add(
            ValueError,
            f"attention_mask: {shape}; zyfa_tune runs causal attention with (batch, kv_len) padding masks only "
            "(register() makes transformers pass those)",
        )
    problems.raise_any()


@dataclass(frozen=True)
class _Segments:
    """Packed sequences: the token rows of the flattened (batch * seqlen) query and key that take part
    (None: all of them) and flash attention's cumulative lengths and longest lengths over them."""

    rows_q: torch.Tensor | None
    rows_k: torch.Tensor | None
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int


def _segments(q: torch.Tensor, k: torch.Tensor, attention_mask, kwargs: dict) -> _Segments | None:
    """The packed sequences of a call, or None for a dense batch; flash attention's order: a padding
    mask, then explicit cumulative lengths, then position ids that restart."""
    if attention_mask is not None:
        return _unpadded(q, k, attention_mask)
    given = [kwargs.get(n) for n in _VARLEN_KWARGS]
    if any(g is not None for g in given):
        missing = [n for n, g in zip(_VARLEN_KWARGS, given) if g is None]
        if missing:
            raise ValueError(f"{', '.join(missing)}: missing; packed sequences need all of {', '.join(_VARLEN_KWARGS)}")
        cu_q, cu_k = (c.to(device=q.device, dtype=torch.int32) for c in given[:2])
        return _Segments(None, None, cu_q, cu_k, int(given[2]), int(given[3]))
    return _from_positions(q, k, kwargs.get("position_ids"))


def _unpadded(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor) -> _Segments:
    """A (batch, kv_len) padding mask (nonzero: a token) as packed sequences; queries are the mask's
    last seqlen_q columns (left padding, or a cache prefix, as flash attention reads it)."""
    b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
    if tuple(mask.shape) != (b, sk):
        raise ValueError(f"attention_mask: shape {tuple(mask.shape)}, expected (batch, kv_len) = {(b, sk)}")
    valid_k = mask.to(device=q.device, dtype=torch.bool)
    valid_q = valid_k[:, sk - sq :]
    lengths = torch.stack([valid_q.sum(1), valid_k.sum(1)]).to(torch.int32)  # (2, batch)
    cu = torch.nn.functional.pad(lengths.cumsum(1, dtype=torch.int32), (1, 0))
    max_q, max_k = lengths.amax(1).tolist()
    rows_q, rows_k = (m.flatten().nonzero().flatten() for m in (valid_q, valid_k))
    return _Segments(rows_q, rows_k, cu[0].contiguous(), cu[1].contiguous(), max_q, max_k)


def _from_positions(q: torch.Tensor, k: torch.Tensor, position_ids) -> _Segments | None:
    """Packed sequences from position ids (batch or 1, seqlen) that restart within a row: a sequence
    starts at each token holding the smallest position, as flash attention finds them; rows of
    plain consecutive positions are a dense batch (None)."""
    b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or sq == 1:
        return None
    if position_ids.shape[-1] != sq or position_ids.shape[0] not in (1, b):
        return None  # not one position per query token: not flash attention's packed form
    pos = position_ids.to(q.device).expand(b, sq)
    consecutive = pos == pos[:, :1] + torch.arange(sq, device=q.device)
    restarts, rows_start_at_min = torch.stack([~consecutive.all(), (pos[:, 0] == pos.min()).all()]).tolist()
    if not restarts:
        return None
    if sk != sq:
        raise ValueError(
            f"position_ids: restart within a row (packed sequences) while {sk} keys follow {sq} queries; "
            "packed sequences over a KV-cache prefix are not supported"
        )
    if not rows_start_at_min:
        raise ValueError("position_ids: packed rows must each start a sequence at the smallest position")
    starts = (pos.flatten() == pos.min()).nonzero().flatten().to(torch.int32)
    cu = torch.cat([starts, starts.new_tensor([b * sq])])
    return _Segments(None, None, cu, cu, int((cu[1:] - cu[:-1]).max()), int((cu[1:] - cu[:-1]).max()))


def _packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    s: _Segments,
    scaling: float | None,
    causal: bool,
    window: tuple[int, int],
    error_budget: float,
) -> torch.Tensor:
    """Packed sequences through `attention_varlen` (each sequence quantised on its own, FP8 varlen
    kernels); returns (batch, seqlen_q, heads, head_dim_v) in q's dtype, zeros at padding tokens."""
    b, sq, h, _ = q.shape
    dv = v.shape[3]
    qp, kp, vp = (t.reshape(-1, *t.shape[2:]) for t in (q, k, v))  # (batch * seqlen, heads, dim)
    if s.rows_q is not None:
        qp = qp.index_select(0, s.rows_q)
    if s.rows_k is not None:
        kp, vp = kp.index_select(0, s.rows_k), vp.index_select(0, s.rows_k)
    lengths = (s.cu_q, s.cu_k, s.max_q, s.max_k)
    out = attention_varlen(
        qp, kp, vp, *lengths, causal=causal, softmax_scale=scaling, window_size=window, error_budget=error_budget
    )
    if s.rows_q is not None:
        out = out.new_zeros(b * sq, h, dv).index_copy_(0, s.rows_q, out)
    return out.view(b, sq, h, dv)
