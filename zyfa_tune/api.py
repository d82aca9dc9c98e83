"""`flash_attn_func`: a drop-in for FlashAttention-3's forward, backed by generated kernels."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from zyfa_tune.generator import HEAD_DIMS, KernelConfig
from zyfa_tune.kernels import dispatch
from zyfa_tune.kernels.launch import BoundLaunch, bind, for_v_layout

_DTYPES = {torch.float8_e4m3fn: "fp8", torch.bfloat16: "bf16"}


def _on_cuda(name: str, t: torch.Tensor) -> None:
    if t.device.type != "cuda":
        raise ValueError(f"{name}: tensor is on {t.device}; zyfa_tune kernels run on CUDA devices")


def _check_tensor(name: str, t: object, k_major_ok: bool = False) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        raise ValueError(f"{name}: expected 4 dims (batch, seqlen, heads, head_dim), got shape {tuple(t.shape)}")
    if t.dtype not in _DTYPES:
        raise TypeError(f"{name}: dtype {t.dtype} is not supported; use torch.float8_e4m3fn or torch.bfloat16")
    _on_cuda(name, t)
    if t.stride(-1) == 1 or (k_major_ok and t.stride(1) == 1 and t.dtype == torch.float8_e4m3fn):
        return t  # rows contiguous, or an FP8 V stored keys-fastest (what FP8 kernels read)
    return t.contiguous()


def _check_descale(name: str, d: object, shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    if not isinstance(d, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor of shape {shape}, got {type(d).__name__}")
    if d.device != device:
        raise ValueError(f"{name}: on {d.device}, but q is on {device}")
    if tuple(d.shape) != shape:
        raise ValueError(f"{name}: expected shape (batch, kv_heads) = {shape}, got {tuple(d.shape)}")
    if not d.dtype.is_floating_point:
        raise TypeError(f"{name}: expected a floating dtype, got {d.dtype}")
    return d.to(torch.float32).contiguous()


@dataclass(frozen=True)
class _Problem:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dtype: str
    softmax_scale: float
    descales: tuple  # (q, k, v) contiguous float32 (batch, kv_heads) tensors, or three Nones


def _prepare(q, k, v, softmax_scale, causal, q_descale, k_descale, v_descale) -> _Problem:
    """Validate the arguments of flash_attn_func / explain; errors name the argument."""
    q, k, v = _check_tensor("q", q), _check_tensor("k", k), _check_tensor("v", v, k_major_ok=True)
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name}: dtype {t.dtype} differs from q's {q.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name}: on {t.device}, but q is on {q.device}")
        if t.shape[0] != q.shape[0]:
            raise ValueError(f"{name}: batch {t.shape[0]} differs from q's {q.shape[0]}")
    b, sq, h, dqk = q.shape
    sk, hk = k.shape[1], k.shape[2]
    if tuple(v.shape[:3]) != (b, sk, hk):
        raise ValueError(f"v: shape {tuple(v.shape)} must match k's (batch, seqlen_k, kv_heads) = {(b, sk, hk)}")
    if k.shape[3] != dqk:
        raise ValueError(f"k: head_dim {k.shape[3]} differs from q's {dqk}")
    if hk == 0 or h % hk:
        raise ValueError(f"k: kv_heads={hk} must divide q's heads={h}")
    dv = v.shape[3]
    for name, d in (("q", dqk), ("v", dv)):
        if d not in HEAD_DIMS:
            raise ValueError(f"{name}: head_dim {d} is not supported; supported: {list(HEAD_DIMS)}")
    if softmax_scale is None:
        softmax_scale = dqk ** -0.5
    elif isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)) \
            or not math.isfinite(softmax_scale) or softmax_scale <= 0:
        raise ValueError(f"softmax_scale: expected a positive finite number, got {softmax_scale!r}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected bool, got {type(causal).__name__}")
    dtype = _DTYPES[q.dtype]
    descales = (q_descale, k_descale, v_descale)
    if any(d is not None for d in descales):
        if dtype == "bf16":
            raise ValueError("q_descale/k_descale/v_descale apply to float8_e4m3fn inputs only")
        ones = None
        checked = []
        for name, d in zip(("q_descale", "k_descale", "v_descale"), descales):
            if d is None:
                ones = ones if ones is not None else torch.ones(b, hk, dtype=torch.float32, device=q.device)
                checked.append(ones)
            else:
                checked.append(_check_descale(name, d, (b, hk), q.device))
        descales = tuple(checked)
    return _Problem(q, k, v, dtype, float(softmax_scale), descales)


# ---- per-layout fast path -------------------------------------------------------------------------
# Validation, the dispatcher's choice, the grid and the launch arguments depend only on the shapes,
# strides, dtypes and devices of the arguments (and on the scale, causal flag, forced config and
# database layers), not on the data. The first call with a layout takes the checked path and leaves a
# _Plan under a key of exactly those properties; later calls with that layout and 16-byte aligned
# pointers allocate the output and launch (docs/PERF.md: dispatch overhead).

_PLAN_LIMIT = 4096


@dataclass(frozen=True)
class _Plan:
    launch: BoundLaunch
    out_shape: tuple[int, int, int, int]
    device: torch.device
    ones: torch.Tensor | None  # stands in for descales left out when others are given
    only_device: bool  # the only visible GPU: no need to ask which device is current


_plans: dict[tuple, _Plan] = {}


def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None = None,
                    causal: bool = True, q_descale: torch.Tensor | None = None,
                    k_descale: torch.Tensor | None = None, v_descale: torch.Tensor | None = None,
                    *, config: KernelConfig | None = None) -> torch.Tensor:
    """Attention forward like FlashAttention-3's `flash_attn_func`; returns the bf16 output.

    q: (batch, seqlen_q, heads, head_dim_qk); k: (batch, seqlen_k, kv_heads, head_dim_qk);
    v: (batch, seqlen_k, kv_heads, head_dim_v); all torch.float8_e4m3fn or all torch.bfloat16,
    on one CUDA device. kv_heads must divide heads (GQA / MQA). Descales (fp8 only) are
    (batch, kv_heads) tensors; a missing one counts as ones. Causal masking is bottom-right
    aligned when seqlen_q != seqlen_k. The kernel comes from the tuning databases
    (`zyfa_tune.explain` says which and why); `config` forces one instead.
    Returns (batch, seqlen_q, heads, head_dim_v) in torch.bfloat16.
    """
    try:  # the layout key: every argument property the checked path depends on except data pointers
        key = (type(q), q.shape, q.stride(), q.dtype, q.device, type(k), k.shape, k.stride(), k.dtype, k.device,
               type(v), v.shape, v.stride(), v.dtype, v.device, type(softmax_scale), softmax_scale,
               type(causal), causal, config, dispatch.dispatcher(),
               None if q_descale is None else (type(q_descale), q_descale.shape, q_descale.stride(),
                                               q_descale.dtype, q_descale.device),
               None if k_descale is None else (type(k_descale), k_descale.shape, k_descale.stride(),
                                               k_descale.dtype, k_descale.device),
               None if v_descale is None else (type(v_descale), v_descale.shape, v_descale.stride(),
                                               v_descale.dtype, v_descale.device))
        plan = _plans.get(key)
    except Exception:  # not tensors, unhashable values: the checked path names the problem
        key = plan = None
    # the kernels were specialised on 16-byte aligned pointers when the plan was made
    if plan is not None and not (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15 and (
            q_descale is None or not q_descale.data_ptr() & 15) and (
            k_descale is None or not k_descale.data_ptr() & 15) and (
            v_descale is None or not v_descale.data_ptr() & 15):
        out = torch.empty(plan.out_shape, dtype=torch.bfloat16, device=plan.device)
        if plan.ones is not None:
            q_descale, k_descale, v_descale = (plan.ones if d is None else d for d in (q_descale, k_descale, v_descale))
        if plan.only_device or plan.device.index == torch.cuda.current_device():
            return plan.launch(q, k, v, out, q_descale, k_descale, v_descale)
        with torch.cuda.device(plan.device):
            return plan.launch(q, k, v, out, q_descale, k_descale, v_descale)
    return _checked_call(key, q, k, v, softmax_scale, causal, q_descale, k_descale, v_descale, config)


def _checked_call(key, q, k, v, softmax_scale, causal, q_descale, k_descale, v_descale, config) -> torch.Tensor:
    """Validate, choose the kernel, launch; leave a _Plan for this layout when it needs no copies."""
    p = _prepare(q, k, v, softmax_scale, causal, q_descale, k_descale, v_descale)
    b, sq, h, dqk = p.q.shape
    sk, hk, dv = p.k.shape[1], p.k.shape[2], p.v.shape[3]
    if config is not None and not isinstance(config, KernelConfig):
        raise TypeError(f"config: expected a KernelConfig, got {type(config).__name__}")
    if config is not None and (config.dtype, config.head_dim_qk, config.head_dim_v) != (p.dtype, dqk, dv):
        raise ValueError(f"config: built for {config.dtype} {config.head_dim_qk}/{config.head_dim_v}, "
                         f"inputs are {p.dtype} {dqk}/{dv}")
    out = torch.empty(b, sq, h, dv, dtype=torch.bfloat16, device=p.q.device)
    if out.numel() == 0:
        return out
    if sk == 0:
        return out.zero_()
    chosen = config or for_v_layout(dispatch.dispatcher().config_for(p.dtype, dqk, dv, causal, b, h, hk, sq,
                                                                     p.q.device.index), p.v)
    with torch.cuda.device(p.q.device):
        bound = bind(chosen, p.q, p.k, p.v, out, p.softmax_scale, causal, *p.descales)
    given = (q_descale, k_descale, v_descale)
    as_given = p.q is q and p.k is k and p.v is v and all(d is None or d is c for d, c in zip(given, p.descales))
    if bound is not None and key is not None and as_given:
        ones = next((c for d, c in zip(given, p.descales) if d is None and c is not None), None)
        if len(_plans) >= _PLAN_LIMIT:  # unbounded layout streams: start over rather than grow
            _plans.clear()
        _plans[key] = _Plan(bound, (b, sq, h, dv), p.q.device, ones, torch.cuda.device_count() == 1)
    return out


def explain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None = None,
            causal: bool = True, q_descale: torch.Tensor | None = None, k_descale: torch.Tensor | None = None,
            v_descale: torch.Tensor | None = None) -> dispatch.Choice:
    """Which kernel `flash_attn_func` would run for these arguments, from which database, and why."""
    p = _prepare(q, k, v, softmax_scale, causal, q_descale, k_descale, v_descale)
    b, sq, h, dqk = p.q.shape
    key = dispatch.problem_key(p.dtype, dqk, p.v.shape[3], causal, b, h, p.k.shape[2], sq)
    choice = dispatch.dispatcher().choose(key, dispatch.device_key(p.q.device.index))
    runs = for_v_layout(choice.config, p.v)
    if runs == choice.config:
        return choice
    if runs.v_layout != choice.config.v_layout:
        why = "V is K-major: the natural-V config's transposed twin reads it without a copy"
    elif runs.k_perm:
        why = "V is K-major: the k_perm twin relabels keys on K and reads it without a copy"
    else:
        why = f"{p.k.shape[1]} keys are not a multiple of 16: k_perm off (V^T copied with its keys permuted)"
    return replace(choice, config=runs, detail=f"{choice.detail}; {why}".lstrip("; "))
