"""Verification of a config on the GPU: fresh random inputs, float64 reference, error gate
relative to the exact-softmax default on the same inputs, and a timing.

Used by `zyfa-tune verify` (re-check a database's best kernels on this GPU) and by the tuner's
worker, so that both apply the same rule.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from zyfa_tune.generator import ConfigError, KernelConfig
from zyfa_tune.generator.defaults import default_config
from zyfa_tune.generator.recipe import PLAIN, Recipe
from zyfa_tune.kernels.launch import for_v_layout

from .fa3 import padded
from .inputs import check_input_family, make_qkv
from .reference import attention_reference, max_abs_err, rel_l2
from .timing import Timing, time_cuda

log = logging.getLogger(__name__)

#: a variant passes when its error is at most this multiple of the exact default's on the same inputs
DEFAULT_ERROR_GATE = 1.25


def load_activations(path: str | os.PathLike) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Captured q, k, v (batch, seqlen, heads, dim) from a .pt or .safetensors file, as float32 on
    the CPU. A .pt file holds a dict with keys q, k, v or a (q, k, v) sequence; it is read with
    `torch.load(weights_only=True)`, so loading it runs no code from the file."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"inputs: {path} is not a file")
    if path.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError as exc:
            raise ValueError("inputs: reading .safetensors needs the safetensors package") from exc
        data = load_file(str(path))
    elif path.suffix in (".pt", ".pth"):
        try:
            data = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise ValueError(f"inputs: {path} is not a readable torch file: {exc}") from exc
    else:
        raise ValueError(f"inputs: {path} must end in .pt, .pth or .safetensors")
    if isinstance(data, dict):
        missing = [n for n in ("q", "k", "v") if n not in data]
        if missing:
            raise ValueError(f"inputs: {path} lacks {missing} (keys: {sorted(map(str, data))[:10]})")
        q, k, v = data["q"], data["k"], data["v"]
    elif isinstance(data, (list, tuple)) and len(data) == 3:
        q, k, v = data
    else:
        raise ValueError(f"inputs: {path} must hold a dict with q, k, v or a (q, k, v) sequence")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or not t.dtype.is_floating_point:
            raise ValueError(f"inputs: {name} must be a 4-dim floating tensor (batch, seqlen, heads, dim)")
    if (
        k.shape[:3] != v.shape[:3]
        or q.shape[0] != k.shape[0]
        or q.shape[3] != k.shape[3]
        or k.shape[2] == 0
        or q.shape[2] % k.shape[2]
    ):
        raise ValueError(f"inputs: inconsistent shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    return q.float(), k.float(), v.float()


def kernel_args(
    dtype: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, v_layout: str = "natural"
) -> tuple[tuple, dict]:
    """Float q, k, v -> (positional args, keyword args) for `flash_attn_func`: FP8 ones quantised
    per (batch, kv-head) with their descales (`quantize_fp8`, V in `v_layout`), BF16 ones cast."""
    from zyfa_tune.quantize import quantize_fp8

    if dtype == "fp8":
        q8, k8, v8, qd, kd, vd = quantize_fp8(q, k, v, v_layout=v_layout)
        return (q8, k8, v8), dict(q_descale=qd, k_descale=kd, v_descale=vd)
    return (q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16)), {}


def make_inputs(
    dtype: str,
    head_dim_qk: int,
    head_dim_v: int,
    *,
    batch: int,
    heads: int,
    kv_heads: int,
    seqlen: int,
    seed: int,
    seqlen_k: int | None = None,
    device: str = "cuda",
    family: str = "gaussian",
    v_layout: str = "natural",
):
    """Fresh q, k, v of an input family (`kernels.inputs`; "gaussian" = i.i.d. N(0, 1)), as
    `kernel_args`. Returns (positional args, keyword args) for `flash_attn_func`."""
    q, k, v = make_qkv(
        family,
        batch=batch,
        seqlen=seqlen,
        heads=heads,
        kv_heads=kv_heads,
        head_dim_qk=head_dim_qk,
        head_dim_v=head_dim_v,
        seed=seed,
        seqlen_k=seqlen_k,
        device=device,
    )
    return kernel_args(dtype, q, k, v, v_layout)


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str = ""
    error_rel_l2: float | None = None
    error_limit: float | None = None
    median_ms: float | None = None
    slowdown: float | None = None  # (now - stored) / stored
    error_max: float | None = None  # max |out - reference| (check_config fills it)
    timing: Timing | None = None  # the whole timing: quantiles, NVML clock/power/energy (check_config)
    skipped: bool = False  # not re-checked (reason says why); neither passed nor failed


@dataclass(frozen=True)
class Probe:
    """One shape's fresh inputs, their float64 reference and the error limit for variants.

    error_ref: the reference error the limit is `gate` times (recorded with each trial).
    recipe: for the bf16 API, the recipe the timed call quantises `args` (bf16 q, k, v) with before
    the kernel runs; v_codes: V's codes as that recipe lays them out (which kernel twin runs).
    packed: (cu_seqlens, max_seqlen) where args are packed sequences (`tuning.packed`): the call is
    then `flash_attn_varlen_func` (queries and keys of the same lengths)."""

    args: tuple
    kwargs: dict
    causal: bool
    reference: torch.Tensor
    error_limit: float
    error_ref: float | None = None
    recipe: Recipe | None = None
    v_codes: torch.Tensor | None = None
    packed: tuple[torch.Tensor, int] | None = None

    def runs(self, config: KernelConfig) -> KernelConfig:
        """The config that runs for `config` on these inputs (a K-major V's twin: launch.for_v_layout;
        packed sequences': varlen.packed_twin)."""
        if self.packed is not None:
            from zyfa_tune.varlen import packed_twin

            return packed_twin(config)
        return config if self.v_codes is None else for_v_layout(config, self.v_codes)


def _qkv(
    head_dim_qk: int,
    head_dim_v: int,
    *,
    batch: int,
    heads: int,
    kv_heads: int,
    seqlen: int,
    seed: int,
    inputs: str | None,
    family: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float q, k, v on the GPU: of the input family, or the captured activations `inputs` (whose shape
    must be the one given)."""
    check_input_family(family, inputs)
    if inputs is None:
        return make_qkv(
            family,
            batch=batch,
            seqlen=seqlen,
            heads=heads,
            kv_heads=kv_heads,
            head_dim_qk=head_dim_qk,
            head_dim_v=head_dim_v,
            seed=seed,
            device="cuda",
        )
    q, k, v = (t.cuda() for t in load_activations(inputs))
    if (q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.shape[3], v.shape[3]) != (
        batch,
        seqlen,
        heads,
        kv_heads,
        head_dim_qk,
        head_dim_v,
    ):
        raise ValueError(f"inputs: {inputs} holds q {tuple(q.shape)}, v {tuple(v.shape)}, not the shape asked for")
    return q, k, v


def make_probe(
    dtype: str,
    head_dim_qk: int,
    head_dim_v: int,
    *,
    batch: int,
    heads: int,
    kv_heads: int,
    seqlen: int,
    causal: bool = True,
    seed: int = 0,
    gate: float = DEFAULT_ERROR_GATE,
    inputs: str | None = None,
    family: str = "gaussian",
    fa3: bool = False,
) -> Probe:
    """Inputs + reference + limit = gate x the reference error on the same inputs: FA3-fp8's on the
    same codes where `fa3` and it imports (the tuner's rule), else the exact default config's.
    Random inputs come from the input family `family` (`kernels.inputs`); `inputs` names a file of
    captured activations (load_activations) used instead, whose shape must be the one given."""
    q, k, v = _qkv(
        head_dim_qk,
        head_dim_v,
        batch=batch,
        heads=heads,
        kv_heads=kv_heads,
        seqlen=seqlen,
        seed=seed,
        inputs=inputs,
        family=family,
    )
    args, kw = kernel_args(dtype, q, k, v)
    ref = attention_reference(*args, causal=causal, **kw)
    error_ref = reference_error(dtype, args, kw, causal, ref, fa3=fa3)
    return Probe(args, kw, causal, ref, gate * error_ref, error_ref)


def make_recipe_probe(
    head_dim_qk: int,
    head_dim_v: int,
    recipe: Recipe,
    *,
    batch: int,
    heads: int,
    kv_heads: int,
    seqlen: int,
    causal: bool = True,
    seed: int = 0,
    gate: float = DEFAULT_ERROR_GATE,
    inputs: str | None = None,
    family: str = "gaussian",
) -> Probe:
    """The bf16 API's probe: bf16 inputs, their float64 reference (unquantised), and limit = gate x the
    reference error: FA3-fp8's on the plainly quantised inputs where it imports, else the exact
    default config's on those codes. The timed call quantises with `recipe` and runs the kernel."""
    from zyfa_tune.quantize import quantize_fp8

    q, k, v = (
        t.to(torch.bfloat16)
        for t in _qkv(
            head_dim_qk,
            head_dim_v,
            batch=batch,
            heads=heads,
            kv_heads=kv_heads,
            seqlen=seqlen,
            seed=seed,
            inputs=inputs,
            family=family,
        )
    )
    ref = attention_reference(q, k, v, causal=causal)
    codes, kw = kernel_args("fp8", q, k, v)
    error_ref = reference_error("fp8", codes, kw, causal, ref, fa3=True)
    del codes, kw
    v_codes = quantize_fp8(q, k, v, **recipe.quantize_kwargs())[2]
    return Probe((q, k, v), {}, causal, ref, gate * error_ref, error_ref, recipe, v_codes)


def reference_error(dtype: str, args: tuple, kw: dict, causal: bool, reference: torch.Tensor, *, fa3: bool) -> float:
    """Rel. L2 error against `reference` of FA3's FP8 kernel on these codes (`fa3` and the
    fa3_fwd_interface wheel importable; a width FA3 lacks zero-padded to its next), else of the exact
    default config on them."""
    from zyfa_tune.api import flash_attn_func

    if fa3 and dtype == "fp8":
        try:
            from fa3_fwd_interface import flash_attn_func as fa3_func
        except ImportError:
            pass
        else:
            out = padded(fa3_func)(*args, causal=causal, **kw)
            return rel_l2(out[0] if isinstance(out, tuple) else out, reference)
    base = default_config(dtype, args[0].shape[3], args[2].shape[3])
    return rel_l2(flash_attn_func(*args, causal=causal, config=base, **kw), reference)


def _call(config: KernelConfig, probe: Probe) -> Callable[[], torch.Tensor]:
    """`config`'s call on the probe's inputs (what check_config times and replay_ms captures): the
    kernel on FP8 codes, or for the bf16 API quantiser and kernel together."""
    from zyfa_tune.api import flash_attn_func

    if probe.recipe is not None:
        from zyfa_tune.attention import run_recipe

        q, k, v = probe.args
        scale = q.shape[3] ** -0.5
        return lambda: run_recipe(q, k, v, probe.causal, scale, probe.recipe, config)
    if probe.packed is not None:
        from zyfa_tune.varlen import flash_attn_varlen_func

        cu, most = probe.packed
        return lambda: flash_attn_varlen_func(
            *probe.args, cu, cu, most, most, causal=probe.causal, config=config, **probe.kwargs
        )
    return lambda: flash_attn_func(*probe.args, causal=probe.causal, config=config, **probe.kwargs)


def check_config(config: KernelConfig, probe: Probe, *, reps: int = 20) -> Verdict:
    """Gate `config`'s error on the probe's inputs, then time it (CUDA events, median)."""
    call = _call(config, probe)
    out = call()
    err = rel_l2(out, probe.reference)
    emax = max_abs_err(out, probe.reference)
    del out
    if not err <= probe.error_limit:  # NaN fails too
        return Verdict(False, f"error {err:.3e} > {probe.error_limit:.3e}", err, probe.error_limit, error_max=emax)
    t = time_cuda([call], warmup=3, reps=reps)
    return Verdict(True, "", err, probe.error_limit, t.median_ms, error_max=emax, timing=t)


def replay_ms(config: KernelConfig, probe: Probe, *, reps: int = 20) -> float | None:
    """Median device time of the call replayed from a CUDA graph: what its kernels take without the
    host's launch work. None where the call cannot be captured (the reason is logged)."""
    call = _call(config, probe)
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # (warm-up off the capture stream, as torch.cuda.graphs asks)
            call()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
    except Exception as exc:  # a capture error is not the kernel's failure: verify keeps its verdict
        log.warning("graph replay of %s not possible: %s", config.summary(), exc)
        return None
    return time_cuda([graph.replay], warmup=3, reps=reps).median_ms


def entry_shape(entry) -> tuple[int, int, int, int]:
    """(batch, heads, kv_heads, seqlen) a stored best entry is re-checked at: the shape its trial
    measured, or where that was not recorded, its bucket's largest shape."""
    k = entry.key
    batch, heads, seqlen = entry.batch, entry.heads, entry.seqlen
    if not (batch and heads and seqlen):
        heads = max(k.gqa_group, min(k.bh_bucket, 64))
        batch, seqlen = max(1, k.bh_bucket // heads), k.seqlen_bucket
    return batch, heads, max(1, heads // k.gqa_group), seqlen


def verify_entry(
    entry,
    *,
    max_slowdown: float = 0.10,
    gate: float = DEFAULT_ERROR_GATE,
    fresh_ms: Callable[[object], float | None] | None = None,
) -> Verdict:
    """Re-check one stored best entry (zyfa_tune.db.BestEntry) on this GPU as it was measured (a bf16-API
    entry: its recipe's quantiser and its kernel on bf16 inputs; a packed-sequence entry is skipped, its
    lengths not being stored). A timing more than
    max_slowdown above the stored one is taken again before the entry fails (the better median
    counts): short, launch-bound entries can read 20-110% slow in one process and on record in the
    next, because their time is the host's. If it is still slow, the call is replayed from a CUDA
    graph: when its kernels alone are within max_slowdown of the stored time, the entry passes as
    launch-bound (the reason says so) and the slowdown is the host's, not the kernel's. Still slow,
    `fresh_ms(entry)` (the CLI: the entry timed by a new worker process, zyfa_tune.tuning.worker)
    gets the last word: heavy entries late in a long verify can read 7-11% slow and on record in a
    fresh process, so a kernel fails only when it is slow there too."""
    try:
        config = KernelConfig.from_json(entry.config_json)
        recipe = PLAIN if entry.recipe is None else Recipe.from_json(entry.recipe)
    except ConfigError as exc:
        return Verdict(False, f"invalid config or recipe: {exc}")
    if entry.key.packed:  # (its trial kept the class and the longest length, not the lengths it timed)
        return Verdict(
            True, "skipped: a packed-sequence entry keeps no lengths to re-time; re-tune its mix", skipped=True
        )
    batch, heads, kv_heads, seqlen = entry_shape(entry)
    torch.cuda.empty_cache()  # this entry's inputs in fresh allocations, not in blocks earlier entries left cached
    where = dict(batch=batch, heads=heads, kv_heads=kv_heads, seqlen=seqlen, causal=entry.key.causal, gate=gate)
    if entry.key.api == "bf16":  # the whole call as it was timed: the recipe's quantiser and the kernel
        probe = make_recipe_probe(config.head_dim_qk, config.head_dim_v, recipe, **where)
    else:
        probe = make_probe(config.dtype, config.head_dim_qk, config.head_dim_v, **where)
    v = check_config(config, probe)
    if not v.ok:
        return v

    def slowdown(ms: float) -> float:
        return (ms - entry.median_ms) / entry.median_ms

    if slowdown(v.median_ms) > max_slowdown:  # once more: a launch-bound call's median moves with the host
        again = check_config(config, probe)
        if again.ok and again.median_ms < v.median_ms:
            v = again
    v = replace(v, slowdown=slowdown(v.median_ms))
    if v.slowdown <= max_slowdown:
        return v
    device_ms = replay_ms(config, probe)
    if device_ms is not None and slowdown(device_ms) <= max_slowdown:
        return replace(
            v, reason=f"launch-bound: the call {v.slowdown:+.1%}, its kernels {device_ms:.3f} ms (graph replay)"
        )
    fresh = fresh_ms(entry) if fresh_ms is not None else None
    if fresh is None:  # (no process asked for, or the kernel failed there: this reading stands)
        return replace(v, ok=False, reason=f"{v.slowdown:+.1%} slower than stored")
    if slowdown(fresh) <= max_slowdown:
        return replace(v, reason=f"{v.slowdown:+.1%} here, {slowdown(fresh):+.1%} in a fresh process ({fresh:.3f} ms)")
    return replace(
        v, ok=False, reason=f"{v.slowdown:+.1%} slower than stored ({slowdown(fresh):+.1%} in a fresh process)"
    )
