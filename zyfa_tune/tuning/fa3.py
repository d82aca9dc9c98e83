"""FlashAttention-3 (the `fa3_fwd_interface` wheel) on any width the project emits. FA3 ships kernels
for the head dims COMMON_HEAD_DIMS and refuses FP8 widths that are not multiples of 16; another width
runs as a model would run it there: Q, K and V zero-padded to FA3's next head dim (the softmax scale
kept at the true width's), the output sliced back. The tuner's error gate and the bench's FA3 peers
call it the same way, so a width FA3 cannot run natively still has its reference."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from zyfa_tune.generator.config import COMMON_HEAD_DIMS


def fa3_width(dim: int) -> int:
    """FA3's head dim that runs a width of `dim` columns: the smallest it ships that holds them."""
    return next(d for d in COMMON_HEAD_DIMS if d >= dim)


def padded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn(q, k, v, **kw)` on Q, K, V zero-padded to FA3's widths (softmax scale of the true Q/K width),
    its output cut back to V's width; widths FA3 ships pass through untouched."""

    def pad(t: Any, width: int) -> Any:
        if t.shape[-1] == width:
            return t
        out = t.new_zeros(*t.shape[:-1], width)
        out[..., : t.shape[-1]] = t
        return out

    def call(q: Any, k: Any, v: Any, **kw: Any) -> Any:
        dqk, dv = q.shape[-1], v.shape[-1]
        if (fa3_width(dqk), fa3_width(dv)) == (dqk, dv):
            return fn(q, k, v, **kw)
        kw.setdefault("softmax_scale", dqk**-0.5)
        out = fn(pad(q, fa3_width(dqk)), pad(k, fa3_width(dqk)), pad(v, fa3_width(dv)), **kw)
        return (out[0][..., :dv], *out[1:]) if isinstance(out, tuple) else out[..., :dv]

    return call
