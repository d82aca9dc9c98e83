"""`flash_attn_varlen_func`: FlashAttention-3's forward over packed sequences of different lengths.

A serving batch packs many prompts into one (total_tokens, heads, dim) tensor, sequence i holding
rows cu_seqlens[i]:cu_seqlens[i + 1]. The packed tensors run as one batch entry of `total` rows on the
varlen variant of a Gluon config (kernels/gluon_varlen.py: a persistent schedule over the sequences'
tiles, heaviest first; it writes the LSE too), or on the serving variant of a Triton config
(generator/triton/emit.py), which also takes windows; each tile reads its sequence's bounds from the
cumulative lengths. The argument checks and the per-layout fast path are flash_attn_func's
(zyfa_tune/api.py); only what packing adds is checked here.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

from zyfa_tune import api as _api
from zyfa_tune.api import (
    ArgumentProblems,
    check_config,
    check_options,
    check_related,
    check_tensor,
    empty_result,
    planned,
    readable,
    remember,
    run_plan,
    serving_config,
    values_read,
    values_to_read,
    window_bounds,
)
from zyfa_tune.generator import ConfigError, KernelConfig
from zyfa_tune.generator.defaults import default_config
from zyfa_tune.kernels import dispatch
from zyfa_tune.kernels.gluon_varlen import bind as bind_packed
from zyfa_tune.kernels.launch import Serving, ServingLaunch, bind, for_v_layout

_PACKED = ("total_tokens", "heads", "head_dim")
_BATCH_FROM = " (batch: len(cu_seqlens_q) - 1)"


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None = None,
    causal: bool = True,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    window_size: tuple[int, int] = (-1, -1),
    return_lse: bool = False,
    *,
    config: KernelConfig | None = None,
    validate: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention over packed sequences like FlashAttention-3's `flash_attn_varlen_func`.

    q: (total_q, heads, head_dim_qk); k: (total_k, kv_heads, head_dim_qk); v: (total_k, kv_heads,
    head_dim_v); all torch.float8_e4m3fn or all torch.bfloat16 on one CUDA device. cu_seqlens_q/_k:
    int32 (batch + 1,) cumulative lengths on that device, from 0 to total_q / total_k; sequences may
    be empty. max_seqlen_q/_k: at least the longest sequence (they size the grid). Descales (fp8
    only): (batch, kv_heads), one per sequence and kv head. Causal masking and window_size are
    bottom-right aligned per sequence (query i of a sequence sees keys j <= i + seqlen_k - seqlen_q),
    as in flash_attn_func. Returns (total_q, heads, head_dim_v) bf16, and with return_lse=True also
    the float32 natural-log sum of exp(scores) (heads, total_q), -inf for rows that see no key.

    Runs the dispatcher's packed-sequence entry for (sequences, heads, total tokens, max_seqlen_q),
    else its rectangular choice at the mean length, as its `packed_twin`: a Gluon config on its varlen
    variant (forced ones too; it writes the LSE and runs a window as well).
    Checks as flash_attn_func's: every argument on a layout's first call, all problems in one error;
    the values of CUDA cumulative lengths (start at 0, never decrease, end at the tensors' totals,
    no sequence longer than max_seqlen) are read then (one synchronisation, not inside CUDA graph
    capture) and on every call with validate=True; host ones always. Later calls with the layout
    launch without checks or synchronisation (CUDA-graph capturable).
    """
    tensors = (q, k, v, cu_seqlens_q, cu_seqlens_k, q_descale, k_descale, v_descale)
    options = (max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_size, return_lse, config)
    key, plan = planned("varlen", tensors, options, validate)
    if plan is not None:
        return run_plan(plan, q, k, v, q_descale, k_descale, v_descale, cu_seqlens_q, cu_seqlens_k)
    given = (q_descale, k_descale, v_descale)
    read = values_to_read(key, validate)
    p = _prepare(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, given,
        window_size, return_lse, config, read,
    )  # fmt: skip
    values_read(key, read)
    return _run(key, p, given, config, causal, (q, k, v, cu_seqlens_q, cu_seqlens_k))


def packed_twin(config: KernelConfig) -> KernelConfig:
    """The config that runs packed sequences for `config`. A Triton TMA config reading a V^T copy
    would start a sequence's tile at its first key's column, the copy's innermost dimension, where a
    TMA box must start 16-byte aligned; its natural-V twin reads V's rows, where a tile may start at
    any row (as Q's and K's do). A Gluon config reads a copy whose sequences start 32-aligned
    (kernels/gluon_varlen.packed_vt), but not K in k_perm's 16-row groups: its twin without k_perm."""
    if config.backend == "gluon":
        return config.replace(k_perm=False) if config.k_perm else config
    return natural_twin(config) if config.loads == "tma" else config


