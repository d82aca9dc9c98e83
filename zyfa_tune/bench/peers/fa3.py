"""FlashAttention-3 (the `fa3_fwd_interface` wheel), FP8 or BF16: the peer the FP8 kernels are tuned
against. It takes the same arguments as our `flash_attn_func`, descales included. FA3 ships kernels for
the head dims COMMON_HEAD_DIMS; another width runs zero-padded to FA3's next head dim inside the timed
call (`padded`). FLOPs are counted on the true head dims (BenchShape.flops)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from zyfa_tune.bench.inputs import QUANT_MODES, Inputs
from zyfa_tune.bench.peers.base import Bound, boxed
from zyfa_tune.bench.shape import BenchShape
from zyfa_tune.tuning.fa3 import padded


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
