"""Export and import: every row of a source database is validated before anything is written.

A database file is untrusted input (it may come from another machine or be crafted): each
environments/problems/variants/trials/best row is rebuilt into validated records — fingerprint
fields typed and sane, problem keys valid, `config_json` accepted by `KernelConfig.from_json` and
built for the problem's dtype/head dims, recipes accepted by `Recipe.from_json` (and only on
bf16-API problems), statuses known, numbers finite, non-negative and physically possible, best
rows agreeing with an "ok" trial (validity.py, the checks the store's reads apply too) — and a row that fails (or references one that failed) is reported with its
reason and not written.
What is written is rebuilt from the validated records (configs re-serialised canonically), never
copied as raw text.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from typing import Any

from sqlalchemy import inspect, select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from zyfa_tune.generator import KernelConfig

from . import rows, validity
from .checks import optional_text, short_repr, text
from .fingerprint import VERSION_PATTERN, Fingerprint
from .keys import ProblemKey
from .models import BestModel, EnvironmentModel, ProblemModel, TrialModel, VariantModel
from .records import TRIAL_COLUMNS, ImportReport, TrialResult
from .session import run_transaction

#: Rows written per transaction: keeps each write lock short on a database others write to.
CHUNK = 500


@dataclass(frozen=True)
class _Variant:
    backend: str
    config: KernelConfig
    source_hash: str
    generator_version: str


@dataclass(frozen=True)
class _Trial:
    src_id: Any
    refs: tuple  # (environment_id, problem_id, variant_id) in the source
    fingerprint: Fingerprint
    key: ProblemKey
    variant: _Variant
    result: TrialResult
    study: str | None
    provenance: str
    created_at: datetime


@dataclass(frozen=True)
class _Best:
    trial: _Trial
    provenance: str


@dataclass
class SourceRows:
    """The validated content of a source, plus the rows rejected on the way."""

    trials: list[_Trial] = field(default_factory=list)
    best: list[_Best] = field(default_factory=list)
    rejected: list[tuple[str, str]] = field(default_factory=list)


# ---- reading ----------------------------------------------------------------------------------
def read_source(
    session: Session, *, gpu_name: str | None = None, head_dims: tuple[int, int] | None = None, best_only: bool = False
) -> SourceRows:
    """Read and validate every row; keep the trials/best of the given GPU model and head dims
    (all if None), and with `best_only` only the best entries and the trials they point to."""
    out = SourceRows()

    def valid(table: str, build) -> dict[Any, Any]:
        good = {}
        for r in _read_table(session, table):
            try:
                good[_row_id(table, r)] = build(r)
            except (ValueError, KeyError, TypeError) as exc:  # ConfigError is a ValueError
                out.rejected.append((_describe(table, r), _reason(exc)))
        return good

    envs = valid("environments", _environment)
    problems = valid("problems", rows.key_from)
    variants = valid("variants", _variant)
    trials = valid("trials", partial(_trial, envs=envs, problems=problems, variants=variants))
    best = valid("best", partial(_best, trials=trials))

    def wanted(t: _Trial) -> bool:
        return (gpu_name is None or t.fingerprint.gpu_name == gpu_name) and (
            head_dims is None or (t.key.head_dim_qk, t.key.head_dim_v) == tuple(head_dims)
        )

    out.best = [b for b in best.values() if wanted(b.trial)]
    out.trials = [b.trial for b in out.best] if best_only else [t for t in trials.values() if wanted(t)]
    return out


def drop_simulated(source: SourceRows, why: str) -> None:
    """Move the rows measured by a simulating runner (`Fingerprint.simulated`) to the rejected."""

    def simulated(t: _Trial, desc: str) -> bool:
        if t.fingerprint.simulated:
            source.rejected.append((desc, f"simulated ({t.fingerprint.runner}): {why}"))
        return t.fingerprint.simulated

    source.trials = [t for t in source.trials if not simulated(t, f"trials row id={short_repr(t.src_id)}")]
    source.best = [
        b for b in source.best if not simulated(b.trial, f"best row of trial id={short_repr(b.trial.src_id)}")
    ]


def _read_table(session: Session, table: str) -> list[dict[str, Any]]:
    """All rows of `table`, raw, with only the columns the source has (version 1 lacks some)."""
    model = {m.__tablename__: m for m in (EnvironmentModel, ProblemModel, VariantModel, TrialModel, BestModel)}[table]
    present = {c["name"] for c in inspect(session.connection()).get_columns(table)}
    cols = [rows.raw(c) for c in model.__table__.columns if c.name in present]
    stmt = select(*cols).select_from(model.__table__)
    return [dict(r._mapping) for r in session.execute(stmt)]


def _environment(r: dict[str, Any]) -> Fingerprint:
    fp = rows.fingerprint_from(r)
    if r.get("digest") != fp.digest():
        raise ValueError("digest does not match the fingerprint fields")
    return fp


def _variant(r: dict[str, Any]) -> _Variant:
    backend, source_hash = validity.check_kernel_ids(r["backend"], r["source_hash"])
    return _Variant(
        backend=backend,
        config=validity.variant_config(backend, r["config_json"]),
        source_hash=source_hash,
        generator_version=text(
            "generator_version", r["generator_version"], max_len=64, allow_empty=False, pattern=VERSION_PATTERN
        ),
    )


def _ref(kind: str, table: dict[Any, Any], value: Any) -> Any:
    if value not in table:
        raise ValueError(f"{kind}={short_repr(value)} is missing or was rejected")
    return table[value]


def _trial(r: dict[str, Any], *, envs, problems, variants) -> _Trial:
    fp = _ref("environment_id", envs, r["environment_id"])
    key = _ref("problem_id", problems, r["problem_id"])
    variant = _ref("variant_id", variants, r["variant_id"])
    validity.check_config_matches(variant.config, key)
    message = "" if r.get("message") is None else r["message"]
    result = TrialResult(status=r["status"], message=message, **{n: r.get(n) for n in TRIAL_COLUMNS})
    validity.check_timing(key, result.median_ms, result.tflops)
    validity.check_recipe_fits(key, result.recipe)
    return _Trial(
        src_id=r["id"],
        refs=(r["environment_id"], r["problem_id"], r["variant_id"]),
        fingerprint=fp,
        key=key,
        variant=variant,
        result=result,
        study=optional_text("study", r.get("study")),
        provenance=text("provenance", r.get("provenance") or "", max_len=rows.MAX_PROVENANCE_CHARS, clean=True),
        created_at=rows.as_utc("created_at", r.get("created_at")),
    )


def _best(r: dict[str, Any], *, trials) -> _Best:
    trial = _ref("trial_id", trials, r["trial_id"])
    if (r["environment_id"], r["problem_id"], r["variant_id"]) != trial.refs:
        raise ValueError("environment/problem/variant differ from its trial's")
    validity.check_best(
        trial.key,
        median_ms=r["median_ms"],
        tflops=r.get("tflops"),
        trial_status=trial.result.status,
        trial_median_ms=trial.result.median_ms,
    )
    return _Best(
        trial=trial,
        provenance=text("provenance", r.get("provenance") or "", max_len=rows.MAX_PROVENANCE_CHARS, clean=True),
    )


def _row_id(table: str, r: dict[str, Any]) -> Any:
    """Primary key of a source row (best is keyed by environment and problem)."""
    return (r.get("environment_id"), r.get("problem_id")) if table == "best" else r.get("id")


def _describe(table: str, r: dict[str, Any]) -> str:
    if table == "best":
        return (
            f"best row environment_id={short_repr(r.get('environment_id'))} "
            f"problem_id={short_repr(r.get('problem_id'))}"
        )
    return f"{table} row id={short_repr(r.get('id'))}"


def _reason(exc: BaseException) -> str:
    return f"missing column {exc}" if isinstance(exc, KeyError) else str(exc)


# ---- writing ----------------------------------------------------------------------------------
def write_rows(
    engine: Engine, where: str, source: SourceRows, report: ImportReport, *, provenance_prefix: str | None
) -> tuple[int, int]:
    """Write validated rows into `engine`'s database in short transactions; fills `report`
    (rejections of `source` included). Returns (trials written, best entries new or replaced)."""
    report.rejected.extend(source.rejected)
    ids: dict[Any, int] = {}
    written = 0
    for chunk in _chunks(source.trials):
        mapped, conflicts, n = run_transaction(
            engine, partial(_write_trials, chunk=chunk, prefix=provenance_prefix), where=where
        )
        ids.update(mapped)
        report.rejected.extend(conflicts)
        report.accepted += len(mapped)
        report.added += n
        report.present += len(mapped) - n
        written += n
    changed = 0
    now = rows.utc_now()
    for chunk in _chunks(source.best):
        outcomes = run_transaction(
            engine, partial(_write_best, chunk=chunk, ids=ids, prefix=provenance_prefix, now=now), where=where
        )
        for desc, outcome in outcomes:
            if outcome == "rejected":
                report.rejected.append((desc, "its trial was rejected"))
                continue
            report.accepted += 1
            report.new += outcome == "new"
            report.replaced += outcome == "replaced"
            report.kept += outcome == "kept"
            changed += outcome != "kept"
    return written, changed


def _chunks(items: Sequence) -> Iterator[Sequence]:
    for i in range(0, len(items), CHUNK):
        yield items[i : i + CHUNK]


def _refs(session: Session, t: _Trial) -> tuple[int, int, int]:
    """Target ids of a trial's environment, problem and variant (created if missing)."""
    v = t.variant
    return (
        rows.environment_id(session, t.fingerprint),
        rows.problem_id(session, t.key),
        rows.variant_id(
            session,
            backend=v.backend,
            config=v.config,
            source_hash=v.source_hash,
            generator_version=v.generator_version,
        ),
    )


