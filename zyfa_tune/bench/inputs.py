"""The tensors every system of one shape is given, made once per input set so that all systems run
on the same numbers and are checked against one float64 reference.

By default FP8 systems all get the same e4m3 tensors, quantised with one per-tensor scale (given to
FA3 and us as (batch, kv_heads) descales, to cuDNN as scalars): the error is the kernel's alone.
With `quant="native"` each quantises as it normally would (FA3 and ours `quantize_fp8` per (batch,
kv head), ours optionally with K smoothing / Hadamard; cuDNN per tensor) and every error is against
float64 attention on the unquantised inputs. Packed sequences (a shape with lengths) are one batch
entry of all their tokens, each sequence drawn on its own (`tuning.packed`), per-tensor mode only;
their descales are per sequence and their reference `attention_reference_varlen`. Inputs come from an input family (`tuning.inputs`:
gaussian by default, or activation-like ones). BF16 systems get the bf16 tensors the FP8 ones were
quantised from.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from zyfa_tune.bench.shape import BenchShape
from zyfa_tune.kernels.quantize import E4M3_MAX

DTYPES = ("fp8", "bf16")
#: `--ours` keys that are `quantize_fp8` options, not config fields
QUANT_OPTIONS = ("smooth_k", "hadamard", "k_major_v", "balanced_v", "v_weight")
#: how FP8 systems get their inputs: one shared per-tensor quantisation (kernel error only), or each
#: system's own (FA3 and ours: `quantize_fp8` per (batch, kv head); cuDNN: per tensor), the error
#: then taken against float64 attention on the unquantised inputs (what input quantisation costs each
#: system); "end-to-end": as native, but FA3 and ours quantise the bf16 inputs inside every timed call
#: (quantiser + attention: what a model pays per layer; FA3 gets the plain `quantize_fp8`, its
#: per-(batch, kv head) descales)
QUANT_MODES = ("per-tensor", "native", "end-to-end")


@dataclass(frozen=True)
class Inputs:
    """One shape's inputs of an input family (`tuning.inputs`): bf16 tensors and their per-tensor
    e4m3 quantisation; with `raw` (native mode) also the float32 originals, quantised per system."""

    shape: BenchShape
    q16: torch.Tensor
    k16: torch.Tensor
    v16: torch.Tensor
    q8: torch.Tensor
    k8: torch.Tensor
    v8: torch.Tensor
    scales: tuple[float, float, float]  # per-tensor q, k, v scales (dequantised = e4m3 * scale)
    raw: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    timed_quant: bool = False  # end-to-end: FP8 systems quantise q16, k16, v16 in each call
    _native: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def random(
        cls, shape: BenchShape, seed: int, device: str = "cuda", family: str = "gaussian", quant: str = "per-tensor"
    ) -> "Inputs":
        """`quant` (QUANT_MODES): beyond per-tensor, the float32 originals are kept for each system's own
        quantisation and the reference."""
        q, k, v = _random_qkv(shape, seed, device, family)
        if shape.lengths and quant != "per-tensor":
            raise ValueError(f"quant: packed sequences are benched with per-tensor inputs only, not {quant!r}")
        q16, k16, v16 = (t.to(torch.bfloat16) for t in (q, k, v))
        (q8, qs), (k8, ks), (v8, vs) = (_quantise(t) for t in (q16, k16, v16))
        return cls(
            shape,
            q16,
            k16,
            v16,
            q8,
            k8,
            v8,
            (qs, ks, vs),
            None if quant == "per-tensor" else (q, k, v),
            quant == "end-to-end",
        )

    def packed_bounds(self) -> tuple[torch.Tensor, int]:
        """Packed sequences' (cu_seqlens, max_seqlen) on the inputs' device, the same for q and k (made
        where a system is prepared, outside its timing)."""
        from zyfa_tune.tuning.packed import cu_seqlens

        if not self.shape.lengths:
            raise ValueError(f"shape: {self.shape.label} is not of packed sequences")
        return cu_seqlens(self.shape.lengths, self.q16.device), self.shape.seqlen

    def descales(self) -> dict[str, torch.Tensor]:
        """FA3-style (batch, kv_heads) descales, all equal to the per-tensor scale."""
        b, hk = self.shape.batch, self.shape.kv_heads
        return {f"{n}_descale": torch.full((b, hk), s, device=self.q16.device) for n, s in zip("qkv", self.scales)}

    def args(
        self, dtype: str, quant: tuple[tuple[str, Any], ...] = ()
    ) -> tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor]]:
        """(q, k, v) and descale keywords as `flash_attn_func` and FA3 take them: in native mode FP8
        inputs are `quantize_fp8(raw, **quant)` (made once per option set)."""
        if dtype == "fp8" and self.raw is not None:
            if quant not in self._native:
                self._native[quant] = _quantize_fp8(self.raw, quant)
            return self._native[quant]
        if dtype == "fp8":
            return (self.q8, self.k8, self.v8), self.descales()
        return (self.q16, self.k16, self.v16), {}

    def call(self, dtype: str, quant: tuple[tuple[str, Any], ...], fn: Callable[..., Any]) -> Callable[[], Any]:
        """A call of fn(*args, **kw) on `args(dtype, quant)`; end-to-end, FP8 inputs quantised from the bf16
        tensors inside the call (so that its timing counts the quantiser)."""
        if dtype == "fp8" and self.timed_quant:
            x16 = (self.q16, self.k16, self.v16)

            def quantise_and_run() -> Any:
                args, kw = _quantize_fp8(x16, quant)
                return fn(*args, **kw)

            return quantise_and_run
        args, kw = self.args(dtype, quant)
        return lambda: fn(*args, **kw)

    def reference(self, dtype: str) -> torch.Tensor:
        """Float64 attention on what `dtype` systems were given, or in native mode on the
        unquantised inputs (so input quantisation counts in every system's error)."""
        from zyfa_tune.tuning.reference import attention_reference, attention_reference_varlen

        if self.shape.lengths:
            (q, k, v), kw = self.args(dtype)
            cu, _ = self.packed_bounds()
            return attention_reference_varlen(q[0], k[0], v[0], cu, cu, causal=True, **kw)[None]
        if self.raw is not None:
            return attention_reference(*self.raw, causal=True)
        args, kw = self.args(dtype)
        return attention_reference(*args, causal=True, **kw)


def _random_qkv(shape: BenchShape, seed: int, device: str, family: str) -> tuple[torch.Tensor, ...]:
    """Float (batch, seqlen, heads, dim) q, k, v of the family; packed sequences as (1, tokens, ...)."""
    from zyfa_tune.tuning.inputs import make_qkv
    from zyfa_tune.tuning.packed import packed_qkv

    dims = dict(heads=shape.heads, kv_heads=shape.kv_heads, head_dim_qk=shape.head_dim_qk, head_dim_v=shape.head_dim_v)
    if shape.lengths:
        per_sequence = packed_qkv(family, shape.lengths, seed=seed, device=device, **dims)
        return tuple(torch.cat([qkv[i] for qkv in per_sequence], dim=1) for i in range(3))
    return make_qkv(family, batch=shape.batch, seqlen=shape.seqlen, seed=seed, device=device, **dims)


def quant_kwargs(quant: tuple[tuple[str, Any], ...]) -> dict[str, Any]:
    """`quantize_fp8`'s keywords for `--ours` quantisation options (QUANT_OPTIONS)."""
    opts = dict(quant)  # k_major_v: V's codes keys-fastest; balanced_v: v_rounding="balanced"
    opts["v_layout"] = "k_major" if opts.pop("k_major_v", False) else "natural"
    opts["v_rounding"] = "balanced" if opts.pop("balanced_v", False) else "nearest"
    return opts


def _quantize_fp8(x: tuple[torch.Tensor, ...], quant: tuple[tuple[str, Any], ...]) -> tuple[tuple, dict]:
    """`quantize_fp8` of (q, k, v) with `--ours` quantisation options, as (q8, k8, v8) and descale keywords."""
    from zyfa_tune.quantize import quantize_fp8

    q8, k8, v8, qd, kd, vd = quantize_fp8(*x, **quant_kwargs(quant))
    return (q8, k8, v8), dict(q_descale=qd, k_descale=kd, v_descale=vd)


def _quantise(x: torch.Tensor) -> tuple[torch.Tensor, float]:
    scale = float(x.float().abs().amax()) / E4M3_MAX
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale
