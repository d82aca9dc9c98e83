"""A study's trials as the tuner left them: one row per trial with its outcome and message, the
failures grouped by reason, and the repair a resumed study needs after its tuner was killed.

The tuner records on each Optuna trial (user attrs): "config", "statuses" (one per shape),
"failure" (the first failing shape's message), "infeasible" (why a config was never built),
"duplicate" (measured before), "killed" (left running by a killed tuner), "host" and "pid".
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import optuna

TrialState = optuna.trial.TrialState
#: the outcomes a row can have: the worker's statuses, then what the tuner decides without measuring
OUTCOMES = (
    "ok",
    "compile_error",
    "wrong",
    "timeout",
    "crash",
    "infeasible",
    "duplicate",
    "killed",
    "running",
    "waiting",
    "failed",
)


@dataclass(frozen=True)
class TrialRow:
    number: int
    outcome: str  # one of OUTCOMES
    value: float | None  # the study's objective (geometric-mean TFLOP/s) where complete
    message: str  # why it failed, was pruned or was not measured ("" for ok)
    config: str | None  # the config's JSON where one was built


def trial_row(t: optuna.trial.FrozenTrial) -> TrialRow:
    attrs = t.user_attrs
    statuses = attrs.get("statuses") or []
    failed = [s for s in statuses if s != "ok"]
    if failed:
        outcome, message = failed[0], str(attrs.get("failure", ""))
    elif statuses:
        outcome, message = "ok", ""
    elif attrs.get("killed"):
        outcome, message = "killed", "left running by a killed tuner; queued again"
    elif "infeasible" in attrs:
        outcome, message = "infeasible", str(attrs["infeasible"])
    elif attrs.get("duplicate"):
        outcome, message = "duplicate", "measured before in this study"
    elif t.state in (TrialState.RUNNING, TrialState.WAITING):
        outcome, message = t.state.name.lower(), ""
    else:
        outcome, message = "failed", str(attrs.get("failure", ""))
    value = t.values[0] if t.state == TrialState.COMPLETE and t.values else None
    return TrialRow(t.number, outcome, value, message, attrs.get("config"))


def trial_rows(study: optuna.Study, outcomes: Iterable[str] | None = None) -> list[TrialRow]:
    """Every trial of `study` in number order, optionally only those with one of `outcomes`."""
    wanted = None if outcomes is None else set(outcomes)
    rows = [trial_row(t) for t in study.get_trials(deepcopy=False)]
    return [r for r in rows if wanted is None or r.outcome in wanted]


def parse_outcomes(text: str, what: str = "--status") -> tuple[str, ...]:
    """'crash,timeout' -> ('crash', 'timeout'); ValueError naming `what` for an unknown outcome."""
    out = tuple(s.strip() for s in text.split(",") if s.strip())
    unknown = [s for s in out if s not in OUTCOMES]
    if not out or unknown:
        raise ValueError(f"{what}: {', '.join(unknown) or repr(text)} is not one of {', '.join(OUTCOMES)}")
    return out


def failure_reason(message: str) -> str:
    """The line of a failure message that says what went wrong, with process ids left out, so the
    same failure of many configs groups together: a traceback's exception line, else the first line."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return "(no message)"
    reason = lines[0]
    if any(line.startswith("Traceback") for line in lines):
        reason = next(
            (line for line in reversed(lines) if re.match(r"[\w.]+(Error|Exception|Exit)\b", line)), lines[-1]
        )
    return re.sub(r"\bprocess \d+", "process N", reason)[:300]


def failure_summary(rows: Iterable[TrialRow], top: int = 5) -> list[tuple[str, str, int]]:
    """The most frequent (outcome, reason) of the failed measurements, with their counts."""
    counts = Counter(
        (r.outcome, failure_reason(r.message))
        for r in rows
        if r.outcome in ("compile_error", "wrong", "timeout", "crash", "failed")
    )
    return [(outcome, reason, n) for (outcome, reason), n in counts.most_common(top)]


def requeue_killed(study: optuna.Study, host: str, alive: Callable[[object], bool]) -> list[int]:
    """Trials that a killed tuner on `host` left RUNNING (its pid no longer alive) are marked FAIL
    ("killed") and their parameters queued again, so a resumed study measures them after all (a
    queued seed among them). Returns the numbers of the trials queued again."""
    requeued = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if t.user_attrs.get("host") != host or alive(t.user_attrs.get("pid")):
            continue
        study._storage.set_trial_user_attr(t._trial_id, "killed", True)
        study._storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
        params = t.system_attrs.get("fixed_params") or (t.params if "config" in t.user_attrs else None)
        if params:
            study.enqueue_trial(params, user_attrs={"requeued_from": t.number})
            requeued.append(t.number)
    return requeued
