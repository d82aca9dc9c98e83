"""`flash_attn_func`: a drop-in for FlashAttention-3's forward, backed by generated kernels.

The argument checks and the per-layout fast path here are shared with `flash_attn_varlen_func`
(zyfa_tune/varlen.py)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from zyfa_tune.generator import GENERATOR_VERSION, HOPPER, KernelConfig, head_dim_error
from zyfa_tune.generator.defaults import default_config
from zyfa_tune.kernels import dispatch
from zyfa_tune.kernels.launch import BoundLaunch, Serving, ServingLaunch, bind, for_v_layout

_DTYPES = {torch.float8_e4m3fn: "fp8", torch.bfloat16: "bf16"}
_DESCALES = ("q_descale", "k_descale", "v_descale")
_DENSE_DIMS = ("batch", "seqlen", "heads", "head_dim")


class ArgumentProblems:
    """Argument problems found so far, each (exception type, message naming the argument); raised
    together, as the first problem's type, so one call shows everything wrong with its arguments."""

    def __init__(self) -> None:
        self.found: list[tuple[type[Exception], str]] = []

    def add(self, exc: type[Exception], message: str) -> None:
        self.found.append((exc, message))

    def raise_any(self) -> None:
        if self.found:
            raise self.found[0][0]("\n".join(message for _, message in self.found))


def _on_cuda(name: str, t: torch.Tensor) -> None:
    if t.device.type != "cuda":
        raise ValueError(f"{name}: tensor is on {t.device}; zyfa_tune kernels run on CUDA devices")


