"""Packed sequences (`zyfa-tune bench --lengths`): ours through `flash_attn_varlen_func` (the
dispatcher's packed-sequence pick, or a forced `--ours` config) and FlashAttention-3's varlen entry
point (`fa3_fwd_interface.flash_attn_varlen_func`), FP8 or BF16, on the same packed inputs
(`bench.inputs`: one batch entry of every token, per-sequence descales). These systems run only
packed shapes (`packed`), the rectangular systems only rectangular ones (`peers.systems_for`).
Outputs are (1, tokens, heads, dim_v), the reference's layout; TFLOP/s counts each sequence's causal
FLOPs at its own length (BenchShape.flops)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from zyfa_tune.bench.inputs import Inputs
from zyfa_tune.bench.peers.base import Bound, boxed
from zyfa_tune.bench.peers.ours import Ours, borrowed_from
from zyfa_tune.bench.shape import BenchShape
from zyfa_tune.tuning.fa3 import padded


def one_entry(out):
    """A packed call's output (total, heads, dim_v), or FA3's (out, lse), as one batch entry."""
    return (out[0] if isinstance(out, tuple) else out)[None]


@dataclass(frozen=True)
class FA3Varlen:
    """FA3's varlen forward on the packed codes (FP8, descales per sequence) or bf16 tensors."""

    name: str
    dtype: str
    kind: ClassVar[str] = "peer"
    quant_modes: ClassVar[tuple[str, ...]] = ("per-tensor",)
    packed: ClassVar[bool] = True

    def supports(self, shape: BenchShape) -> bool:
        return bool(shape.lengths)

    def prepare(self, x: Inputs) -> Bound:
        from fa3_fwd_interface import flash_attn_varlen_func as fa3_varlen

        cu, most = x.packed_bounds()

        def run(q, k, v, **kw):
            return fa3_varlen(q[0], k[0], v[0], cu, cu, most, most, causal=True, **kw)

        return Bound(*boxed(x.call(self.dtype, (), padded(run)), one_entry))


@dataclass(frozen=True)
class VarlenOurs(Ours):
    """One `OursSpec` on packed sequences: kind "ours" where the dispatcher picks, else "forced"."""

    quant_modes: ClassVar[tuple[str, ...]] = ("per-tensor",)
    packed: ClassVar[bool] = True

    def supports(self, shape: BenchShape) -> bool:
        return bool(shape.lengths)

    def prepare(self, x: Inputs) -> Bound:
        from zyfa_tune.varlen import flash_attn_varlen_func, packed_twin

        s, spec = x.shape, self.spec
        config = spec.config_for(s.head_dim_qk, s.head_dim_v)
        cu, most = x.packed_bounds()

        def run(q, k, v, **kw):
            return flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, most, most, causal=True, config=config, **kw)

        call, output = boxed(x.call(spec.dtype, spec.quant, run), one_entry)
        if config is not None:
            return Bound(call, output, packed_twin(config).to_json(), "forced")
        choice, runs = _dispatched(s, spec.dtype, x.q16.device.index or 0)
        return Bound(call, output, packed_twin(runs).to_json(), choice.source, borrowed_from(choice))


def _dispatched(s: BenchShape, dtype: str, device_index: int):
    """The dispatcher's packed-sequence choice (why) and the config `flash_attn_varlen_func` runs."""
    from zyfa_tune.kernels import dispatch
    from zyfa_tune.varlen import dispatched_config

    dims = (dtype, s.head_dim_qk, s.head_dim_v, True, s.batch, s.heads, s.kv_heads)
    key = dispatch.problem_key(*dims, s.seqlen, tokens=s.tokens)
    rect = dispatch.problem_key(*dims, -(-s.tokens // s.batch))
    choice = dispatch.dispatcher().choose_varlen(key, dispatch.device_key(device_index), rect)
    return choice, dispatched_config(*dims, s.tokens, s.seqlen, device_index)
