"""`zyfa_tune.attention`, the call model code makes: bf16 Q, K, V in, quantised inside the call with the
recipe its database entry names, that entry's FP8 kernel run on the codes. Timed whole, beside
FA3-fp8 with the plain quantiser inside its call (`--quant end-to-end`), so that the ratio is what a
model gains per layer; its row names the recipe and kernel (`explain_attention`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from zyfa_tune.bench.inputs import Inputs
from zyfa_tune.bench.peers.base import Bound, boxed
from zyfa_tune.bench.peers.ours import borrowed_from
from zyfa_tune.bench.shape import BenchShape


@dataclass(frozen=True)
class Attention:
    """Ours, an FP8 system given bf16 inputs: only end-to-end mode gives every FP8 system those (its
    peers quantising inside their calls too) and checks errors against the unquantised inputs."""

    name: str
    dtype: ClassVar[str] = "fp8"
    kind: ClassVar[str] = "ours"
    quant_modes: ClassVar[tuple[str, ...]] = ("end-to-end",)

    def supports(self, shape: BenchShape) -> bool:
        return True

    def prepare(self, x: Inputs) -> Bound:
        from zyfa_tune.attention import attention, explain_attention

        if not x.timed_quant:
            raise ValueError(f"{self.name}: quantises inside its call; it runs with --quant end-to-end")
        q, k, v = x.q16, x.k16, x.v16
        choice = explain_attention(q, k, v, causal=True)
        call, output = boxed(lambda: attention(q, k, v, causal=True))
        kernel = choice.kernel
        return Bound(
            call,
            output,
            kernel.config.to_json(),
            kernel.source,
            borrowed_from(kernel),
            recipe=choice.recipe.summary(),
        )
