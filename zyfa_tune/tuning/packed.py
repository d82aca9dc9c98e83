"""Packed-sequence (varlen) inputs and probes: what a packed-sequence study's trials and the varlen
bench run on.

Each sequence is drawn on its own from the input family (`tuning.inputs.make_qkv`, batch 1, seed
`seed + i`), so a family's structure (rotary positions, sinks) restarts per sequence as it does in
a server's packed batch; FP8 codes are quantised per sequence and KV head (`quantize_fp8_varlen`), which
gives the (sequences, kv_heads) descales `flash_attn_varlen_func` and FA3's varlen take.
"""

from __future__ import annotations

import torch

from .fa3 import padded
from .inputs import make_qkv
from .lengths import check_lengths
from .reference import attention_reference_varlen, rel_l2


def cu_seqlens(lengths: tuple[int, ...], device: str | torch.device = "cuda") -> torch.Tensor:
    """int32 cumulative lengths (sequences + 1,) from 0."""
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def packed_qkv(
    family: str,
    lengths: tuple[int, ...],
    *,
    heads: int,
    kv_heads: int,
    head_dim_qk: int,
    head_dim_v: int,
    seed: int,
    device: str = "cuda",
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Float (1, length, heads, dim) q, k, v per sequence, each of the family."""
    check_lengths(tuple(lengths), "lengths")
    return [
        make_qkv(
            family,
            batch=1,
            seqlen=n,
            heads=heads,
            kv_heads=kv_heads,
            head_dim_qk=head_dim_qk,
            head_dim_v=head_dim_v,
            seed=seed + i,
            device=device,
        )
        for i, n in enumerate(lengths)
    ]


def packed_args(dtype: str, per_sequence: list[tuple[torch.Tensor, ...]]) -> tuple[tuple, dict]:
    """Per-sequence float q, k, v packed to (total, heads, dim): FP8 codes quantised per sequence and
    KV head (`quantize_fp8_varlen`) with (sequences, kv_heads) descales, or bf16. Returns ((q, k, v),
    descale keywords)."""
    from zyfa_tune.quantize import quantize_fp8_varlen

    q, k, v = (torch.cat([qkv[i][0] for qkv in per_sequence]) for i in range(3))
    if dtype != "fp8":
        return (q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16)), {}
    cu = cu_seqlens(tuple(qkv[0].shape[1] for qkv in per_sequence), q.device)
    q8, k8, v8, *descales = quantize_fp8_varlen(q, k, v, cu, cu)
    return (q8, k8, v8), dict(zip(("q_descale", "k_descale", "v_descale"), descales))


def packed_reference_error(
    dtype: str, args: tuple, kw: dict, cu: torch.Tensor, max_len: int, causal: bool, reference: torch.Tensor, fa3: bool
) -> float:
    """Rel. L2 error against `reference` of FA3's FP8 varlen kernel on these codes (`fa3` and the
    fa3_fwd_interface wheel importable; a width FA3 lacks zero-padded to its next), else of the exact
    default config's packed call."""
    from zyfa_tune.generator.defaults import default_config
    from zyfa_tune.varlen import flash_attn_varlen_func

    if fa3 and dtype == "fp8":
        try:
            from fa3_fwd_interface import flash_attn_varlen_func as fa3_varlen
        except ImportError:
            pass
        else:
            run = padded(lambda q, k, v, **opts: fa3_varlen(q, k, v, cu, cu, max_len, max_len, causal=causal, **opts))
            out = run(*args, **kw)
            return rel_l2(out[0] if isinstance(out, tuple) else out, reference)
    base = default_config(dtype, args[0].shape[2], args[2].shape[2])
    out = flash_attn_varlen_func(*args, cu, cu, max_len, max_len, causal=causal, config=base, **kw)
    return rel_l2(out, reference)


def make_packed_probe(
    dtype: str,
    head_dim_qk: int,
    head_dim_v: int,
    lengths: tuple[int, ...],
    *,
    heads: int,
    kv_heads: int,
    causal: bool = True,
    seed: int = 0,
    gate: float = 1.25,
    family: str = "gaussian",
    fa3: bool = False,
):
    """A `verify.Probe` of packed sequences: inputs, float64 reference (`attention_reference_varlen`)
    and limit = gate x the reference error (FA3-fp8's varlen where `fa3` and it imports, else the
    default config's) on the same codes; `check_config` then times `flash_attn_varlen_func`."""
    from .verify import Probe

    per_sequence = packed_qkv(
        family, lengths, heads=heads, kv_heads=kv_heads, head_dim_qk=head_dim_qk, head_dim_v=head_dim_v, seed=seed
    )
    args, kw = packed_args(dtype, per_sequence)
    del per_sequence
    cu, max_len = cu_seqlens(lengths), max(lengths)
    ref = attention_reference_varlen(*args, cu, cu, causal=causal, **kw)
    error_ref = packed_reference_error(dtype, args, kw, cu, max_len, causal, ref, fa3)
    return Probe(args, kw, causal, ref, gate * error_ref, error_ref, packed=(cu, max_len))
