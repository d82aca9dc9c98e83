"""Row-level reads and writes shared by the store and by export/import.

Reads select columns *without* SQLAlchemy's type processing (`raw`): a crafted SQLite file can hold
text in an INTEGER column or a malformed date, and the value must reach our validators (which
reject it with a reason) rather than crash a driver-level conversion. Every row becomes a frozen,
validated record (Fingerprint, ProblemKey, TrialResult) before anything else looks at it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import fields
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import ColumnElement, insert, select, type_coerce, update
from sqlalchemy.orm import Session
from sqlalchemy.types import NullType

from zyfa_tune.generator import ConfigError, KernelConfig

from .checks import clean_text
from .fingerprint import Fingerprint
from .keys import ProblemKey
from .models import BestModel, EnvironmentModel, ProblemModel, VariantModel

FINGERPRINT_FIELDS = tuple(f.name for f in fields(Fingerprint))
KEY_FIELDS = tuple(f.name for f in fields(ProblemKey))
#: problem-key columns a database gained after version 3 -> the version that added them
KEY_SINCE = {"api": 4, "tokens_bucket": 5}
#: Longest stored trial message (compiler logs can be huge; the tail holds the error).
MAX_MESSAGE_CHARS = 16_384
MAX_PROVENANCE_CHARS = 1024


class VariantConflict(ValueError):
    """The source hash is already stored for a kernel of other dtype/head dims (a forged hash)."""


def raw(column: Any, name: str | None = None) -> ColumnElement:
    """`column` as the driver returns it (no SQLAlchemy result processing), labelled."""
    return type_coerce(column, NullType()).label(name or column.key)


# ---- conversions of raw values ---------------------------------------------------------------
def as_bool(name: str, value: Any) -> bool:
    if type(value) is bool:
        return value
    if type(value) is int and value in (0, 1):
        return bool(value)
    raise ValueError(f"{name}: expected a boolean, got {type(value).__name__}")


def as_utc(name: str, value: Any) -> datetime:
    """A stored timestamp as a naive UTC datetime (what the tables hold)."""
    if type(value) is str and len(value) <= 64:
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            raise ValueError(f"{name}: not an ISO timestamp") from None
    if not isinstance(value, datetime):
        raise ValueError(f"{name}: expected a timestamp, got {type(value).__name__}")
    if value.tzinfo is not None:
        value = value.astimezone(timezone.utc).replace(tzinfo=None)
    return value


def utc_now() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None)


def aware(value: datetime) -> datetime:
    """A naive-UTC timestamp as read back, made timezone-aware for callers."""
    return value.replace(tzinfo=timezone.utc)


def fingerprint_from(row: Mapping[str, Any]) -> Fingerprint:
    """A row of a version-2 database has no runner column: the GPU name then says it."""
    return Fingerprint(**{name: row[name] for name in FINGERPRINT_FIELDS if name in row})


def key_fields(version: int) -> tuple[str, ...]:
    """The problem-key columns a database of `version` has."""
    return tuple(n for n in KEY_FIELDS if KEY_SINCE.get(n, 0) <= version)


def key_from(row: Mapping[str, Any]) -> ProblemKey:
    """A row of a database before version 4 has no api column (its problems are all "fp8"), one
    before version 5 no tokens_bucket (none is of packed sequences): the key's defaults."""
    values = {name: row[name] for name in KEY_FIELDS if name not in KEY_SINCE or name in row}
    values["causal"] = as_bool("causal", values["causal"])
    return ProblemKey(**values)


def clip_message(message: str) -> str:
    """A trial message as stored: control characters out, at most MAX_MESSAGE_CHARS (the tail)."""
    message = clean_text(message)
    return message if len(message) <= MAX_MESSAGE_CHARS else "..." + message[-MAX_MESSAGE_CHARS:]


def join_provenance(*parts: str | None) -> str:
    joined = clean_text("; ".join(p for p in parts if p))
    return joined if len(joined) <= MAX_PROVENANCE_CHARS else joined[: MAX_PROVENANCE_CHARS - 3] + "..."


# ---- get-or-create (unique constraints make these converge under concurrency) ------------------
def environment_id(session: Session, fp: Fingerprint) -> int:
    digest = fp.digest()
    found = session.scalar(select(EnvironmentModel.id).where(EnvironmentModel.digest == digest))
    if found is not None:
        return found
    row = EnvironmentModel(digest=digest, **fp.to_dict())
    session.add(row)
    session.flush()  # a concurrent insert of the same digest fails here; the caller retries
    return row.id


def problem_id(session: Session, key: ProblemKey) -> int:
    where = [getattr(ProblemModel, name) == value for name, value in key.to_dict().items()]
    found = session.scalar(select(ProblemModel.id).where(*where))
    if found is not None:
        return found
    row = ProblemModel(**key.to_dict())
    session.add(row)
    session.flush()
    return row.id


def variant_id(
    session: Session, *, backend: str, config: KernelConfig, source_hash: str, generator_version: str
) -> int:
    """The variant of this generated source; the first config recorded for a hash is kept (configs
    that differ only in fields the source does not depend on emit the same kernel)."""
    found = session.execute(
        select(VariantModel.id, raw(VariantModel.config_json)).where(
            VariantModel.backend == backend, VariantModel.source_hash == source_hash
        )
    ).first()
    if found is not None:
        try:
            stored = KernelConfig.from_json(found.config_json)
        except ConfigError:
            stored = None
        if stored is None or (stored.dtype, stored.head_dim_qk, stored.head_dim_v) != (
            config.dtype,
            config.head_dim_qk,
            config.head_dim_v,
        ):
            raise VariantConflict(f"source_hash {source_hash} is already stored for another kernel")
        return found.id
    row = VariantModel(
        backend=backend, config_json=config.to_json(), source_hash=source_hash, generator_version=generator_version
    )
    session.add(row)
    session.flush()
    return row.id


def offer_best(
    session: Session,
    *,
    environment: int,
    problem: int,
    variant: int,
    trial: int,
    median_ms: float,
    tflops: float | None,
    error_rel_l2: float | None,
    provenance: str,
    now: datetime,
) -> str:
    """Make this trial the best of (environment, problem) if it is strictly faster.
    Returns "new", "replaced" or "kept". The row is locked (PostgreSQL) so racing writers
    compare against the latest committed best and never overwrite a faster one."""
    where = (BestModel.environment_id == environment, BestModel.problem_id == problem)
    current = session.execute(select(raw(BestModel.median_ms)).where(*where).with_for_update()).first()
    values = dict(
        variant_id=variant,
        trial_id=trial,
        median_ms=median_ms,
        tflops=tflops,
        error_rel_l2=error_rel_l2,
        provenance=provenance,
        updated_at=now,
    )
    if current is None:
        session.execute(insert(BestModel).values(environment_id=environment, problem_id=problem, **values))
        return "new"
    stored = current.median_ms
    stored_ok = type(stored) in (int, float) and math.isfinite(stored) and stored > 0
    if not stored_ok or median_ms < stored:  # a damaged stored time never blocks a real one
        session.execute(update(BestModel).where(*where).values(**values))
        return "replaced"
    return "kept"
