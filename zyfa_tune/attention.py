"""`attention`: the call model code makes. bf16 or fp16 (batch, seqlen, heads, dim) tensors in, the
output in the same dtype; in between, the inputs are quantised to FP8 with a recipe and the tuned
FP8 kernel runs on the codes. `attention_varlen` is the same for packed sequences of different
lengths (a serving batch), each sequence quantised with its own scales.

Both are `torch.library` custom ops (`torch.ops.zyfa_tune.attention`, `.attention_varlen`) with fake
implementations, so `torch.compile(fullgraph=True)` traces through them and CUDA graphs capture them
(after one eager call of each shape: a new shape's kernel and launch plan are made on its first call).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from zyfa_tune.generator import KernelConfig
from zyfa_tune.generator.recipe import Recipe
from zyfa_tune.kernels import dispatch
from zyfa_tune.kernels.launch import for_v_layout

from .api import (
    ArgumentProblems,
    check_options,
    check_related,
    check_tensor,
    device_key_for,
    explain,
    flash_attn_func,
    serving_config,
    window_bounds,
)
from .quantize import quantize_fp8, quantize_fp8_varlen
from .varlen import _check_cu, _check_max, flash_attn_varlen_func

#: input dtypes of `attention` (FP8 codes go to `flash_attn_func`, which takes their descales)
INPUT_DTYPES = (torch.bfloat16, torch.float16)
_FP8_HINT = "; FP8 codes with their descales go to zyfa_tune.flash_attn_func"
_PACKED = ("total_tokens", "heads", "head_dim")
Window = tuple[int, int]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    softmax_scale: float | None = None,
    *,
    window_size: Window = (-1, -1),
    return_lse: bool = False,
    error_budget: float = dispatch.FA3_PARITY,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention forward from bf16 / fp16 inputs through FP8 kernels.

    q: (batch, seqlen_q, heads, head_dim_qk); k: (batch, seqlen_k, kv_heads, head_dim_qk);
    v: (batch, seqlen_k, kv_heads, head_dim_v); one dtype (bfloat16 or float16), one CUDA device;
    kv_heads divides heads (GQA / MQA). Causal masking is bottom-right aligned when the lengths differ.
    window_size=(left, right) and return_lse as `flash_attn_func`'s (FlashAttention-3's): query i sees
    keys i + seqlen_k - seqlen_q - left to i + seqlen_k - seqlen_q + right, -1 unbounded, causal making
    right 0; with return_lse=True the result is (out, lse), lse the float32 natural-log sum of
    exp(scores) (batch, heads, seqlen_q), -inf for a row that sees no key. A window and an LSE run on the
    recipe's kernel itself (a Gluon kernel's twins, a Triton kernel's serving variant), and an LSE a
    recipe without K smoothing (which shifts each row's scores, leaving the softmax but not its sum as
    it is).
    error_budget: the largest error accepted, relative to FlashAttention-3's FP8 kernel on the same
    inputs quantised plainly (default `FA3_PARITY`, 1.01: FA3-fp8's error within 1%). Returns (batch, seqlen_q, heads,
    head_dim_v) in the inputs' dtype.

    NaN or inf in an input never hangs or crashes the call: the output of the batch element holding
    it is then not finite, and every other batch element's output is what it would be without it
    (descales are per batch element and kv head).
    """
    scale, window = _check(q, k, v, causal, softmax_scale, error_budget, window_size, return_lse)
    got = torch.ops.zyfa_tune.attention(q, k, v, causal, scale, float(error_budget), *window, return_lse)
    return (got[0], got[1]) if return_lse else got[0]


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool = True,
    softmax_scale: float | None = None,
    *,
    window_size: Window = (-1, -1),
    return_lse: bool = False,
    error_budget: float = dispatch.FA3_PARITY,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`attention` over packed sequences of different lengths, as `flash_attn_varlen_func` takes them.

    q: (total_q, heads, head_dim_qk); k: (total_k, kv_heads, head_dim_qk); v: (total_k, kv_heads,
    head_dim_v); one dtype (bfloat16 or float16), one CUDA device. cu_seqlens_q/_k: int32 (batch + 1,)
    cumulative lengths on that device (sequences may be empty); max_seqlen_q/_k: at least the longest.
    Each sequence is quantised with its own (sequence, kv head) scales (`quantize_fp8_varlen`: one
    launch per pass for Q, K and V, no read of the lengths), so packing a sequence changes its result
    no more than batching it does, then `flash_attn_varlen_func` runs on the codes; the lengths are
    checked there (their values on a layout's first call). window_size and return_lse as there (lse
    float32 (heads, total_q)). Packed calls have no bf16-API recipes yet: the plain recipe and the FP8
    API's kernels (at or below FA3-fp8's error) run whatever the error_budget, which is checked as
    `attention`'s. Returns (total_q, heads, head_dim_v) in the inputs' dtype.
    """
    lengths = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    scale, window = _check(q, k, v, causal, softmax_scale, error_budget, window_size, return_lse, lengths)
    lengths = (cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k))
    got = torch.ops.zyfa_tune.attention_varlen(q, k, v, *lengths, causal, scale, *window, return_lse)
    return (got[0], got[1]) if return_lse else got[0]


@dataclass(frozen=True)
class AttentionChoice:
    """What `attention` runs for some arguments: the quantisation recipe, the kernel's choice, and why
    (a bf16-API entry within the error budget, or the FP8 API's kernel on plainly quantised codes)."""

    recipe: Recipe
    kernel: dispatch.Choice
    why: str = ""

    def __str__(self) -> str:
        text = f"recipe {self.recipe.summary()}; kernel {self.kernel.config.summary()} ({self.kernel.source})"
        return f"{text}; {self.why}" if self.why else text


def explain_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    softmax_scale: float | None = None,
    *,
    window_size: Window = (-1, -1),
    return_lse: bool = False,
    error_budget: float = dispatch.FA3_PARITY,
    gpu: str | None = None,
) -> AttentionChoice:
    """The recipe and kernel `attention` would run for these arguments, and why (no launch; meta
    tensors ask about a shape without a GPU, `gpu` naming the GPU as `zyfa_tune.explain` takes it)."""
    scale, window = _check(q, k, v, causal, softmax_scale, error_budget, window_size, return_lse)
    device = device_key_for(gpu, q.device)
    chosen = dispatch.dispatcher().choose_recipe(_key(q, k, v, causal), device, float(error_budget))
    kernel = chosen.kernel
    if kernel is None:
        codes = [torch.empty(t.shape, dtype=torch.float8_e4m3fn, device=t.device) for t in (q, k, v)]
        kernel = explain(*codes, softmax_scale=scale, causal=causal, gpu=gpu)
    recipe, config = with_options(chosen.recipe, kernel.config, causal, window, return_lse)
    why = [chosen.detail]
    if recipe != chosen.recipe:
        why.append("an LSE: no K smoothing (it shifts each row's scores)")
    if config != kernel.config:
        kernel = replace(kernel, config=config)
        why.append("a window: the Triton serving variant's config")
    return AttentionChoice(recipe, kernel, "; ".join(w for w in why if w))