def natural_twin(config: KernelConfig) -> KernelConfig:
    """`config` reading V as stored, (keys, dim) rows, where it reads a V^T copy."""
    if config.v_layout != "transposed":
        return config
    try:
        return config.replace(v_layout="natural")
    except ConfigError:  # (a combination the natural layout does not take: the default's twin)
        return default_config(config.dtype, config.head_dim_qk, config.head_dim_v).replace(v_layout="natural")


@dataclass(frozen=True)
class _Packed:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    dtype: str
    softmax_scale: float
    descales: tuple
    window: tuple[int, int]
    return_lse: bool


def _run(key, p: _Packed, given: tuple, config, causal: bool, as_passed: tuple):
    """Choose the kernel and launch; leave a plan for the layout where nothing was copied."""
    total_q, h, dqk = p.q.shape
    total_k, hk, dv = p.k.shape[0], p.k.shape[1], p.v.shape[2]
    batch = p.cu_seqlens_q.shape[0] - 1
    device = p.q.device
    out = torch.empty(total_q, h, dv, dtype=torch.bfloat16, device=device)
    lse = torch.empty(h, total_q, dtype=torch.float32, device=device) if p.return_lse else None
    if total_q == 0 or total_k == 0:
        return empty_result(out, lse, total_k == 0)
    q4, k4, v4, out4 = (t.unsqueeze(0) for t in (p.q, p.k, p.v, out))  # one batch entry of packed rows
    window = window_bounds(p.window, causal, total_k, total_q)
    chosen = config or for_v_layout(
        dispatched_config(p.dtype, dqk, dv, causal, batch, h, hk, total_q, p.max_seqlen_q, device.index), v4
    )
    chosen = packed_twin(chosen)
    cu = (p.cu_seqlens_q, p.cu_seqlens_k)
    with torch.cuda.device(device):
        if chosen.backend == "gluon":
            maxes = (p.max_seqlen_q, p.max_seqlen_k)
            args = (p.softmax_scale, causal, p.descales, cu, maxes, lse, window)
            bound = bind_packed(chosen, p.q, p.k, p.v, out, *args)
        else:
            serving = Serving(*cu, p.max_seqlen_q, window, lse)
            causal_mask = causal and window is None
            bound = bind(chosen, q4, k4, v4, out4, p.softmax_scale, causal_mask, *p.descales, serving=serving)
            bound = bound and ServingLaunch(bound, None if lse is None else (h, total_q))
    used = (p.q, p.k, p.v, p.cu_seqlens_q, p.cu_seqlens_k)
    if all(a is b for a, b in zip(used, as_passed)) and all(d is None or d is c for d, c in zip(given, p.descales)):
        launch = bound
        remember(key, launch, (total_q, h, dv), device, given, p.descales)
    return out if lse is None else (out, lse)


def dispatched_config(
    dtype: str,
    dqk: int,
    dv: int,
    causal: bool,
    batch: int,
    h: int,
    hk: int,
    total_q: int,
    max_seqlen_q: int,
    device_index: int,
) -> KernelConfig:
    """The dispatcher's packed-sequence choice before `packed_twin`, keyed on host values only
    (sequences, q's total tokens, max_seqlen_q: no read of the lengths). A packed-sequence entry
    runs as it was timed, a Gluon choice on its varlen variant (which takes a window and writes an LSE),
    any other as its serving twin (`serving_config`)."""
    config, tuned = dispatch.dispatcher().varlen_config_for(
        dtype, dqk, dv, causal, batch, h, hk, total_q, max(1, max_seqlen_q), device_index
    )
    if config.backend == "gluon":
        return config
    return config if tuned and config.backend == "triton" else serving_config(config)