def check_tensor(
    name: str,
    t: object,
    problems: ArgumentProblems,
    dtypes: tuple[torch.dtype, ...] = tuple(_DTYPES),
    hint: str = "",
    dims: tuple[str, ...] = _DENSE_DIMS,
) -> bool:
    """Type, rank (`dims` names the axes), dtype (one of `dtypes`; `hint` says where others go) and
    head dim of q, k or v on its own."""
    if not isinstance(t, torch.Tensor):
        problems.add(TypeError, f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    elif t.dim() != len(dims):
        problems.add(ValueError, f"{name}: expected {len(dims)} dims ({', '.join(dims)}), got shape {tuple(t.shape)}")
    elif t.dtype not in dtypes:
        problems.add(TypeError, f"{name}: dtype {t.dtype} is not supported; use {' or '.join(map(str, dtypes))}{hint}")
    elif name != "k" and (why := head_dim_error(f"{name}: head_dim", int(t.shape[-1]))):  # (k's must equal q's)
        problems.add(ValueError, why)
    else:
        return True
    return False


def check_related(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, problems: ArgumentProblems) -> None:
    """k and v against q: dtype, device, batch, kv heads and head dims (4-D batches, or packed
    (total, heads, dim) sequences)."""
    dense = q.dim() == 4
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            problems.add(TypeError, f"{name}: dtype {t.dtype} differs from q's {q.dtype}")
        if t.device != q.device:
            problems.add(ValueError, f"{name}: on {t.device}, but q is on {q.device}")
        if dense and t.shape[0] != q.shape[0]:
            problems.add(ValueError, f"{name}: batch {t.shape[0]} differs from q's {q.shape[0]}")
    h, dqk = q.shape[-2:]
    hk = k.shape[-2]
    if dense and k.shape[0] == q.shape[0] and tuple(v.shape[:3]) != tuple(k.shape[:3]):
        problems.add(
            ValueError, f"v: shape {tuple(v.shape)} must match k's (batch, seqlen_k, kv_heads) = {tuple(k.shape[:3])}"
        )
    elif not dense and tuple(v.shape[:2]) != tuple(k.shape[:2]):
        problems.add(ValueError, f"v: shape {tuple(v.shape)} must match k's (total_k, kv_heads) = {tuple(k.shape[:2])}")
    if k.shape[-1] != dqk:
        problems.add(ValueError, f"k: head_dim {k.shape[-1]} differs from q's {dqk}")
    if hk == 0 or h % hk:
        problems.add(ValueError, f"k: kv_heads={hk} must divide q's heads={h}")


def _checked_descale(
    name: str,
    d: object,
    shape: tuple[int, int] | None,
    device: torch.device | None,
    problems: ArgumentProblems,
    batch_from: str = "",
) -> torch.Tensor | None:
    """`d` as float32, or None after adding its problems; `shape` and `device` are q's where known."""
    if not isinstance(d, torch.Tensor):
        problems.add(TypeError, f"{name}: expected a torch.Tensor of shape (batch, kv_heads), got {type(d).__name__}")
        return None
    ok = True
    if device is not None and d.device != device:
        problems.add(ValueError, f"{name}: on {d.device}, but q is on {device}")
        ok = False
    if shape is not None and tuple(d.shape) != shape:
        problems.add(
            ValueError, f"{name}: expected shape (batch, kv_heads) = {shape}, got {tuple(d.shape)}{batch_from}"
        )
        ok = False
    if not d.dtype.is_floating_point:
        problems.add(TypeError, f"{name}: expected a floating dtype, got {d.dtype}")
        ok = False
    return d.to(torch.float32) if ok else None


def _check_descale_values(named: list[tuple[str, torch.Tensor]], on_cuda: bool, problems: ArgumentProblems) -> None:
    """Refuse NaN, inf, zero or negative descales (float32, as the kernels read them). Host tensors
    are read as they are; CUDA ones only with `on_cuda` (one device synchronisation for all of them)
    and never while a CUDA graph is being captured (no synchronisation is allowed there)."""
    host = [(n, d) for n, d in named if d.device.type == "cpu"]
    cuda = [(n, d) for n, d in named if d.device.type == "cuda"]
    if cuda and readable(cuda[0][1], on_cuda):
        bad_any = torch.stack([~(torch.isfinite(d) & (d > 0)).all() for _, d in cuda]).tolist()
        host += [(n, d.cpu()) for (n, d), bad in zip(cuda, bad_any) if bad]
    for name, d in host:
        bad = ~(torch.isfinite(d) & (d > 0))
        if bad.any():
            where = tuple(bad.nonzero()[0].tolist())
            problems.add(
                ValueError,
                f"{name}: descales must be finite and positive; {int(bad.sum())} of "
                f"{d.numel()} are not (the first: {d[where].item()} at (batch, kv_head) = {where})",
            )


def readable(t: torch.Tensor, on_cuda: bool) -> bool:
    """Whether `t`'s values may be read now: a host tensor's always; a CUDA tensor's only with
    `on_cuda` (a device synchronisation) and never while a CUDA graph is being captured."""
    if t.device.type == "cpu":
        return True
    return t.device.type == "cuda" and on_cuda and not torch.cuda.is_current_stream_capturing()


def _prepare_descales(
    q,
    k,
    given: tuple,
    tensors_ok: list[bool],
    cuda_values: bool,
    problems: ArgumentProblems,
    batch: int | None = None,
    batch_from: str = "",
) -> tuple:
    """The three descales as the kernels take them: all None, or contiguous float32 (batch, kv_heads)
    tensors with ones for those left out (three Nones where problems were found). `batch`: the
    number of sequences where it is not q's first dim (packed sequences; `batch_from` says where
    it comes from in an error)."""
    if all(d is None for d in given):
        return None, None, None
    if tensors_ok[0] and q.dtype == torch.bfloat16:
        problems.add(ValueError, "q_descale/k_descale/v_descale apply to float8_e4m3fn inputs only")
    related = all(tensors_ok)
    shape = (q.shape[0] if batch is None else batch, k.shape[-2]) if related else None
    device = q.device if tensors_ok[0] else None
    checked = [
        None if d is None else _checked_descale(name, d, shape, device, problems, batch_from)
        for name, d in zip(_DESCALES, given)
    ]
    _check_descale_values([(n, c) for n, c in zip(_DESCALES, checked) if c is not None], cuda_values, problems)
    if not related or problems.found:
        return None, None, None
    ones = torch.ones(shape, dtype=torch.float32, device=q.device) if None in given else None
    return tuple(ones if c is None else c.contiguous() for c in checked)


# ---- problem options: window, LSE, and the backend that serves them --------------------------------


def check_options(softmax_scale, causal, window_size, return_lse, problems: ArgumentProblems) -> tuple[int, int]:
    """Check the scalar options; returns window_size as (left, right) ints ((-1, -1) where bad)."""
    if softmax_scale is not None and (
        isinstance(softmax_scale, bool)
        or not isinstance(softmax_scale, (int, float))
        or not math.isfinite(softmax_scale)
        or softmax_scale <= 0
    ):
        problems.add(ValueError, f"softmax_scale: expected a positive finite number, got {softmax_scale!r}")
    if not isinstance(causal, bool):
        problems.add(TypeError, f"causal: expected bool, got {type(causal).__name__}")
    if not isinstance(return_lse, bool):
        problems.add(TypeError, f"return_lse: expected bool, got {type(return_lse).__name__}")
    if not (
        isinstance(window_size, (tuple, list))
        and len(window_size) == 2
        and all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in window_size)
    ):
        problems.add(TypeError, f"window_size: expected a pair of ints (left, right), got {window_size!r}")
        return -1, -1
    left, right = int(window_size[0]), int(window_size[1])
    if left < -1 or right < -1:
        problems.add(ValueError, f"window_size: each side must be >= 0, or -1 for unbounded; got {(left, right)}")
        return -1, -1
    return left, right


