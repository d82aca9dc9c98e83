"""What a stored kernel, timing or best entry must satisfy to be trusted: one set of checks, used
where rows enter (`Store.record_trial`, import) and where they are read (`best_entries`, hence the
dispatcher, `show` and `best`), so that no path accepts what another rejects.

Timings are checked against physics: a median implying more than `MAX_TFLOPS` on the smallest
problem of its class cannot be a measurement (a clock glitch, a kernel that skipped its work, a
hand-edited file) and, once stored as a best entry, would never be beaten.
"""

from __future__ import annotations

from typing import Any

from zyfa_tune.generator import KernelConfig
from zyfa_tune.generator.recipe import PLAIN, Recipe

from .checks import finite_float, optional_float, short_repr, text
from .keys import SEQLEN_BUCKET_MIN, TOKENS_BUCKET_MIN, ProblemKey

BACKEND_PATTERN = r"[a-z][a-z0-9_]{0,31}"
SOURCE_HASH_PATTERN = r"[0-9a-f]{8,64}"

#: Twice the dense FP8 tensor-core peak of the fastest Hopper part (H100/H200 SXM: 1979 TFLOP/s).
#: No attention kernel reaches the peak (softmax, loads and the causal diagonal cost time); the
#: factor 2 leaves room for a class's smallest shape being an underestimate of the one timed and
#: for boost clocks, so that only the impossible is refused. BF16 (half the FP8 peak) is held to
#: the same bound: looser, still far below 1e-300 ms.
MAX_TFLOPS = 4000.0


def min_flops(key: ProblemKey) -> float:
    """The fewest FLOPs any call of this class performs: its smallest sequence length and
    batch*heads (just above the previous bucket, or 1 in the lowest bucket), causal mask (half the
    score matrix, a lower bound for a full mask too), 2 FLOPs per multiply-add of QK^T and PV.
    Packed sequences: just over half the total-tokens bucket (1 in the lowest), each token a
    sequence of its own seeing one key (one head)."""
    if key.packed:
        tokens = key.tokens_bucket // 2 + 1 if key.tokens_bucket > TOKENS_BUCKET_MIN else 1
        return 2.0 * (key.head_dim_qk + key.head_dim_v) * tokens
    seqlen = key.seqlen_bucket // 2 + 1 if key.seqlen_bucket > SEQLEN_BUCKET_MIN else 1
    bh = key.bh_bucket // 2 + 1 if key.bh_bucket > 1 else 1
    return 2.0 * bh * (key.head_dim_qk + key.head_dim_v) * seqlen * (seqlen + 1) / 2


def min_plausible_ms(key: ProblemKey) -> float:
    """The shortest time a call of this class can take on any Hopper GPU (see MAX_TFLOPS)."""
    return min_flops(key) / (MAX_TFLOPS * 1e12) * 1e3


def check_timing(key: ProblemKey, median_ms: float | None, tflops: float | None) -> None:
    """ValueError naming the field if a measured time or throughput is physically impossible."""
    if median_ms is not None and median_ms < min_plausible_ms(key):
        raise ValueError(
            f"median_ms: {median_ms:.3g} ms for {key} implies more than {MAX_TFLOPS:.0f} "
            f"TFLOP/s (at least {min_plausible_ms(key):.3g} ms on any Hopper GPU)"
        )
    if tflops is not None and tflops > MAX_TFLOPS:
        raise ValueError(f"tflops: {tflops:.4g} is more than any Hopper GPU can do ({MAX_TFLOPS:.0f})")


def check_config_matches(config: KernelConfig, key: ProblemKey) -> None:
    got = (config.dtype, config.head_dim_qk, config.head_dim_v)
    want = (key.dtype, key.head_dim_qk, key.head_dim_v)
    if got != want:
        raise ValueError(f"config is for {got[0]} {got[1]}/{got[2]} but the problem is {want[0]} {want[1]}/{want[2]}")


def check_kernel_ids(backend: Any, source_hash: Any) -> tuple[str, str]:
    """A variant's backend name and source hash, checked."""
    return (
        text("backend", backend, max_len=32, allow_empty=False, pattern=BACKEND_PATTERN),
        text("source_hash", source_hash, max_len=64, allow_empty=False, pattern=SOURCE_HASH_PATTERN),
    )


def variant_config(backend: Any, config_json: Any) -> KernelConfig:
    """The stored config text parsed and checked (ConfigError, a ValueError, on anything odd) and
    agreeing with the variant's backend column."""
    if type(config_json) is not str:
        raise ValueError(f"config_json: expected str, got {type(config_json).__name__}")
    config = KernelConfig.from_json(config_json)
    if backend != config.backend:
        raise ValueError(f"backend: {backend!r} differs from the config's backend {config.backend!r}")
    return config


#: Longest stored recipe text (a canonical recipe is under 100 characters).
MAX_RECIPE_CHARS = 256


def check_recipe(value: Any) -> str | None:
    """A stored quantisation recipe: None (the plain recipe), a `Recipe`, or its JSON text, which must
    parse with `Recipe.from_json` (ConfigError, a ValueError, otherwise). Returns the canonical text,
    or None for the plain recipe: one way to store each recipe."""
    if value is None:
        return None
    if isinstance(value, Recipe):
        recipe = value
    else:
        value = text("recipe", value, max_len=MAX_RECIPE_CHARS, allow_empty=False)
        recipe = Recipe.from_json(value)
    return None if recipe == PLAIN else recipe.to_json()


def check_recipe_fits(key: ProblemKey, recipe: str | None) -> None:
    """The FP8 API times kernels on plainly quantised codes: only the bf16 API's trials have a recipe."""
    if recipe is not None and key.api != "bf16":
        raise ValueError(
            f"recipe: {short_repr(recipe)} on a problem of api {key.api!r}; only api 'bf16' "
            f"trials quantise with a recipe"
        )


def check_best(
    key: ProblemKey, *, median_ms: Any, tflops: Any, trial_status: Any, trial_median_ms: Any
) -> tuple[float, float | None]:
    """A best row against the trial it names: the trial exists, is "ok", has the same median, and the
    time is possible. Returns (median_ms, tflops) as plain floats."""
    median_ms = finite_float("median_ms", median_ms, positive=True)
    tflops = optional_float("tflops", tflops)
    if trial_status is None:
        raise ValueError("trial_id: its trial is missing")
    if trial_status != "ok":
        raise ValueError(f"does not match its trial (status {trial_status!r}, not 'ok')")
    if trial_median_ms != median_ms:
        raise ValueError(f"does not match its trial (median_ms {median_ms!r}, the trial's {trial_median_ms!r})")
    check_timing(key, median_ms, tflops)
    return median_ms, tflops