def _prepare(
    q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal, given, window_size, return_lse, config, read_values
) -> _Packed:
    """Validate the arguments; every problem is reported at once, each naming its argument, the
    device last (as flash_attn_func's)."""
    problems = ArgumentProblems()
    tensors_ok = [check_tensor(n, t, problems, dims=_PACKED) for n, t in (("q", q), ("k", k), ("v", v))]
    related = all(tensors_ok)
    if related:
        check_related(q, k, v, problems)
    cu_ok = all(
        [
            _check_cu(n, t, q if tensors_ok[0] else None, problems)
            for n, t in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k))
        ]
    )
    if cu_ok and cu_q.shape[0] != cu_k.shape[0]:
        problems.add(
            ValueError,
            f"cu_seqlens_k: {cu_k.shape[0]} entries, but cu_seqlens_q has {cu_q.shape[0]} (both batch + 1)",
        )
        cu_ok = False
    batch = cu_q.shape[0] - 1 if cu_ok else None
    window = check_options(softmax_scale, causal, window_size, return_lse, problems)
    totals = (q.shape[0] if tensors_ok[0] else None, k.shape[0] if tensors_ok[1] else None)
    maxes_ok = _check_max(("max_seqlen_q", "max_seqlen_k"), (max_q, max_k), totals, batch, problems)
    dtype = _api._DTYPES[q.dtype] if tensors_ok[0] else None
    descales = _api._prepare_descales(q, k, given, [*tensors_ok, cu_ok], read_values, problems, batch, _BATCH_FROM)
    check_config(config, dtype, q, v, related, problems)
    if cu_ok and related and maxes_ok and not problems.found and readable(cu_q, read_values):
        values = torch.stack([cu_q, cu_k]).cpu()  # (one synchronisation for both)
        check_cu_values(zip("qk", values, totals, (max_q, max_k)), problems)
    if tensors_ok[0]:  # k's, v's and the lengths' devices are checked against q's above
        try:
            _api._on_cuda("q", q)
        except ValueError as exc:
            problems.add(ValueError, str(exc))
    problems.raise_any()
    fp8 = q.dtype == torch.float8_e4m3fn  # as flash_attn_func: a keys-fastest FP8 V is read as it is
    q, k = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k))
    v = v if v.stride(-1) == 1 or (fp8 and v.stride(0) == 1) else v.contiguous()
    cu_q, cu_k = (c if c.is_contiguous() else c.contiguous() for c in (cu_q, cu_k))
    scale = q.shape[2] ** -0.5 if softmax_scale is None else float(softmax_scale)
    return _Packed(q, k, v, cu_q, cu_k, int(max_q), int(max_k), dtype, scale, descales, window, return_lse)


def _check_cu(name: str, cu: object, q: torch.Tensor | None, problems: ArgumentProblems) -> bool:
    """A cumulative-lengths tensor on its own: an int32 (batch + 1,) tensor on q's device."""
    if not isinstance(cu, torch.Tensor):
        problems.add(
            TypeError, f"{name}: expected an int32 torch.Tensor of shape (batch + 1,), got {type(cu).__name__}"
        )
    elif cu.dtype != torch.int32:
        problems.add(TypeError, f"{name}: expected dtype torch.int32, got {cu.dtype}")
    elif cu.dim() != 1 or cu.shape[0] < 1:
        problems.add(ValueError, f"{name}: expected 1 dim (batch + 1,) with batch >= 0, got shape {tuple(cu.shape)}")
    elif q is not None and cu.device != q.device:
        problems.add(ValueError, f"{name}: on {cu.device}, but q is on {q.device}")
    else:
        return True
    return False


def _check_max(names, values, totals, batch: int | None, problems: ArgumentProblems) -> bool:
    """max_seqlen_q/_k: ints >= 0 with which `batch` sequences can hold the tensors' totals (a check
    on shapes alone; that none is longer needs the lengths' values, `_check_cu_values`)."""
    ok = True
    for name, value, total, tensor in zip(names, values, totals, ("q", "k")):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            problems.add(TypeError, f"{name}: expected an int >= 0, got {value!r}")
            ok = False
        elif batch is not None and total is not None and value * batch < total:
            problems.add(
                ValueError,
                f"{name}: {batch} sequences of at most {value} tokens cannot hold {tensor}'s {total} tokens",
            )
            ok = False
    return ok


def check_cu_values(sides, problems: ArgumentProblems) -> None:
    """Cumulative lengths' values, read to the host (read them only where `readable` allows): each
    of `sides`, (side "q" or "k", values, the tensor's total, its max_seqlen), starts at 0, never
    decreases, ends at the total, and holds no sequence longer than the max_seqlen."""
    for side, c, total, most in sides:
        c = c.to(torch.int64)
        name, lengths = f"cu_seqlens_{side}", c[1:] - c[:-1]
        if c[0] != 0:
            problems.add(ValueError, f"{name}: must start at 0, got {int(c[0])}")
        elif (lengths < 0).any():
            i = int((lengths < 0).nonzero()[0])
            problems.add(ValueError, f"{name}: decreases at index {i + 1} ({int(c[i])} then {int(c[i + 1])})")
        elif c[-1] != total:
            problems.add(ValueError, f"{name}: ends at {int(c[-1])}, but {side} holds {total} tokens")
        elif lengths.numel() and int(lengths.max()) > most:
            i = int(lengths.argmax())
            problems.add(
                ValueError,
                f"max_seqlen_{side}: {most} is less than sequence {i}'s length {int(lengths[i])} (from {name})",
            )


__all__ = ["flash_attn_varlen_func"]