def window_bounds(window: tuple[int, int], causal: bool, max_left: int, max_right: int) -> tuple[int, int] | None:
    """The kernel's (WIN_L, WIN_R) for FlashAttention-3's window_size: query i sees keys j with
    i + off - left <= j <= i + off + right (off = seqlen_k - seqlen_q, bottom-right aligned), -1 is
    unbounded and causal makes right 0. None where the window bounds nothing beyond plain causal or
    full attention; an unbounded side becomes `max_left` / `max_right` (no key lies beyond them)."""
    left, right = window
    if causal:
        right = 0
    if left == -1 and (right == -1 or causal):
        return None
    return (max_left if left == -1 else left), (max_right if right == -1 else right)


def serving_config(config: KernelConfig) -> KernelConfig:
    """The config a Triton serving variant runs where the dispatcher chose `config`: it, if it is a Triton
    config (its serving variant runs a window, an LSE, packed sequences, a paged KV cache), else the Triton
    default of its head dims (for a paged KV cache: the Gluon kernels' twins take a window and write the
    LSE, so those never come here from a Gluon choice). Pointer loads run on 32-key blocks there: the
    serving variant's extra loop and bounds spill registers at more keys."""
    if config.backend != "triton":
        config = default_config(config.dtype, config.head_dim_qk, config.head_dim_v)
    if config.loads == "pointer" and config.block_n > 32:
        return config.replace(block_n=32)
    return config


def check_config(config, dtype, q, v, related: bool, problems: ArgumentProblems) -> None:
    """A forced `config`: a KernelConfig of the inputs' dtype and head dims (every option runs on either
    backend: a Gluon kernel's twins, a Triton kernel's serving variant)."""
    if config is not None and not isinstance(config, KernelConfig):
        problems.add(TypeError, f"config: expected a KernelConfig, got {type(config).__name__}")
        return
    if config is None:
        return
    if related and (config.dtype, config.head_dim_qk, config.head_dim_v) != (dtype, q.shape[-1], v.shape[-1]):
        problems.add(
            ValueError,
            f"config: built for {config.dtype} {config.head_dim_qk}/{config.head_dim_v}, "
            f"inputs are {dtype} {q.shape[-1]}/{v.shape[-1]}",
        )


@dataclass(frozen=True)
class _Problem:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dtype: str
    softmax_scale: float
    descales: tuple  # (q, k, v) contiguous float32 (batch, kv_heads) tensors, or three Nones
    window: tuple[int, int] = (-1, -1)  # window_size as given, checked


