"""The "simulate" runner: the tuning loop without a GPU, for CI and for tests of the loop. Its numbers
are a simulation, not a measurement of this machine: they say whether the loop works, never which
kernel is fastest.

  * stored: a trial of the same kernel (the config's source hash, or the same canonical config JSON)
    for the same problem class (dtype, head dims, causal, GQA group, seqlen bucket, B*H bucket, and
    packed sequences' total tokens bucket;
    `zyfa_tune.db.ProblemKey`) in the runner's database (by default the one shipped with zyfa-tune)
    -> that trial's status, times, TFLOP/s, errors and NVML readings. A trial measured at exactly the
    task's shape is preferred, then the newest; if its shape differs within the bucket, times and
    energy are scaled by the FLOP ratio (TFLOP/s kept). Message "simulate: stored trial #<id> ...".
    Stored configs are not compiled again (the stored status says whether they compiled).
  * modelled: every other config is compiled for real for sm_90a (`compile_check`: no GPU needed), so
    compile errors, spills, serialised wgmmas and shared memory above the Hopper limit are real
    "compile_error"s. A config that compiles gets a deterministic synthetic measurement: TFLOP/s from a
    smooth function of its fields (`synthetic_tflops`: one factor table per modelled field, covering
    every value the generator accepts, so every point of every search space has a number; fields the
    model does not list leave it unchanged), times a fixed +-2% perturbation from a SHA-256 of (config,
    shape); an error from dtype, softmax, rowsum, p_scale_log2 and scale_block (lean P ~1.35x the exact
    default's error, hence "wrong" under the default gate), gated like the GPU runner against the same
    model's error for the default config. Message "simulate: synthetic ...". No clocks or power. The
    same config and shape give the same numbers in every run; the seed and input family do not enter.
  * the bf16 API (`task.api == "bf16"`): stored trials match on the api and recipe too. The model
    times the whole call: the kernel as the recipe's V layout makes it run (K-major V codes: a
    natural-V FP8 config runs as its transposed twin, no V^T copy), plus a modelled quantiser cost
    per recipe (`quantiser_ms`: a pass over Q, K and V; balanced V rounding, rotation and K smoothing
    add to it), less the V^T copy a V^T-reading kernel needs of natural V codes (the kernel's model
    includes it; K-major codes need none). Its error is the kernel's
    times a factor per recipe field (`RECIPE_ERROR`). `error_ref` is the modelled error of the exact
    default config on plainly quantised codes (the reference when FA3 is not importable), and the
    gate compares error / error_ref, as on the GPU.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from typing import Any

from zyfa_tune.db.records import TRIAL_FLOATS
from zyfa_tune.generator import HOPPER, ConfigError, KernelConfig
from zyfa_tune.generator.recipe import PLAIN, Recipe

from .compile_check import CompileCheck, compile_check
from .task import Reporter, Shape, Task, exception_text, shape_key, tail, task_flops

_KEY_FIELDS = (
    "dtype",
    "head_dim_qk",
    "head_dim_v",
    "causal",
    "gqa_group",
    "seqlen_bucket",
    "bh_bucket",
    "api",
    "tokens_bucket",
    "recipe",
)


class SimulationRunner:
    """Stored measurements where the database has them, else a real sm_90a compile and the model."""

    def __init__(self, db: str) -> None:
        from zyfa_tune.db import open_store

        self.db = db
        self._by_hash: dict[tuple, list[dict]] = {}
        self._by_json: dict[tuple, list[dict]] = {}
        with open_store(db, readonly=True, create=False) as store:
            rows = store.trials()
        for row in rows:
            try:
                canonical = KernelConfig.from_json(row["config_json"]).to_json()
                key = tuple(row[k] for k in _KEY_FIELDS)
            except (ConfigError, KeyError, TypeError):
                continue
            self._by_hash.setdefault((row["source_hash"], key), []).append(row)
            self._by_json.setdefault((canonical, key), []).append(row)
        self._compiled: dict[tuple[KernelConfig, bool], CompileCheck] = {}

    def stored(
        self,
        config: KernelConfig,
        source_hash: str,
        shape: Shape,
        causal: bool,
        api: str = "fp8",
        recipe: str | None = None,
    ) -> dict | None:
        pk = shape_key(shape, config.dtype, config.head_dim_qk, config.head_dim_v, causal, api)
        key = tuple(getattr(pk, k) for k in _KEY_FIELDS[:-1]) + (recipe,)
        found = {
            r["id"]: r
            for r in self._by_hash.get((source_hash, key), []) + self._by_json.get((config.to_json(), key), [])
        }
        if not found:
            return None
        exact = (shape.batch, shape.heads, shape.seqlen)
        row = max(found.values(), key=lambda r: ((r["batch"], r["heads"], r["seqlen"]) == exact, r["id"]))
        out = {f: row[f] for f in TRIAL_FLOATS}
        msg = f"simulate: stored trial #{row['id']} ({row['gpu_name']}, {row['study'] or 'no study'})"
        if (row["batch"], row["heads"], row["seqlen"]) != exact:
            if row["batch"] and row["heads"] and row["seqlen"]:
                then = task_flops(
                    config.head_dim_qk,
                    config.head_dim_v,
                    Shape(row["batch"], row["heads"], row["heads"], row["seqlen"]),
                    causal,
                )
                now = Shape(shape.batch, shape.heads, shape.heads, shape.seqlen)  # packed: padded, as `then`
                ratio = task_flops(config.head_dim_qk, config.head_dim_v, now, causal) / then
                for f in ("median_ms", "p20_ms", "p80_ms", "energy_j"):
                    if out[f] is not None:
                        out[f] *= ratio
                msg += (
                    f", measured at B={row['batch']} H={row['heads']} S={row['seqlen']}: "
                    f"times scaled by the FLOP ratio {ratio:.3g}"
                )
            else:
                msg += ", measured at an unrecorded shape of the same class"
        if row["message"]:
            msg += f"; stored message: {row['message']}"
        out.update(status=row["status"], message=tail(msg))
        return out

    def compiled(self, config: KernelConfig, causal: bool) -> CompileCheck:
        key = (config, causal)
        if key not in self._compiled:
            self._compiled[key] = compile_check(config, causal)
        return self._compiled[key]

    def run(self, config: KernelConfig, task: Task, reporter: Reporter) -> None:
        reporter.setup_done()
        for i, shape in enumerate(task.shapes):
            reporter.result(i, self.answer(config, shape, task))

    def answer(self, config: KernelConfig, shape: Shape, task: Task) -> dict[str, Any]:
        """TrialResult fields for one shape: stored, compile error, or synthetic."""
        from zyfa_tune.generator import emit

        try:
            source_hash = emit(config).source_hash
        except Exception as exc:  # emission failed: a compile error
            return dict(status="compile_error", message=exception_text(exc))
        stored = self.stored(config, source_hash, shape, task.causal, task.api, task.recipe)
        if stored is not None:
            return stored
        check = self.compiled(config, task.causal)
        if check.error is not None:
            return dict(status="compile_error", message=f"simulate: sm_90a compile: {check.error}")
        recipe = None if task.api == "fp8" else PLAIN if task.recipe is None else Recipe.from_json(task.recipe)
        fields_ = synthetic_measurement(config, shape, task.causal, task.gate, recipe)
        fields_["message"] += f"; sm_90a: {check.registers} registers, {check.shared_bytes} B shared, no spills"
        return fields_


# ---- the synthetic model -----------------------------------------------------------------------


def unit_hash(*parts: object) -> float:
    """A deterministic number in [0, 1) from `parts` (same in every process and run)."""
    digest = hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def _interp(x: float, points: list[tuple[float, float]]) -> float:
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]


#: Triton kernels: the peak at head dim 128 (TFLOP/s before the seqlen saturation), placed so the
#: default configs land near the H200 numbers of the shipped database; then one factor per field.
_PEAK = {"fp8": 826.0, "bf16": 500.0}
_HEAD = {
    "fp8": [(64, 0.74), (96, 0.75), (128, 1.0), (160, 1.07), (256, 1.04)],
    "bf16": [(64, 0.95), (96, 0.98), (128, 1.0), (160, 0.92), (256, 1.1)],
}
_BLOCK_M = {"fp8": {64: 1.0, 128: 0.95, 192: 0.86, 256: 0.78}, "bf16": {64: 0.86, 128: 1.0, 192: 0.92, 256: 0.84}}
_BLOCK_N_SMALL = {32: 0.72, 64: 0.9, 128: 1.0, 192: 0.95, 256: 0.9}  # head dims <= 128
_BLOCK_N_LARGE = {32: 0.8, 64: 1.0, 128: 0.93, 192: 0.84, 256: 0.75}  # larger head dims
_STAGES = {1: 0.72, 2: 0.93, 3: 1.0, 4: 0.98, 5: 0.95}
_ROWSUM = {"fp32": 1.0, "rounded": 0.995, "mma": 0.8}
_ERROR = {"fp8": 0.0210, "bf16": 0.00210}

#: Gluon kernels: the peak before the seqlen saturation (the default schedule near ~790 TFLOP/s at 8K
#: and 16K) and each schedule field's ratio to the default. Every value the generator accepts has an
#: entry (a test walks both search spaces through the model).
_GLUON_PEAK = 1080.0
_GLUON_FACTORS: dict[str, Mapping[Any, float]] = {
    "block_m": {128: 1.0, 64: 0.76, 192: 0.97, 256: 0.9},  # 64: one consumer warpgroup; 192: three
    "block_n": {128: 1.0, 64: 0.82, 32: 0.6, 192: 0.99, 256: 0.97},
    "num_stages": {1: 0.4, 2: 0.61, 3: 1.0, 4: 0.96, 5: 0.93},  # 2 starves (V released a step late)
    "ping_pong": {True: 1.0, False: 0.97},
    "overlap": {True: 1.0, False: 0.89},
    "q_stages": {1: 1.0, 2: 0.99},
    "v_permute": {True: 1.0, False: 0.79},  # P shuffles without it
    "persistent": {True: 1.0, False: 0.93},
    "q_order": {"heavy_first": 1.0, "forward": 0.94, "balanced": 1.02},
    "producer_regs": {24: 1.0, 40: 0.995, 56: 0.99},
}


def _perturbed(f: float, c: KernelConfig, shape: Shape, causal: bool) -> float:
    """A fixed +-2% per (config, shape, causal): configs the model does not tell apart still differ."""
    return f * (0.98 + 0.04 * unit_hash("tflops", c.to_json(), shape, causal))


def _synthetic_gluon_tflops(c: KernelConfig, shape: Shape, causal: bool) -> float:
    f = _GLUON_PEAK * shape.seqlen / (shape.seqlen + 2952.0)
    for name, table in _GLUON_FACTORS.items():
        f *= table[getattr(c, name)]
    f *= 1.0 if causal else 1.05
    return _perturbed(f, c, shape, causal)


def synthetic_tflops(config: KernelConfig, shape: Shape, causal: bool) -> float:
    c = config
    if c.backend == "gluon":
        return _synthetic_gluon_tflops(c, shape, causal)
    dim = (c.head_dim_qk + c.head_dim_v) / 2
    f = _PEAK[c.dtype] * _interp(dim, _HEAD[c.dtype])
    f *= shape.seqlen / (shape.seqlen + 2952.0)
    f *= _BLOCK_M[c.dtype][c.block_m]
    f *= (_BLOCK_N_SMALL if dim <= 128 else _BLOCK_N_LARGE)[c.block_n]
    f *= 0.9 ** abs(math.log2(c.num_warps / (c.block_m // 16)))
    f *= _STAGES[c.num_stages]
    f *= 1.0 if c.maxnreg == 0 else 1.0 - 0.0008 * (232 - c.maxnreg)
    if c.softmax == "lean":
        f *= 0.98 * (0.99 + 0.02 * unit_hash(c.lean_fold, c.lean_clamp, c.lean_pack))
    f *= _ROWSUM[c.rowsum]
    f *= 0.96 if c.scale_block else 1.0
    f *= 1.03 if causal and c.q_order in ("heavy_first", "balanced") else 1.0
    f *= 1.0 if c.loads == "tma" else 0.97
    if c.dtype == "fp8":
        f *= 1.0 if c.v_layout == "transposed" else 0.5  # FP8 wgmma wants V K-major
    else:
        f *= 1.0 if c.v_layout == "natural" else 0.95
    # occupancy: programs per wave (two 4-warp 64-row programs share an SM), last-wave tail
    programs = math.ceil(shape.seqlen / c.block_m) * shape.batch * shape.heads
    slots = HOPPER.sm_count * (2 if c.block_m == 64 and c.num_warps == 4 else 1)
    waves = programs / slots
    f *= 0.9 + 0.1 * (waves / math.ceil(waves))
    f *= 1.0 if causal else 1.05
    return _perturbed(f, c, shape, causal)


def synthetic_error(config: KernelConfig, shape: Shape, causal: bool) -> float:
    c = config
    e = _ERROR[c.dtype] * (1.0 + 0.01 * math.log2(max(shape.seqlen, 256) / 4096))
    if c.dtype == "fp8":
        e *= 1.35 if c.softmax == "lean" else (0.98 if c.rowsum != "fp32" else 1.0)
        e *= 1.0 + 0.06 * max(0, 6 - c.p_scale_log2)
        e *= 0.97 if c.scale_block else 1.0
    return e * (0.99 + 0.02 * unit_hash("error", c.to_json(), shape, causal))


#: The recipe's effect on the error of the whole call (factors; V's part of the error falls by about a
#: third with balanced rounding; a rotation and K smoothing help on outliers, a little on Gaussians).
RECIPE_ERROR = {
    "hadamard": {False: 1.0, True: 0.96},
    "smooth_k": {False: 1.0, True: 0.98},
    "v_rounding": {"nearest": 1.0, "balanced": 0.85},
    "v_layout": {"natural": 1.0, "k_major": 1.0},
}
#: Quantiser cost: ms per element of Q, K and V in one pass (0.347 ms for 16K tokens x 32 heads x 128
#: on the H100), the extra share of each option, and a V^T copy per element of V.
_QUANT_MS_PER_ELEMENT = 0.347 / (3 * 16384 * 32 * 128)
_QUANT_EXTRA = {"hadamard": 0.15, "smooth_k": 0.05, "balanced": 0.36}
_COPY_MS_PER_ELEMENT = 0.35 * _QUANT_MS_PER_ELEMENT * 3


def quantiser_ms(shape: Shape, head_dim_qk: int, head_dim_v: int, recipe: Recipe) -> float:
    """Modelled time of `quantize_fp8` with `recipe` on Q, K and V of `shape`."""
    tokens = shape.batch * shape.seqlen
    elements = tokens * (shape.heads * head_dim_qk + shape.kv_heads * (head_dim_qk + head_dim_v))
    extra = (
        _QUANT_EXTRA["hadamard"] * recipe.hadamard
        + _QUANT_EXTRA["smooth_k"] * recipe.smooth_k
        + _QUANT_EXTRA["balanced"] * (recipe.v_rounding == "balanced")
    )
    return elements * _QUANT_MS_PER_ELEMENT * (1.0 + extra)


def synthetic_measurement(
    config: KernelConfig, shape: Shape, causal: bool, gate: float, recipe: Recipe | None = None
) -> dict[str, Any]:
    """TrialResult fields of the synthetic model for one shape (deterministic): the kernel alone, or
    with a `recipe` (the bf16 API) quantiser and kernel together."""
    from zyfa_tune.generator.defaults import default_config

    error_ref = synthetic_error(default_config(config.dtype, config.head_dim_qk, config.head_dim_v), shape, causal)
    runs = config
    if recipe is not None and recipe.v_layout == "k_major" and config.v_layout == "natural":
        runs = config.replace(v_layout="transposed")  # the twin reading K-major V as it is
    err = synthetic_error(config, shape, causal)
    for name, table in [] if recipe is None else RECIPE_ERROR.items():
        err *= table[getattr(recipe, name)]
    if not err <= gate * error_ref:
        return dict(
            status="wrong",
            error_rel_l2=err,
            error_max=err * 12.0,
            error_ref=error_ref,
            message=f"simulate: synthetic: error {err:.3e} > {gate * error_ref:.3e} (gate {gate:g} x the "
            "default config's)",
        )
    flops = task_flops(config.head_dim_qk, config.head_dim_v, shape, causal)
    median = flops / (synthetic_tflops(runs, shape, causal) * 1e12) * 1e3
    if recipe is not None:  # (the kernel's model includes the V^T copy natural codes need)
        if runs.v_layout == "transposed" and recipe.v_layout == "k_major":
            median -= min(
                0.5 * median, shape.batch * shape.seqlen * shape.kv_heads * config.head_dim_v * _COPY_MS_PER_ELEMENT
            )
        median += quantiser_ms(shape, config.head_dim_qk, config.head_dim_v, recipe)
    tflops = flops / (median * 1e-3) / 1e12
    return dict(
        status="ok",
        median_ms=median,
        p20_ms=median * 0.996,
        p80_ms=median * 1.006,
        tflops=tflops,
        error_rel_l2=err,
        error_max=err * 12.0,
        error_ref=error_ref,
        message="simulate: synthetic (no stored trial of this kernel for this problem class; a model of "
        "the config's fields" + ("" if recipe is None else " and the recipe") + ", not a measurement)",
    )
