"""torch's scaled_dot_product_attention pinned to one backend (cuDNN or flash), BF16 only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from zyfa_tune.bench.inputs import QUANT_MODES, Inputs
from zyfa_tune.bench.peers.base import Bound, boxed
from zyfa_tune.bench.shape import BenchShape


@dataclass(frozen=True)
class TorchSDPA:
    name: str
    backend: str  # a torch.nn.attention.SDPBackend member's name, e.g. "FLASH_ATTENTION"
    dtype: ClassVar[str] = "bf16"
    kind: ClassVar[str] = "peer"
    quant_modes: ClassVar[tuple[str, ...]] = QUANT_MODES  # bf16: the same tensors in every mode

    def supports(self, shape: BenchShape) -> bool:
        return shape.head_dim_qk == shape.head_dim_v  # torch SDPA needs equal head dims

    def prepare(self, x: Inputs) -> Bound:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, self.backend)
        q, k, v = (t.transpose(1, 2) for t in (x.q16, x.k16, x.v16))
        gqa = q.shape[1] != k.shape[1]

        def run() -> torch.Tensor:
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

        return Bound(*boxed(run, lambda o: o.transpose(1, 2)))