def _prepare(
    q,
    k,
    v,
    softmax_scale,
    causal,
    q_descale,
    k_descale,
    v_descale,
    config=None,
    *,
    cuda: bool = True,
    cuda_values: bool = False,
    window_size=(-1, -1),
    return_lse=False,
) -> _Problem:
    """Validate the arguments of flash_attn_func / explain; every problem is reported at once, each
    naming its argument, and the device last (a CPU user sees what else is wrong first). `cuda`:
    the tensors must be on a CUDA device (explain takes meta tensors); `cuda_values`: read CUDA
    descales to check their values (a device synchronisation; host descales are always read)."""
    problems = ArgumentProblems()
    tensors_ok = [check_tensor(name, t, problems) for name, t in (("q", q), ("k", k), ("v", v))]
    related = all(tensors_ok)
    if related:
        check_related(q, k, v, problems)
    window = check_options(softmax_scale, causal, window_size, return_lse, problems)
    dtype = _DTYPES[q.dtype] if tensors_ok[0] else None
    descales = _prepare_descales(q, k, (q_descale, k_descale, v_descale), tensors_ok, cuda_values, problems)
    check_config(config, dtype, q, v, related, problems)
    if cuda and tensors_ok[0]:  # k's and v's device is checked against q's above
        try:
            _on_cuda("q", q)
        except ValueError as exc:
            problems.add(ValueError, str(exc))
    problems.raise_any()
    fp8 = q.dtype == torch.float8_e4m3fn  # an FP8 V stored keys-fastest is what FP8 kernels read
    q, k = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k))
    v = v if v.stride(-1) == 1 or (fp8 and v.stride(1) == 1) else v.contiguous()
    scale = q.shape[3] ** -0.5 if softmax_scale is None else float(softmax_scale)
    return _Problem(q, k, v, dtype, scale, descales, window)


# ---- per-layout fast path -------------------------------------------------------------------------
# Validation, the dispatcher's choice, the grid and the launch arguments depend only on the shapes,
# strides, dtypes and devices of the arguments (and on the scale, causal flag, forced config and
# database layers), not on the data. The first call with a layout takes the checked path and leaves a
# _Plan under a key of exactly those properties; later calls with that layout and 16-byte aligned
# pointers allocate the output and launch (docs/results.md: dispatch overhead).

_PLAN_LIMIT = 4096


@dataclass(frozen=True)
class _Plan:
    launch: BoundLaunch | Callable  # a BoundLaunch, or a ServingLaunch
    out_shape: tuple[int, ...]
    device: torch.device
    ones: torch.Tensor | None  # stands in for descales left out when others are given
    only_device: bool  # the only visible GPU: no need to ask which device is current


_plans: dict[tuple, _Plan] = {}
#: layouts whose CUDA descales were read once on the checked path (a layout without a plan takes that path
#: on every call, which stays free of device synchronisation after its first)
_values_checked: set[tuple] = set()


def values_to_read(key: tuple | None, validate: bool) -> bool:
    """Whether the checked path reads CUDA argument values (a device synchronisation): on a layout's
    first call, with validate=True, or for arguments with no layout key."""
    if not isinstance(validate, bool):
        raise TypeError(f"validate: expected bool, got {type(validate).__name__}")
    return validate or key is None or key not in _values_checked


def values_read(key: tuple | None, read: bool) -> None:
    """Note that `key`'s values passed their checks (later calls of the layout skip reading them)."""
    if key is not None and read:
        if len(_values_checked) >= _PLAN_LIMIT:
            _values_checked.clear()
        _values_checked.add(key)


def remember(key: tuple | None, launch, out_shape: tuple, device: torch.device, given: tuple, descales: tuple) -> None:
    """Leave a _Plan for `key`'s layout (`given`: the descales as passed, `descales`: as launched)."""
    if launch is None or key is None:
        return
    ones = next((c for d, c in zip(given, descales) if d is None and c is not None), None)
    if len(_plans) >= _PLAN_LIMIT:  # unbounded layout streams: start over rather than grow
        _plans.clear()
    _plans[key] = _Plan(launch, out_shape, device, ones, torch.cuda.device_count() == 1)


def planned(tag: str, tensors: tuple, options: tuple, validate: bool) -> tuple[tuple | None, _Plan | None]:
    """A call's layout key and the plan to run it by, or None where it takes the checked path.

    The key holds every property the checked path depends on except data pointers: `tag` (which
    entry point), each of `tensors`' type, shape, strides, dtype and device (None for one left out),
    `options` with each one's type (so True and 1 differ) and the dispatcher. A plan runs only with
    validate=False and every pointer 16-byte aligned (the kernels were specialised on that when the
    plan was made). The key is None for arguments that make none (not tensors, unhashable values):
    the checked path names the problem."""
    try:  # (a list filled in a loop: the cheapest way to build it on every call)
        key = [tag, dispatch.dispatcher(), *options, *map(type, options)]
        for t in tensors:
            key.append(None if t is None else (type(t), t.shape, t.stride(), t.dtype, t.device))
        key = tuple(key)
        plan = _plans.get(key) if validate is False else None
    except Exception:
        return None, None
    return key, plan if plan is not None and aligned(tensors) else None