def _write_trials(session: Session, *, chunk: Sequence[_Trial], prefix: str | None):
    mapped: dict[Any, int] = {}
    conflicts: list[tuple[str, str]] = []
    written = 0
    for t in chunk:
        try:
            env, problem, variant = _refs(session, t)
        except rows.VariantConflict as exc:
            conflicts.append((f"trials row id={short_repr(t.src_id)}", str(exc)))
            continue
        median = (
            TrialModel.median_ms.is_(None) if t.result.median_ms is None else TrialModel.median_ms == t.result.median_ms
        )
        existing = session.scalar(
            select(TrialModel.id)
            .where(
                TrialModel.environment_id == env,
                TrialModel.problem_id == problem,
                TrialModel.variant_id == variant,
                TrialModel.created_at == t.created_at,
                median,
            )
            .limit(1)
        )
        if existing is None:
            row = TrialModel(
                environment_id=env,
                problem_id=problem,
                variant_id=variant,
                status=t.result.status,
                message=rows.clip_message(t.result.message),
                study=t.study,
                provenance=rows.join_provenance(prefix, t.provenance),
                created_at=t.created_at,
                **{n: getattr(t.result, n) for n in TRIAL_COLUMNS},
            )
            session.add(row)
            session.flush()
            existing = row.id
            written += 1
        mapped[t.src_id] = existing
    return mapped, conflicts, written


def _write_best(
    session: Session, *, chunk: Sequence[_Best], ids: dict[Any, int], prefix: str | None, now: datetime
) -> list[tuple[str, str]]:
    outcomes = []
    for b in chunk:
        desc = f"best row of trial id={short_repr(b.trial.src_id)}"
        trial_id = ids.get(b.trial.src_id)
        if trial_id is None:
            outcomes.append((desc, "rejected"))
            continue
        env, problem, variant = _refs(session, b.trial)
        r = b.trial.result
        outcomes.append(
            (
                desc,
                rows.offer_best(
                    session,
                    environment=env,
                    problem=problem,
                    variant=variant,
                    trial=trial_id,
                    median_ms=r.median_ms,
                    tflops=r.tflops,
                    error_rel_l2=r.error_rel_l2,
                    provenance=rows.join_provenance(prefix, b.provenance),
                    now=now,
                ),
            )
        )
    return outcomes
