"""Runtime kernel choice: problem shape -> tuned config, from layered databases, cached.

Lookup order for a problem key (dtype, head dims, causal, GQA group, seqlen and batch*heads buckets):
  1. "exact":        the key tuned on this device (same GPU name, compute capability, generator
                     version), from the first database layer that has it;
  2. "nearest":      the closest tuned key of the same dtype, head dims and causality on this device
                     (distance in log2 of the seqlen and batch*heads buckets);
  3. "other-device": the same two steps over entries tuned on another GPU or generator version of
                     the same compute capability, with a warning (they compile here, but were timed
                     elsewhere);
  4. "default":      the safe default config of the head dims.
It never raises for a valid input.

Packed sequences (`flash_attn_varlen_func`) have problem classes of their own (ProblemKey.packed:
the longest sequence's seqlen bucket, sequences x heads, and the total tokens bucket), looked up by
the same order among packed entries only (`varlen_config_for`; nearest also in log2 of the tokens
bucket). Where no packed entry exists, the rectangular lookup at the batch's mean length decides. Rows are read through `Store.best_entries`, which applies the
checks import applies (zyfa_tune.db.validity: the config parses and fits its key, the winning trial
is "ok" with the same time, the time is physically possible); a row that fails is skipped with a
warning and never reaches the generator. Entries of a simulating runner (replay, fault injection:
`Fingerprint.simulated`) are served only to that simulated device itself, never to a GPU, not even
through the other-device rule.

Layers, first wins: `set_databases(...)` or $ZYFA_TUNE_DATABASES (os.pathsep-separated), then the
user's default database (zyfa_tune.db.default_db_path(), if it exists), then the databases shipped
in zyfa_tune/kernels/tuned/. Databases are read once; per call the choice is a dict lookup.

Without an error budget the FP8 API serves FA3-fp8's error: a key's fastest kernel whose measured error is
within FA3_PARITY of FA3's on the same codes (where the study measured that reference), whatever the study's
gate let in (its default 1.25 keeps lean P's kernels, 1.038x FA3's error on plain codes in
docs/results.md row 2, for callers with a budget).

Error budget (`set_error_budget(x)` or $ZYFA_TUNE_ERROR_BUDGET): instead of each key's fastest
kernel, the fastest whose measured rel. L2 error against float64 is at most x, among every kernel
that passed its study's accuracy gate (`zyfa-tune tune --gate G --multi-objective` keeps the
front). Keys with no kernel within the budget fall through the same lookup order.

The bf16 API (`zyfa_tune.attention`: bf16 inputs, quantised with a recipe, then an FP8 kernel) has
entries of its own (problem key api="bf16": quantiser and kernel timed together, each with its
recipe and `error_ref`, the reference error on the same inputs). `attention_choice` picks, by the same
lookup order, the fastest such entry whose error ratio error_rel_l2 / error_ref is at most the
call's `error_budget` (an entry without error_ref cannot be judged and is never chosen); without
one, the plain recipe and the FP8 API's own choice above (its tuned entry, else the default config):
the kernels the FP8 API gates against the exact default kernel on plain codes.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import threading
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from zyfa_tune.generator import GENERATOR_VERSION, KernelConfig
from zyfa_tune.generator.defaults import fallback_config
from zyfa_tune.generator.recipe import PLAIN, Recipe

log = logging.getLogger("zyfa_tune.dispatch")

TUNED_DIR = Path(__file__).parent / "tuned"
ENV_DATABASES = "ZYFA_TUNE_DATABASES"
#: "At FlashAttention-3's error": the bf16 API's default error budget and its studies' default gate,
#: as a ratio to FA3-fp8's rel. L2 error on the same inputs. The whole call's error is mostly the
#: inputs' rounding to e4m3, which every system shares: the fastest kernels measure 1.0001-1.001x
#: FA3's (4.8515e-2 against 4.8463e-2 at hd128 8K), differences no output comparison can tell apart,
#: while a gate of exactly 1.0 turns them away. Ratios are recorded with every entry.
FA3_PARITY = 1.01
ENV_ERROR_BUDGET = "ZYFA_TUNE_ERROR_BUDGET"


@dataclass(frozen=True)
class Choice:
    """Which config runs for a problem, and why (`zyfa_tune.explain` returns this)."""

    config: KernelConfig
    source: str  # "exact" | "nearest" | "other-device" | "default" | "forced"
    key: object  # zyfa_tune.db.ProblemKey
    database: str | None = None
    tuned_key: object | None = None  # the key of the entry used (differs from `key` when nearest)
    tuned_on: str | None = None  # GPU name of the entry used
    tflops: float | None = None  # as measured when tuned
    detail: str = ""


@dataclass(frozen=True)
class _Entry:
    key: object
    device_key: tuple[str, str, str]
    config: KernelConfig
    median_ms: float
    tflops: float | None
    database: str
    provenance: str
    simulated: bool
    recipe: Recipe = PLAIN
    error_ratio: float | None = None  # error_rel_l2 / error_ref, where both were measured


@dataclass(frozen=True)
class RecipeChoice:
    """What `attention` runs for a problem: the recipe, and the kernel chosen with it (`kernel` None:
    no bf16-API entry within the budget, so the FP8 API's own choice on plainly quantised codes)."""

    recipe: Recipe
    kernel: Choice | None
    detail: str = ""


class Dispatcher:
    """Holds the validated best entries of every database layer; answers `choose` from memory."""

    def __init__(self, databases: Sequence[str | os.PathLike] | None = None, error_budget: float | None = None):
        self.layers = [str(p) for p in (databases if databases is not None else default_layers())]
        self.error_budget = _checked_budget("error_budget", error_budget)
        self._entries: list[list[_Entry]] | None = None
        self._bf16: list[list[_Entry]] | None = None  # the bf16 API's entries, per layer
        self._varlen: list[list[_Entry]] | None = None  # packed-sequence entries, per layer
        self._fast_varlen: dict[tuple, tuple[KernelConfig, bool]] = {}
        self._cache: dict[tuple, Choice] = {}
        self._recipes: dict[tuple, RecipeChoice] = {}
        self._fast: dict[tuple, KernelConfig] = {}
        self._fast_bf16: dict[tuple, tuple[Recipe, KernelConfig | None]] = {}
        self._lock = threading.Lock()

    def config_for(
        self,
        dtype: str,
        dqk: int,
        dv: int,
        causal: bool,
        batch: int,
        heads: int,
        kv_heads: int,
        seqlen: int,
        device_index: int,
    ) -> KernelConfig:
        """The per-call path: one dict lookup on the raw shape once it has been seen."""
        raw = (dtype, dqk, dv, causal, batch, heads, kv_heads, seqlen, device_index)
        cfg = self._fast.get(raw)
        if cfg is None:
            cfg = self.choose(
                problem_key(dtype, dqk, dv, causal, batch, heads, kv_heads, seqlen), device_key(device_index)
            ).config
            _remember(self._fast, raw, cfg)
        return cfg

    def varlen_config_for(
        self,
        dtype: str,
        dqk: int,
        dv: int,
        causal: bool,
        sequences: int,
        heads: int,
        kv_heads: int,
        total_tokens: int,
        max_seqlen: int,
        device_index: int,
    ) -> tuple[KernelConfig, bool]:
        """Packed sequences' per-call path, from host values only (the number of sequences, q's
        total tokens, max_seqlen_q): (config, whether a packed-sequence entry chose it; otherwise
        it is the rectangular lookup's). One dict lookup once seen."""
        raw = (dtype, dqk, dv, causal, sequences, heads, kv_heads, total_tokens, max_seqlen, device_index)
        found = self._fast_varlen.get(raw)
        if found is None:
            key = problem_key(dtype, dqk, dv, causal, sequences, heads, kv_heads, max_seqlen, tokens=total_tokens)
            mean = -(-total_tokens // sequences)
            rect = problem_key(dtype, dqk, dv, causal, sequences, heads, kv_heads, mean)
            choice = self.choose_varlen(key, device_key(device_index), rect)
            found = (choice.config, choice.tuned_key is not None and choice.tuned_key.packed)
            _remember(self._fast_varlen, raw, found)
        return found

    def attention_choice(
        self,
        dqk: int,
        dv: int,
        causal: bool,
        batch: int,
        heads: int,
        kv_heads: int,
        seqlen: int,
        device_index: int,
        error_budget: float,
    ) -> tuple[Recipe, KernelConfig | None]:
        """The bf16 API's per-call path: (recipe, config), config None for the FP8 API's own choice
        (see the module doc). One dict lookup on the raw shape and budget once seen."""
        raw = (dqk, dv, causal, batch, heads, kv_heads, seqlen, device_index, error_budget)
        found = self._fast_bf16.get(raw)
        if found is None:
            key = problem_key("fp8", dqk, dv, causal, batch, heads, kv_heads, seqlen, api="bf16")
            rc = self.choose_recipe(key, device_key(device_index), error_budget)
            found = (rc.recipe, None if rc.kernel is None else rc.kernel.config)
            _remember(self._fast_bf16, raw, found)
        return found

    # ---- loading ------------------------------------------------------------------------------
    def _load(self) -> list[list[_Entry]]:
        if self._entries is None:
            layers = [self._read_layer(path, self.error_budget) for path in self.layers]
            self._bf16 = [[e for e in layer if e.key.api == "bf16"] for layer in layers]
            self._varlen = [[e for e in layer if e.key.packed] for layer in layers]
            self._entries = [[e for e in layer if e.key.api == "fp8" and not e.key.packed] for layer in layers]
        return self._entries

    @staticmethod
    def _read_layer(path: str, error_budget: float | None = None) -> list[_Entry]:
        from zyfa_tune.db import DatabaseError, open_store

        try:
            with open_store(path, readonly=True, create=False) as store:
                if error_budget is not None:
                    rows = store.fastest_within(error_budget)
                else:  # (the within-parity query only where some best entry needs it)
                    rows = store.best_entries()
                    if any(_over_parity(e) for e in rows):
                        rows = _at_parity(rows, store.fastest_within(FA3_PARITY, relative=True))
        except (DatabaseError, OSError) as exc:
            warnings.warn(f"zyfa_tune: skipping tuning database {path}: {exc}", RuntimeWarning, stacklevel=3)
            return []
        out = []
        for row in rows:  # validated by the store: the config and recipe parse, the config fits the key
            out.append(
                _Entry(
                    key=row.key,
                    device_key=row.fingerprint.device_key(),
                    config=KernelConfig.from_json(row.config_json),
                    median_ms=row.median_ms,
                    tflops=row.tflops,
                    database=path,
                    provenance=row.provenance,
                    simulated=row.fingerprint.simulated,
                    error_ratio=row.error_ratio,
                    recipe=PLAIN if row.recipe is None else Recipe.from_json(row.recipe),
                )
            )
        log.debug("loaded %d tuned entries from %s", len(out), path)
        return out

    # ---- choosing -----------------------------------------------------------------------------
    def choose(self, key, device_key: tuple[str, str, str]) -> Choice:
        cache_key = (key, device_key)
        choice = self._cache.get(cache_key)
        if choice is None:
            with self._lock:
                choice = self._cache.get(cache_key) or self._resolve(key, device_key)
                self._cache[cache_key] = choice
            _announce(key, device_key, choice)
        return choice

    def choose_varlen(self, key, device_key: tuple[str, str, str], rectangular=None) -> Choice:
        """A packed-sequence key's choice (see the module doc); cached. Without a packed entry, the
        choice of the key `rectangular` (varlen_config_for: the sequences at their mean length;
        default: the padded rectangle, every sequence at the longest's length)."""
        if not key.packed:
            raise ValueError(f"key: {key} is not of packed sequences (tokens_bucket 0)")
        rect = rectangular if rectangular is not None else dataclasses.replace(key, tokens_bucket=0)
        cache_key = ("varlen", key, rect, device_key)
        choice = self._cache.get(cache_key)
        if choice is None:
            with self._lock:
                self._load()
                hit = self._find(key, device_key, self._varlen or [])
            if hit is None:
                fallback = self.choose(rect, device_key)
                why = f"no packed-sequence entry: the rectangular lookup at {rect}; "
                choice = dataclasses.replace(fallback, key=key, detail=why + fallback.detail)
            else:
                choice = hit[1]
                _announce(key, device_key, choice)
            self._cache[cache_key] = choice
        return choice

    def choose_recipe(self, key, device_key: tuple[str, str, str], error_budget: float) -> RecipeChoice:
        """The bf16 API's choice for a key of api "bf16" (see the module doc); cached."""
        error_budget = _checked_budget("error_budget", error_budget)
        cache_key = (key, device_key, error_budget)
        found = self._recipes.get(cache_key)
        if found is None:
            with self._lock:
                self._load()
                layers = [
                    [e for e in layer if e.error_ratio is not None and e.error_ratio <= error_budget]
                    for layer in self._bf16 or []
                ]
                hit = self._find(key, device_key, layers)
            if hit is None:
                found = RecipeChoice(
                    PLAIN,
                    None,
                    f"no bf16-API entry within error budget {error_budget:g} x the "
                    "reference's error: the plain recipe and the FP8 API's kernel",
                )
            else:
                entry, choice = hit
                found = RecipeChoice(
                    entry.recipe,
                    choice,
                    f"{choice.source} bf16-API entry, error "
                    f"{entry.error_ratio:.3g} x the reference's (budget {error_budget:g})",
                )
            self._recipes[cache_key] = found
        return found

    def _resolve(self, key, device_key) -> Choice:
        hit = self._find(key, device_key, self._load())
        if hit is None:
            return Choice(
                config=fallback_config(key.dtype, key.head_dim_qk, key.head_dim_v),
                source="default",
                key=key,
                detail="no tuned entry for these head dims on this architecture",
            )
        return hit[1]

    def _find(self, key, device_key, layers: list[list[_Entry]]) -> tuple[_Entry, Choice] | None:
        """The entry the lookup order picks from `layers` for `key` on `device_key`, as a Choice."""
        # a simulated entry only for its own simulated device: a GPU's device key never equals it
        layers = [[e for e in layer if not e.simulated or e.device_key == device_key] for layer in layers]
        found = _pick(key, [[e for e in layer if e.device_key == device_key] for layer in layers])
        foreign = found is None
        if foreign:  # same architecture, another GPU model or generator version
            found = _pick(
                key,
                [
                    [e for e in layer if e.device_key[1] == device_key[1] and e.device_key != device_key]
                    for layer in layers
                ],
            )
        if found is None:
            return None
        how, entry = found
        budget = "" if self.error_budget is None else f" (error budget {self.error_budget:g})"
        return entry, Choice(
            config=entry.config,
            source="other-device" if foreign else how,
            key=key,
            database=entry.database,
            tuned_key=entry.key,
            tuned_on=entry.device_key[0],
            tflops=entry.tflops,
            detail=f"{how} match{budget}; {entry.provenance}",
        )


def _at_parity(best: list, parity: list) -> list:
    """The FP8 API serves FA3-fp8's error: a best entry whose error ratio (against FA3's on the same codes) is
    over FA3_PARITY, which a study's looser gate let in (lean P's kernels, for callers with an error budget),
    yields to its class's fastest trial within it (`parity`, store.fastest_within(..., relative=True)), or
    leaves the class to the lookup order. bf16-API entries are judged per call (`choose_recipe`)."""
    within = {(e.fingerprint, e.key): e for e in parity}
    out = []
    for e in best:
        if _over_parity(e):
            e = within.get((e.fingerprint, e.key))
        if e is not None:
            out.append(e)
    return out


def _over_parity(e) -> bool:
    """An FP8-API entry measured over FA3_PARITY x FA3-fp8's error on the same codes."""
    return e.key.api == "fp8" and e.error_ratio is not None and e.error_ratio > FA3_PARITY


def _announce(key, device_key: tuple[str, str, str], choice: Choice) -> None:
    """Log a new choice; warn where it was timed on another GPU or generator version."""
    log.debug(
        "dispatch %s on %s -> %s (%s) %s",
        key,
        device_key[0],
        choice.source,
        choice.database or "built-in",
        choice.detail,
    )
    if choice.source == "other-device":
        warnings.warn(
            f"zyfa_tune: no tuned kernel for {key} on {device_key[0]} "
            f"(generator {device_key[2]}); using one tuned on {choice.tuned_on} "
            f"from {choice.database}",
            RuntimeWarning,
            stacklevel=5,
        )


def _distance(a, b) -> float:
    """How far two keys of the same dtype/head dims/causality are: log2 steps of the buckets (of
    packed sequences' total tokens too)."""
    tokens = abs(math.log2(a.tokens_bucket) - math.log2(b.tokens_bucket)) if a.packed and b.packed else 0.0
    return (
        abs(math.log2(a.seqlen_bucket) - math.log2(b.seqlen_bucket))
        + 0.5 * abs(math.log2(a.bh_bucket) - math.log2(b.bh_bucket))
        + (0.25 if a.gqa_group != b.gqa_group else 0.0)
        + tokens
    )


def _pick(key, layers: Iterable[list[_Entry]]) -> tuple[str, _Entry] | None:
    """Exact key from the first layer that has it, else the nearest compatible key (first layer
    wins ties), else None. Within a layer the fastest entry wins."""
    layers = list(layers)
    for layer in layers:
        exact = [e for e in layer if e.key == key]
        if exact:
            return "exact", min(exact, key=lambda e: e.median_ms)
    best: tuple[float, int, float, _Entry] | None = None
    for rank, layer in enumerate(layers):
        for e in layer:
            k = e.key
            if (k.dtype, k.head_dim_qk, k.head_dim_v, k.causal, k.api, k.packed) != (
                key.dtype,
                key.head_dim_qk,
                key.head_dim_v,
                key.causal,
                key.api,
                key.packed,
            ):
                continue
            cand = (_distance(k, key), rank, e.median_ms, e)
            if best is None or cand[:3] < best[:3]:
                best = cand
    return None if best is None else ("nearest", best[3])


# ---- process-wide dispatcher --------------------------------------------------------------------

_lock = threading.Lock()
_dispatcher: Dispatcher | None = None
_user_layers: list[str] | None = None
_user_budget: tuple[float | None] | None = None  # set_error_budget's value, boxed (None: not set)


def _checked_budget(name: str, value: object) -> float | None:
    """None (no budget) or a positive finite rel. L2 error."""
    from zyfa_tune.db.checks import finite_float

    return None if value is None else finite_float(name, value, positive=True)


def error_budget() -> float | None:
    """The error budget in force: set_error_budget's, else $ZYFA_TUNE_ERROR_BUDGET's, else None."""
    if _user_budget is not None:
        return _user_budget[0]
    env = os.environ.get(ENV_ERROR_BUDGET)
    if not env:
        return None
    try:
        value = float(env)
    except ValueError:
        raise ValueError(f"${ENV_ERROR_BUDGET}: expected a number, got {env!r}") from None
    return _checked_budget(f"${ENV_ERROR_BUDGET}", value)


def set_error_budget(max_error: float | None) -> None:
    """Run the fastest tuned kernel whose rel. L2 error was at most `max_error` (None: the fastest
    kernel that passed its study's gate, the default). Overrides $ZYFA_TUNE_ERROR_BUDGET."""
    global _user_budget, _dispatcher
    checked = _checked_budget("max_error", max_error)
    with _lock:
        _user_budget = (checked,)
        _dispatcher = None


def default_layers() -> list[str]:
    """Database layers in lookup order (see module docstring); only files that exist."""
    from zyfa_tune.db import default_db_path

    layers: list[str] = list(_user_layers or [])
    env = os.environ.get(ENV_DATABASES)
    if _user_layers is None and env:
        layers += [p for p in env.split(os.pathsep) if p]
    user_db = default_db_path()
    if user_db.exists():
        layers.append(str(user_db))
    layers += sorted(str(p) for p in TUNED_DIR.glob("*.db"))
    seen: set[str] = set()
    return [p for p in layers if not (p in seen or seen.add(p))]


def set_databases(paths: Sequence[str | os.PathLike] | None) -> None:
    """Put these databases (user's first) ahead of the default layers; None restores the default."""
    global _user_layers, _dispatcher
    with _lock:
        _user_layers = None if paths is None else [str(p) for p in paths]
        _dispatcher = None


def dispatcher() -> Dispatcher:
    global _dispatcher
    d = _dispatcher
    if d is None:
        with _lock:
            if _dispatcher is None:
                _dispatcher = Dispatcher(error_budget=error_budget())
            d = _dispatcher
    return d


#: raw call shapes each per-call table keeps before it starts over
_FAST_LIMIT = 65536


def _remember(table: dict, raw: tuple, value) -> None:
    """Store a per-call answer; an unbounded stream of shapes empties the table rather than grow it."""
    if len(table) > _FAST_LIMIT:
        table.clear()
    table[raw] = value


def problem_key(
    dtype: str,
    dqk: int,
    dv: int,
    causal: bool,
    batch: int,
    heads: int,
    kv_heads: int,
    seqlen: int,
    api: str = "fp8",
    tokens: int | None = None,
):
    """The ProblemKey of a call; `tokens` for packed sequences (batch of them, the longest seqlen)."""
    from zyfa_tune.db import ProblemKey

    return ProblemKey.from_shape(
        tokens=tokens,
        dtype=dtype,
        head_dim_qk=dqk,
        head_dim_v=dv,
        causal=causal,
        batch=batch,
        heads=heads,
        kv_heads=kv_heads,
        seqlen=seqlen,
        api=api,
    )


@functools.lru_cache(maxsize=64)
def device_key(device_index: int) -> tuple[str, str, str]:
    """(GPU name, compute capability, generator version) of a CUDA device, read once."""
    import torch

    props = torch.cuda.get_device_properties(device_index)
    return props.name, f"{props.major}.{props.minor}", GENERATOR_VERSION