def with_options(
    recipe: Recipe, config: KernelConfig | None, causal: bool, window: Window, return_lse: bool
) -> tuple[Recipe, KernelConfig | None]:
    """The recipe and kernel that serve a window or an LSE where (recipe, config) serves the plain call:
    an LSE of K-smoothed scores would be each row's q . mean(K) off, so K is not smoothed; a window bounds
    the scores themselves (smoothing K shifts a row's scores by one constant, so it is harmless there).
    A Gluon kernel stays (its twins take the window and write the LSE); with a window a Triton kernel
    becomes the config its serving variant runs (`serving_config`)."""
    if return_lse and recipe.smooth_k:
        recipe = replace(recipe, smooth_k=False)
    bounded = window_bounds(window, causal is True, 0, 0) is not None
    if config is not None and config.backend == "triton" and bounded:
        config = serving_config(config)
    return recipe, config


def recipe_for(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, error_budget: float
) -> tuple[Recipe, KernelConfig | None]:
    """The recipe and kernel for these inputs (on their CUDA device): the fastest bf16-API entry of the
    tuning databases whose error is within `error_budget` x the reference's; else the plain recipe
    and None, i.e. `flash_attn_func`'s own choice on plainly quantised codes (the FP8 API's kernels,
    gated against the exact default kernel: at or below FA3-fp8's error)."""
    b, sq, h, dqk = q.shape
    return dispatch.dispatcher().attention_choice(
        dqk, v.shape[3], causal, b, h, k.shape[2], sq, q.device.index, error_budget
    )