def aligned(tensors: tuple) -> bool:
    """Whether every tensor's data pointer (None: one left out) is 16-byte aligned."""
    ptrs = 0
    for t in tensors:
        if t is not None:
            ptrs |= t.data_ptr()
    return not ptrs & 15


def run_plan(plan: _Plan, q, k, v, q_descale, k_descale, v_descale, *extra):
    """The fast path's launch: allocate the output, fill in left-out descales, launch on the plan's device."""
    out = torch.empty(plan.out_shape, dtype=torch.bfloat16, device=plan.device)
    if plan.ones is not None:
        q_descale, k_descale, v_descale = (plan.ones if d is None else d for d in (q_descale, k_descale, v_descale))
    if plan.only_device or plan.device.index == torch.cuda.current_device():
        return plan.launch(q, k, v, out, q_descale, k_descale, v_descale, *extra)
    with torch.cuda.device(plan.device):
        return plan.launch(q, k, v, out, q_descale, k_descale, v_descale, *extra)


def empty_result(out: torch.Tensor, lse: torch.Tensor | None, no_keys: bool):
    """The result where no kernel runs: no queries, or no keys (zeros; an LSE of -inf, as
    FlashAttention-3 gives rows that see no key)."""
    if no_keys:
        out.zero_()
    if lse is None:
        return out
    return out, lse.fill_(float("-inf"))


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
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
    """Attention forward like FlashAttention-3's `flash_attn_func`; returns the bf16 output.

    q: (batch, seqlen_q, heads, head_dim_qk); k: (batch, seqlen_k, kv_heads, head_dim_qk);
    v: (batch, seqlen_k, kv_heads, head_dim_v); all torch.float8_e4m3fn or all torch.bfloat16,
    on one CUDA device. kv_heads must divide heads (GQA / MQA). Descales (fp8 only) are
    (batch, kv_heads) tensors; a missing one counts as ones. Causal masking is bottom-right
    aligned when seqlen_q != seqlen_k. The kernel comes from the tuning databases
    (`zyfa_tune.explain` says which and why); `config` forces one instead.
    Returns (batch, seqlen_q, heads, head_dim_v) in torch.bfloat16.

    Every argument is checked on the first call with a layout (shapes, strides, dtypes, devices,
    scale, flags); all problems are reported in one error naming each argument. Later calls with
    that layout skip the checks and never wait for the GPU. Descale values must be finite and
    positive: CUDA descales are read on a layout's first call (one synchronisation; not inside
    CUDA graph capture) and on every call with `validate=True` (which also repeats all the checks);
    otherwise they are used as given. q_descale * k_descale multiplies the scores of its (batch,
    kv head): a negative product attends to the least similar keys instead of the most similar, NaN
    or inf make the rows NaN, and a zero product is undefined (rows on the causal edge may be NaN:
    masking happens before the scale). v_descale multiplies the output: a negative one negates it,
    NaN or inf give NaN or inf.

    window_size=(left, right), as in FlashAttention-3: query i sees keys j with
    i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right; -1 is unbounded, and
    causal makes right 0. return_lse=True returns (out, lse): lse the float32 natural-log
    sum of exp(scores) (batch, heads, seqlen_q), -inf for a row that sees no key; the chosen kernel
    writes it (Gluon or Triton), and so does it run a window (a Gluon kernel's window twin, whose
    bounds are runtime arguments: one compile serves every window; a Triton kernel's serving variant).
    """
    options = (softmax_scale, causal, window_size, return_lse, config)
    key, plan = planned("dense", (q, k, v, q_descale, k_descale, v_descale), options, validate)
    if plan is not None:
        return run_plan(plan, q, k, v, q_descale, k_descale, v_descale)
    return _checked_call(
        key, q, k, v, softmax_scale, causal, q_descale, k_descale, v_descale, config, validate, window_size, return_lse
    )


