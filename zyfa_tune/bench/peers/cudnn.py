"""cuDNN's sdpa_fp8 graph (cudnn-frontend), given the per-tensor e4m3 codes and scalar descales."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from zyfa_tune.bench.inputs import Inputs
from zyfa_tune.bench.peers.base import Bound
from zyfa_tune.bench.shape import BenchShape


@dataclass(frozen=True)
class CudnnFP8:
    """Its codes are made outside its call, so it cannot take part in `--quant end-to-end`."""

    name: str
    dtype: ClassVar[str] = "fp8"
    kind: ClassVar[str] = "peer"
    quant_modes: ClassVar[tuple[str, ...]] = ("per-tensor", "native")

    def supports(self, shape: BenchShape) -> bool:
        return True

    def prepare(self, x: Inputs) -> Bound:
        """The graph built for this input set; its FP8 output is dequantised for the error."""
        import cudnn

        sh = x.shape
        qs, ks, vs = x.scales
        q, k, v = (t.permute(0, 2, 1, 3) for t in (x.q8, x.k8, x.v8))  # (b, h, s, d) views
        o = torch.empty(
            sh.batch, sh.seqlen, sh.heads, sh.head_dim_v, device=x.q8.device, dtype=torch.float8_e4m3fn
        ).permute(0, 2, 1, 3)
        scalars = {
            n: torch.full((1, 1, 1, 1), val, device=x.q8.device, dtype=torch.float32)
            for n, val in (("dq", qs), ("dk", ks), ("dv", vs), ("ds", 1.0), ("ss", 1.0), ("so", 1.0 / vs))
        }  # |o| <= max|v| = 448 * vs: fills the e4m3 range
        amax = {n: torch.zeros(1, 1, 1, 1, device=x.q8.device, dtype=torch.float32) for n in ("s", "o")}
        graph = cudnn.pygraph(
            io_data_type=cudnn.data_type.FP8_E4M3,
            intermediate_data_type=cudnn.data_type.FLOAT,
            compute_data_type=cudnn.data_type.FLOAT,
        )
        tq, tk, tv = graph.tensor_like(q), graph.tensor_like(k), graph.tensor_like(v)
        ts = {n: graph.tensor_like(t) for n, t in scalars.items()}
        to, _, ta_s, ta_o = graph.sdpa_fp8(
            q=tq,
            k=tk,
            v=tv,
            descale_q=ts["dq"],
            descale_k=ts["dk"],
            descale_v=ts["dv"],
            descale_s=ts["ds"],
            scale_s=ts["ss"],
            scale_o=ts["so"],
            is_inference=True,
            attn_scale=sh.head_dim_qk**-0.5,
            use_causal_mask=True,
            name="sdpa_fp8",
        )
        to.set_output(True).set_dim(list(o.shape)).set_stride(list(o.stride())).set_data_type(cudnn.data_type.FP8_E4M3)
        for t in (ta_s, ta_o):
            t.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(cudnn.data_type.FLOAT)
        graph.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        ws = torch.empty(max(1, graph.get_workspace_size()), device=x.q8.device, dtype=torch.uint8)
        pack = {tq: q, tk: k, tv: v, to: o, ta_s: amax["s"], ta_o: amax["o"]}
        pack.update({ts[n]: scalars[n] for n in ts})
        return Bound(lambda: graph.execute(pack, ws), lambda: (o.float() / scalars["so"].view(1)).permute(0, 2, 1, 3))
