"""What a tuning trial measured, what the store hands back, and what an import did."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from .checks import optional_float, optional_int, short_repr
from .fingerprint import Fingerprint
from .keys import ProblemKey
from .validity import check_recipe

TRIAL_STATUSES = ("ok", "compile_error", "wrong", "timeout", "crash")

#: Float fields of a trial; all must be finite and >= 0 when present (> 0: times and error_ref).
TRIAL_FLOATS = (
    "median_ms",
    "p20_ms",
    "p80_ms",
    "tflops",
    "error_rel_l2",
    "error_max",
    "sm_clock_mhz",
    "power_w",
    "energy_j",
    "tflop_per_j",
    "error_ref",
)
TRIAL_SHAPE = ("batch", "heads", "seqlen")
#: Every trial field stored in a column of its own (message aside), as TrialResult and the table name it.
TRIAL_COLUMNS = TRIAL_FLOATS + TRIAL_SHAPE + ("recipe",)
#: Trial columns of version 4 (an older file has none of them: read as None).
TRIAL_V4 = ("error_ref", "recipe")


@dataclass(frozen=True)
class TrialResult:
    """One measured (or failed) config. Only status "ok" with a median can become a best entry.

    recipe: the quantisation recipe the inputs went through (`generator.recipe.Recipe`, or its JSON;
    stored as canonical JSON, None for the plain recipe); only bf16-API trials have one.
    error_ref: the reference's rel. L2 error on the same inputs (FA3-fp8's where it was importable,
    else the exact default kernel's on plainly quantised codes); error_rel_l2 / error_ref is what
    the dispatcher's error budget compares.
    """

    status: str
    median_ms: float | None = None
    p20_ms: float | None = None
    p80_ms: float | None = None
    tflops: float | None = None
    error_rel_l2: float | None = None
    error_max: float | None = None
    sm_clock_mhz: float | None = None
    power_w: float | None = None
    energy_j: float | None = None
    tflop_per_j: float | None = None
    error_ref: float | None = None
    message: str = ""  # compile error text, traceback tail: stored as data, never executed
    batch: int | None = None
    heads: int | None = None
    seqlen: int | None = None
    recipe: str | None = None

    def __post_init__(self) -> None:
        if type(self.status) is not str or self.status not in TRIAL_STATUSES:
            raise ValueError(f"status: {short_repr(self.status)} is not one of {list(TRIAL_STATUSES)}")
        for name in TRIAL_FLOATS:
            # plain floats: equal results compare equal, and numpy scalars bind to any driver
            object.__setattr__(
                self,
                name,
                optional_float(name, getattr(self, name), positive=name.endswith("_ms") or name == "error_ref"),
            )
        if self.status == "ok" and self.median_ms is None:
            raise ValueError("median_ms: a trial with status 'ok' needs its median time")
        for name in TRIAL_SHAPE:
            object.__setattr__(self, name, optional_int(name, getattr(self, name), lo=1, hi=1 << 31))
        object.__setattr__(self, "recipe", check_recipe(self.recipe))
        if type(self.message) is not str:
            raise ValueError(f"message: expected str, got {type(self.message).__name__}")


@dataclass(frozen=True)
class BestEntry:
    """The fastest correct trial of one (fingerprint, problem class).

    `config_json` is the stored text, already checked by the store (it parses with
    `KernelConfig.from_json` and fits `key`'s dtype and head dims), as are the time (its trial is
    "ok" with the same median, and the time is physically possible). batch/heads/seqlen are the
    shape the winning trial measured and sm_clock_mhz its mean SM clock while timed (None if not
    recorded).
    """

    fingerprint: Fingerprint
    key: ProblemKey
    backend: str
    config_json: str
    source_hash: str
    median_ms: float
    tflops: float | None
    error_rel_l2: float | None
    provenance: str
    updated_at: datetime
    batch: int | None = None
    heads: int | None = None
    seqlen: int | None = None
    sm_clock_mhz: float | None = None
    recipe: str | None = None  # the trial's recipe (canonical JSON; None: the plain recipe)
    error_ref: float | None = None  # the trial's reference error on the same inputs, if measured

    @property
    def error_ratio(self) -> float | None:
        """error_rel_l2 / error_ref, where both were measured."""
        if self.error_rel_l2 is None or self.error_ref is None:
            return None
        return self.error_rel_l2 / self.error_ref


@dataclass
class ImportReport:
    """Outcome of `Store.import_from`.

    accepted: trial and best rows that passed validation (copied, or already present):
              added + present + new + replaced + kept;
    rejected: (row description, reason) for every source row that failed validation, including
              environments/problems/variants rows and rows that reference a rejected row;
    added / present: trials copied / already in the target (not copied again);
    new / replaced / kept: best entries new to the target / replacing a slower one of ours / not
              taken because ours was faster or equal.
    """

    accepted: int = 0
    rejected: list[tuple[str, str]] = field(default_factory=list)
    replaced: int = 0
    kept: int = 0
    added: int = 0
    present: int = 0
    new: int = 0
