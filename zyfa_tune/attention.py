"""`attention`: the call model code makes. bf16 or fp16 (batch, seqlen, heads, dim) tensors in, the
output in the same dtype; in between, the inputs are quantised to FP8 with a recipe and the tuned
FP8 kernel runs on the codes.

It is a `torch.library` custom op (`torch.ops.zyfa_tune.attention`) with a fake implementation, so
`torch.compile(fullgraph=True)` traces through it and CUDA graphs capture it (after one eager call
of each shape: a new shape's kernel and launch plan are made on its first call).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from zyfa_tune.generator import KernelConfig
from zyfa_tune.generator.recipe import Recipe
from zyfa_tune.kernels import dispatch
from zyfa_tune.kernels.launch import for_v_layout

from .api import ArgumentProblems, check_related, check_tensor, device_key_for, explain, flash_attn_func
from .quantize import quantize_fp8

#: input dtypes of `attention` (FP8 codes go to `flash_attn_func`, which takes their descales)
INPUT_DTYPES = (torch.bfloat16, torch.float16)
_FP8_HINT = "; FP8 codes with their descales go to zyfa_tune.flash_attn_func"


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    softmax_scale: float | None = None,
    *,
    error_budget: float = dispatch.FA3_PARITY,
) -> torch.Tensor:
    """Attention forward from bf16 / fp16 inputs through FP8 kernels.

    q: (batch, seqlen_q, heads, head_dim_qk); k: (batch, seqlen_k, kv_heads, head_dim_qk);
    v: (batch, seqlen_k, kv_heads, head_dim_v); one dtype (bfloat16 or float16), one CUDA device;
    kv_heads divides heads (GQA / MQA). Causal masking is bottom-right aligned when the lengths differ.
    error_budget: the largest error accepted, relative to FlashAttention-3's FP8 kernel on the same
    inputs quantised plainly (default `FA3_PARITY`, 1.01: FA3-fp8's error within 1%). Returns (batch, seqlen_q, heads,
    head_dim_v) in the inputs' dtype.

    NaN or inf in an input never hangs or crashes the call: the output of the batch element holding
    it is then not finite, and every other batch element's output is what it would be without it
    (descales are per batch element and kv head).
    """
    scale = _check(q, k, v, causal, softmax_scale, error_budget)
    return torch.ops.zyfa_tune.attention(q, k, v, causal, scale, float(error_budget))


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
    error_budget: float = dispatch.FA3_PARITY,
    gpu: str | None = None,
) -> AttentionChoice:
    """The recipe and kernel `attention` would run for these arguments, and why (no launch; meta
    tensors ask about a shape without a GPU, `gpu` naming the GPU as `zyfa_tune.explain` takes it)."""
    scale = _check(q, k, v, causal, softmax_scale, error_budget)
    device = device_key_for(gpu, q.device)
    chosen = dispatch.dispatcher().choose_recipe(_key(q, k, v, causal), device, float(error_budget))
    codes = [torch.empty(t.shape, dtype=torch.float8_e4m3fn, device=t.device) for t in (q, k, v)]
    if chosen.kernel is None:
        return AttentionChoice(
            chosen.recipe, explain(*codes, softmax_scale=scale, causal=causal, gpu=gpu), chosen.detail
        )
    return AttentionChoice(chosen.recipe, chosen.kernel, chosen.detail)


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
) -> torch.Tensor:
    """Quantise with `recipe` and run the FP8 kernel (`config`, as V's layout reads it; None: the
    dispatcher's choice): the whole call, as `attention` runs it and the tuner times it. bf16 output."""
    q8, k8, v8, qd, kd, vd = quantize_fp8(q, k, v, softmax_scale=softmax_scale, **recipe.quantize_kwargs())
    if config is not None:
        config = for_v_layout(config, v8)
    return flash_attn_func(q8, k8, v8, softmax_scale, causal, qd, kd, vd, config=config)


def _key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool):
    b, sq, h, dqk = q.shape
    return dispatch.problem_key("fp8", dqk, v.shape[3], causal, b, h, k.shape[2], sq, api="bf16")


@torch.library.custom_op("zyfa_tune::attention", mutates_args=(), device_types="cuda")
def _attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float, error_budget: float
) -> torch.Tensor:
    recipe, config = recipe_for(q, k, v, causal, error_budget)
    out = run_recipe(q, k, v, causal, softmax_scale, recipe, config)
    return out if out.dtype == q.dtype else out.to(q.dtype)


@_attention_op.register_fake
def _(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float, error_budget: float
) -> torch.Tensor:
    return q.new_empty((*q.shape[:3], v.shape[3]))


def _check(q, k, v, causal, softmax_scale, error_budget) -> float:
    """Every argument checked, as `flash_attn_func` checks its own, all problems reported at once and
    the device last (so a CPU user sees all that is wrong); errors name the argument. Returns the
    softmax scale."""
    problems = ArgumentProblems()
    ok = [check_tensor(name, t, problems, INPUT_DTYPES, _FP8_HINT) for name, t in (("q", q), ("k", k), ("v", v))]
    if all(ok):
        check_related(q, k, v, problems)
    if not isinstance(causal, bool):
        problems.add(TypeError, f"causal: expected bool, got {type(causal).__name__}")
    if softmax_scale is not None and not _positive_finite(softmax_scale):
        problems.add(ValueError, f"softmax_scale: expected a positive finite number, got {softmax_scale!r}")
    if not _positive_finite(error_budget):
        problems.add(ValueError, f"error_budget: expected a positive finite number, got {error_budget!r}")
    if ok[0] and q.device.type not in ("cuda", "meta"):  # meta: shapes only (torch.compile, explain)
        problems.add(ValueError, f"q: tensor is on {q.device}; zyfa_tune kernels run on CUDA devices")
    problems.raise_any()
    return float(q.shape[3] ** -0.5 if softmax_scale is None else softmax_scale)


def _positive_finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0
