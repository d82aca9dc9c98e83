"""FlashAttention-3 (the `fa3_fwd_interface` wheel), FP8 or BF16: the peer the FP8 kernels are tuned
against. It takes the same arguments as our `flash_attn_func`, descales included. FA3 ships kernels for
the head dims COMMON_HEAD_DIMS; another width runs as a model would run it there: Q, K and V zero-padded
to FA3's next head dim inside the timed call (the scale kept at the true width's), the output sliced
back. FLOPs are counted on the true head dims (BenchShape.flops)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from zyfa_tune.bench.inputs import QUANT_MODES, Inputs
from zyfa_tune.bench.peers.base import Bound, boxed
from zyfa_tune.bench.shape import BenchShape
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


@dataclass(frozen=True)
class FA3:
    name: str
    dtype: str
    kind: ClassVar[str] = "peer"
    quant_modes: ClassVar[tuple[str, ...]] = QUANT_MODES

    def supports(self, shape: BenchShape) -> bool:
        return True

    def prepare(self, x: Inputs) -> Bound:
        from fa3_fwd_interface import flash_attn_func as fa3_func

        return Bound(
            *boxed(
                x.call(self.dtype, (), padded(lambda *a, **kw: fa3_func(*a, causal=True, **kw))),
                lambda r: r[0] if isinstance(r, tuple) else r,
            )
        )