def _checked_call(
    key,
    q,
    k,
    v,
    softmax_scale,
    causal,
    q_descale,
    k_descale,
    v_descale,
    config,
    validate: bool = False,
    window_size=(-1, -1),
    return_lse=False,
):
    """Validate, choose the kernel, launch; leave a _Plan for this layout when it needs no copies."""
    read_values = values_to_read(key, validate)
    p = _prepare(
        q,
        k,
        v,
        softmax_scale,
        causal,
        q_descale,
        k_descale,
        v_descale,
        config,
        cuda_values=read_values,
        window_size=window_size,
        return_lse=return_lse,
    )
    values_read(key, read_values)
    b, sq, h, dqk = p.q.shape
    sk, hk, dv = p.k.shape[1], p.k.shape[2], p.v.shape[3]
    out = torch.empty(b, sq, h, dv, dtype=torch.bfloat16, device=p.q.device)
    lse = torch.empty(b, h, sq, dtype=torch.float32, device=p.q.device) if return_lse else None
    if out.numel() == 0 or sk == 0:
        return empty_result(out, lse, sk == 0)
    window = window_bounds(p.window, causal, sk, sq)
    chosen = config or for_v_layout(
        dispatch.dispatcher().config_for(p.dtype, dqk, dv, causal, b, h, hk, sq, p.q.device.index), p.v
    )
    with torch.cuda.device(p.q.device):
        if window is None and lse is None:
            launch = bind(chosen, p.q, p.k, p.v, out, p.softmax_scale, causal, *p.descales)
        else:  # a window and an LSE run on either backend (a Gluon kernel's twin, a Triton serving variant)
            gluon = chosen.backend == "gluon"
            if window is not None and not gluon:
                chosen = config or for_v_layout(serving_config(chosen), p.v)
            serving = Serving(window=window, lse=lse)
            # (a causal window has right = 0: the Triton variant masks by the window alone; a Gluon kernel
            # keeps its causal schedule, whose diagonal is that right edge)
            causal_mask = causal and (window is None or gluon)
            bound = bind(chosen, p.q, p.k, p.v, out, p.softmax_scale, causal_mask, *p.descales, serving=serving)
            lse_shape = None if lse is None else tuple(lse.shape)
            launch = bound and ServingLaunch(bound, lse_shape, lse_only=chosen.backend == "gluon")
    given = (q_descale, k_descale, v_descale)
    if p.q is q and p.k is k and p.v is v and all(d is None or d is c for d, c in zip(given, p.descales)):
        remember(key, launch, (b, sq, h, dv), p.q.device, given, p.descales)
    return out if lse is None else (out, lse)


def explain(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = True,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    *,
    gpu: str | None = None,
) -> dispatch.Choice:
    """Which kernel `flash_attn_func` would run for these arguments, from which database, and why.

    Only shapes, strides and dtypes are read (a dispatch lookup: nothing is launched and no CUDA
    data is read), so the tensors may be on the 'meta' device: `torch.empty(..., device="meta")`
    asks about a shape with no GPU and no memory. `gpu` names the GPU to ask for, as
    `torch.cuda.get_device_name()` gives it (e.g. "NVIDIA H200"; a Hopper GPU); by default the
    tensors' CUDA device, else the current one. Arguments are checked as `flash_attn_func` checks
    them, except that the tensors need not be on a CUDA device."""
    p = _prepare(q, k, v, softmax_scale, causal, q_descale, k_descale, v_descale, cuda=False)
    b, sq, h, dqk = p.q.shape
    key = dispatch.problem_key(p.dtype, dqk, p.v.shape[3], causal, b, h, p.k.shape[2], sq)
    choice = dispatch.dispatcher().choose(key, device_key_for(gpu, p.q.device))
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


def device_key_for(gpu: str | None, device: torch.device) -> tuple[str, str, str]:
    """The dispatcher's device key for `explain`: of the GPU named, the tensors' or the current one."""
    if gpu is not None:
        if not isinstance(gpu, str) or not gpu:
            raise TypeError(f"gpu: expected a GPU name such as 'NVIDIA H200', got {gpu!r}")
        return gpu, f"{HOPPER.capability // 10}.{HOPPER.capability % 10}", GENERATOR_VERSION
    if device.type == "cuda":
        return dispatch.device_key(device.index)
    if torch.cuda.is_available():
        return dispatch.device_key(torch.cuda.current_device())
    raise ValueError(
        f"gpu: tensors on {device} name no GPU and none is visible; pass gpu=, a name as "
        "torch.cuda.get_device_name() gives it (e.g. 'NVIDIA H200')"
    )