def run_recipe(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    recipe: Recipe,
    config: KernelConfig | None,
    *,
    window_size: Window = (-1, -1),
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Quantise with `recipe` and run the FP8 kernel (`config`, as V's layout reads it; None: the
    dispatcher's choice): the whole call, as `attention` runs it and the tuner times it. bf16 output
    (and the LSE with return_lse), `with_options` applied for a window or an LSE."""
    recipe, config = with_options(recipe, config, causal, window_size, return_lse)
    q8, k8, v8, qd, kd, vd = quantize_fp8(q, k, v, softmax_scale=softmax_scale, **recipe.quantize_kwargs())
    if config is not None:
        config = for_v_layout(config, v8)
    return flash_attn_func(q8, k8, v8, softmax_scale, causal, qd, kd, vd, window_size, return_lse, config=config)


def _key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool):
    b, sq, h, dqk = q.shape
    return dispatch.problem_key("fp8", dqk, v.shape[3], causal, b, h, k.shape[2], sq, api="bf16")


# ---- the custom ops: the output, and the LSE with return_lse (a list: one schema for both) ----------


@torch.library.custom_op("zyfa_tune::attention", mutates_args=(), device_types="cuda")
def _attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    error_budget: float,
    window_left: int,
    window_right: int,
    return_lse: bool,
) -> list[torch.Tensor]:
    recipe, config = recipe_for(q, k, v, causal, error_budget)
    window = (window_left, window_right)
    got = run_recipe(q, k, v, causal, softmax_scale, recipe, config, window_size=window, return_lse=return_lse)
    return _results(got, q.dtype, return_lse)


@_attention_op.register_fake
def _(q, k, v, causal, softmax_scale, error_budget, window_left, window_right, return_lse):
    out = q.new_empty((*q.shape[:3], v.shape[3]))
    return [out, q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)] if return_lse else [out]


@torch.library.custom_op("zyfa_tune::attention_varlen", mutates_args=(), device_types="cuda")
def _attention_varlen_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    return_lse: bool,
) -> list[torch.Tensor]:
    q8, k8, v8, qd, kd, vd = quantize_fp8_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k)
    lengths = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    window = (window_left, window_right)
    got = flash_attn_varlen_func(q8, k8, v8, *lengths, softmax_scale, causal, qd, kd, vd, window, return_lse)
    return _results(got, q.dtype, return_lse)


@_attention_varlen_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, wl, wr, return_lse):
    out = q.new_empty((*q.shape[:2], v.shape[2]))
    return [out, q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)] if return_lse else [out]


def _results(got, dtype: torch.dtype, return_lse: bool) -> list[torch.Tensor]:
    """A kernel call's bf16 output in the inputs' dtype, and its LSE where asked for."""
    out, lse = got if return_lse else (got, None)
    out = out if out.dtype == dtype else out.to(dtype)
    return [out] if lse is None else [out, lse]


def _check(q, k, v, causal, softmax_scale, error_budget, window_size, return_lse, packed=None) -> tuple[float, Window]:
    """Every argument checked, as `flash_attn_func` checks its own, all problems reported at once and
    the device last (so a CPU user sees all that is wrong); errors name the argument. `packed`:
    (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) of packed (total, heads, dim) tensors,
    checked as `flash_attn_varlen_func` checks them before reading their values. Returns the softmax
    scale and the window."""
    problems = ArgumentProblems()
    shape = {} if packed is None else {"dims": _PACKED}
    ok = [
        check_tensor(name, t, problems, INPUT_DTYPES, _FP8_HINT, **shape) for name, t in (("q", q), ("k", k), ("v", v))
    ]
    if all(ok):
        check_related(q, k, v, problems)
    if packed is not None:
        _check_lengths(*packed, q if ok[0] else None, k if ok[1] else None, problems)
    window = check_options(softmax_scale, causal, window_size, return_lse, problems)
    if not _positive_finite(error_budget):
        problems.add(ValueError, f"error_budget: expected a positive finite number, got {error_budget!r}")
    if ok[0] and q.device.type not in ("cuda", "meta"):  # meta: shapes only (torch.compile, explain)
        problems.add(ValueError, f"q: tensor is on {q.device}; zyfa_tune kernels run on CUDA devices")
    problems.raise_any()
    return float(q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale), window


def _check_lengths(cu_q, cu_k, max_q, max_k, q, k, problems: ArgumentProblems) -> None:
    """Cumulative lengths and longest lengths on their own and against the tensors' shapes."""
    ok = [_check_cu(name, cu, q, problems) for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k))]
    if all(ok) and cu_q.shape != cu_k.shape:
        problems.add(
            ValueError, f"cu_seqlens_k: {cu_k.shape[0]} entries, but cu_seqlens_q has {cu_q.shape[0]} (both batch + 1)"
        )
    batch = cu_q.shape[0] - 1 if all(ok) and cu_q.shape == cu_k.shape else None
    totals = (None if q is None else q.shape[0], None if k is None else k.shape[0])
    _check_max(("max_seqlen_q", "max_seqlen_k"), (max_q, max_k), totals, batch, problems)


def _positive_finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0
