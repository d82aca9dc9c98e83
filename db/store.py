"""`Store`: record tuning trials, keep the best per (fingerprint, problem class), read them back.

Writes are one short transaction each (see session.py for locking and retries). Reads validate
every row into frozen records with the checks import applies (validity.py); a damaged or
implausible row is skipped with a RuntimeWarning rather than breaking the caller.
"""

from __future__ import annotations

import contextlib
import os
import socket
import uuid
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from zyfa_tune.generator import KernelConfig

from . import rows, transfer, validity
from .checks import finite_float, optional_float, optional_int, optional_text, text
from .errors import DatabaseError
from .fingerprint import Fingerprint
from .keys import APIS, ProblemKey
from .migrations import ensure_schema, refuse_newer
from .models import SCHEMA_VERSION, BestModel, EnvironmentModel, ProblemModel, TrialModel, VariantModel
from .records import TRIAL_COLUMNS, TRIAL_SHAPE, TRIAL_STATUSES, TRIAL_V4, BestEntry, ImportReport, TrialResult
from .session import Target, default_db_path, make_engine, reading, resolve_target, run_transaction
from .sqlite_file import backup, inspect_file

E, P, V, T, B = EnvironmentModel, ProblemModel, VariantModel, TrialModel, BestModel
#: what the problem-key columns an older file lacks read as
_KEY_DEFAULTS = {"api": "fp8", "tokens_bucket": 0}


class Store:
    """A tuning database. Use `open_store()` to get one; close it (or use `with`)."""

    def __init__(
        self,
        engine: Engine,
        target: Target,
        *,
        readonly: bool,
        version: int = SCHEMA_VERSION,
        allow_simulated: bool = True,
    ):
        self._engine = engine
        self._target = target
        self.readonly = readonly
        self.version = version  # older than SCHEMA_VERSION only when read-only (see migrations.py)
        self.allow_simulated = allow_simulated
        self.url: str = target.url_text  # password masked
        self._closed = False

    def __repr__(self) -> str:
        return f"Store({self.url!r}, readonly={self.readonly})"

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release every connection (SQLite then checkpoints and removes its WAL file)."""
        if not self._closed:
            self._closed = True
            self._engine.dispose()

    # ---- writing ------------------------------------------------------------------------------
    def record_trial(
        self,
        fingerprint: Fingerprint,
        key: ProblemKey,
        config: KernelConfig,
        result: TrialResult,
        *,
        backend: str | None = None,
        source_hash: str,
        study: str | None = None,
        provenance: str | None = None,
    ) -> int:
        """Store one trial (and its environment/problem/variant rows if new); if it is "ok" and
        faster than the current best of (fingerprint, key), it becomes the best. One transaction.
        Returns the trial's id. The variant's backend column is the config's backend (`backend`,
        if given, must agree). A physically impossible timing is a ValueError; a simulated
        fingerprint is refused unless the store allows simulated rows (see `open_store`). Control
        characters of the message and provenance are dropped (checks.clean_text)."""
        work = self._trial_work(fingerprint, key, config, result, backend, source_hash, study, provenance)
        return self._write("record_trial", work)

    def record_trials(
        self,
        fingerprint: Fingerprint,
        config: KernelConfig,
        results: Sequence[tuple[ProblemKey, TrialResult]],
        *,
        source_hash: str,
        study: str | None = None,
        provenance: str | None = None,
    ) -> list[int]:
        """`record_trial` for each (key, result) of one measured config, committed as one transaction:
        a tuner killed between the shapes of a trial leaves all of its rows or none. The trials' ids."""
        works = [
            self._trial_work(fingerprint, key, config, result, None, source_hash, study, provenance)
            for key, result in results
        ]
        return self._write("record_trials", lambda session: [work(session) for work in works])

    def _trial_work(
        self,
        fingerprint: Fingerprint,
        key: ProblemKey,
        config: KernelConfig,
        result: TrialResult,
        backend: str | None,
        source_hash: str,
        study: str | None,
        provenance: str | None,
    ) -> Callable[[Session], int]:
        """Check one trial's values and return the work that writes its rows inside a transaction."""
        _expect("fingerprint", fingerprint, Fingerprint)
        _expect("key", key, ProblemKey)
        _expect("config", config, KernelConfig)
        _expect("result", result, TrialResult)
        validity.check_config_matches(config, key)
        validity.check_kernel_ids(config.backend if backend is None else backend, source_hash)
        if backend is not None and backend != config.backend:
            raise ValueError(f"backend: {backend!r} differs from the config's backend {config.backend!r}")
        backend = config.backend
        validity.check_timing(key, result.median_ms, result.tflops)
        validity.check_recipe_fits(key, result.recipe)
        optional_text("study", study)
        self._check_simulated(fingerprint)
        now = rows.utc_now()
        if provenance is None:
            provenance = f"study={study or '-'} host={socket.gethostname()} {now.isoformat(timespec='seconds')}Z"
        provenance = text("provenance", provenance, max_len=rows.MAX_PROVENANCE_CHARS, clean=True)

        def work(session: Session) -> int:
            env = rows.environment_id(session, fingerprint)
            problem = rows.problem_id(session, key)
            variant = rows.variant_id(
                session,
                backend=backend,
                config=config,
                source_hash=source_hash,
                generator_version=fingerprint.generator_version,
            )
            trial = T(
                environment_id=env,
                problem_id=problem,
                variant_id=variant,
                status=result.status,
                message=rows.clip_message(result.message),
                study=study,
                provenance=provenance,
                created_at=now,
                **{f: getattr(result, f) for f in TRIAL_COLUMNS},
            )
            session.add(trial)
            session.flush()
            if result.status == "ok":
                rows.offer_best(
                    session,
                    environment=env,
                    problem=problem,
                    variant=variant,
                    trial=trial.id,
                    median_ms=result.median_ms,
                    tflops=result.tflops,
                    error_rel_l2=result.error_rel_l2,
                    provenance=provenance,
                    now=now,
                )
            return trial.id

        return work

    # ---- reading ------------------------------------------------------------------------------
    def best_entries(
        self,
        *,
        gpu_name: str | None = None,
        head_dims: tuple[int, int] | None = None,
        dtype: str | None = None,
        api: str | None = None,
    ) -> list[BestEntry]:
        """Best entries, optionally of one GPU model / (head_dim_qk, head_dim_v) / dtype / API, ordered
        by GPU, dtype, head dims, problem class."""
        where = []
        if api is not None:
            if api not in APIS:
                raise ValueError(f"api: {api!r} is not one of {list(APIS)}")
            if self.version < 4:  # every problem of an older file is "fp8"
                if api != "fp8":
                    return []
            else:
                where.append(P.api == api)
        if gpu_name is not None:
            where.append(E.gpu_name == gpu_name)
        if head_dims is not None:
            qk, v = head_dims
            where += [P.head_dim_qk == qk, P.head_dim_v == v]
        if dtype is not None:
            where.append(P.dtype == dtype)
        order = (
            E.gpu_name,
            E.digest,
            P.dtype,
            P.head_dim_qk,
            P.head_dim_v,
            P.causal,
            P.gqa_group,
            P.seqlen_bucket,
            P.bh_bucket,
        ) + ((P.tokens_bucket,) if self.version >= 5 else ())
        return self._best(where, order)

    def fastest_within(self, max_error: float, *, relative: bool = False) -> list[BestEntry]:
        """Per (fingerprint, problem class), the fastest `ok` trial whose rel. L2 error (against
        float64, on the tuner's inputs) is at most `max_error` (`relative`: at most `max_error` x its
        reference's, error_ref, where one was measured): the runtime's error budget picks from every
        kernel that passed the study's gate, not only the overall fastest (a multi-objective study
        keeps the whole front). Rows as `best_entries` (provenance and time of the trial)."""
        max_error = finite_float("max_error", max_error, positive=True)
        within = [T.error_rel_l2 <= max_error]
        if relative:  # (a file older than version 4 has no reference errors: nothing to judge)
            if self.version < 4:
                return []
            within = [T.error_ref.is_not(None), T.error_rel_l2 <= T.error_ref * max_error]
        cols = _entry_columns(T, T.created_at, self.version) + [
            rows.raw(T.environment_id, "env_id"),
            rows.raw(T.problem_id, "problem_id"),
        ]
        stmt = (
            select(*cols)
            .join_from(T, E, T.environment_id == E.id)
            .join(P, T.problem_id == P.id)
            .join(V, T.variant_id == V.id)
            .where(T.status == "ok", T.error_rel_l2.is_not(None), *within, T.median_ms > 0)
            .order_by(T.environment_id, T.problem_id, T.median_ms, T.id)
        )
        out, seen = [], set()
        for r, entry in self._entries(stmt, "trials within an error budget"):
            if (r["env_id"], r["problem_id"]) not in seen:  # the fastest valid trial per class
                seen.add((r["env_id"], r["problem_id"]))
                out.append(entry)
        return out

    def best_for(self, key: ProblemKey) -> list[BestEntry]:
        """The best entry of `key` on every fingerprint, fastest first."""
        where = _key_where(key, self.version)
        return [] if where is None else self._best(where, (B.median_ms,))

    def trials(
        self, *, key: ProblemKey | None = None, status: str | None = None, limit: int | None = None
    ) -> list[dict[str, Any]]:
        """Trials as dicts (newest first): every trial field, plus study, provenance, created_at (UTC),
        backend, config_json (unvalidated text), source_hash, fingerprint_digest, gpu_name and the
        problem key's fields."""
        optional_int("limit", limit, lo=0)
        where = _trial_filters(key, status, self.version)
        if where is None:
            return []
        new = self.version >= 4  # an older file lacks the recipe, error_ref and api columns: None / "fp8"
        names = [
            n
            for n in ("id", "status", *TRIAL_COLUMNS, "message", "study", "provenance", "created_at")
            if new or n not in TRIAL_V4
        ]
        cols = (
            [rows.raw(getattr(T, n)) for n in names]
            + [
                rows.raw(V.backend),
                rows.raw(V.config_json),
                rows.raw(V.source_hash),
                rows.raw(E.digest, "fingerprint_digest"),
                rows.raw(E.gpu_name),
            ]
            + [rows.raw(getattr(P, n)) for n in rows.key_fields(self.version)]
        )
        stmt = (
            select(*cols)
            .join_from(T, E, T.environment_id == E.id)
            .join(P, T.problem_id == P.id)
            .join(V, T.variant_id == V.id)
            .where(*where)
            .order_by(T.id.desc())
            .limit(limit)
        )
        found = self._read(
            "trials",
            lambda s: [{**dict.fromkeys(TRIAL_V4), **_KEY_DEFAULTS, **r._mapping} for r in s.execute(stmt)],
        )
        for r in found:  # informational listing: values that do not convert are shown as stored
            with contextlib.suppress(ValueError):
                r["created_at"] = rows.aware(rows.as_utc("created_at", r["created_at"]))
            with contextlib.suppress(ValueError):
                r["causal"] = rows.as_bool("causal", r["causal"])
        return found

    def count_trials(self, *, key: ProblemKey | None = None, status: str | None = None) -> int:
        where = _trial_filters(key, status, self.version)
        if where is None:
            return 0
        stmt = select(func.count(T.id)).join_from(T, P, T.problem_id == P.id).where(*where)
        return int(self._read("count_trials", lambda s: s.scalar(stmt)))

    # ---- moving rows between databases ---------------------------------------------------------
    def export(
        self,
        path: str | os.PathLike,
        *,
        gpu_name: str | None = None,
        head_dims: tuple[int, int] | None = None,
        best_only: bool = True,
    ) -> int:
        """Write a NEW self-contained SQLite file (rollback journal, no WAL: it can be shipped and
        opened read-only) with the best entries (and their trials), or with every trial if not
        `best_only`, filtered by GPU model and head dims. Never overwrites an existing file.
        Returns the number of best entries (best_only) or of trials written."""
        dest = Path(os.path.abspath(os.fspath(path)))
        if os.path.lexists(dest):
            raise DatabaseError(f"{dest}: already exists; export writes a new file and never overwrites")
        if not dest.parent.is_dir():
            raise DatabaseError(f"{dest}: its folder does not exist")
        source = self._read(
            "export", lambda s: transfer.read_source(s, gpu_name=gpu_name, head_dims=head_dims, best_only=best_only)
        )
        for row, reason in source.rejected:
            warnings.warn(f"{self._target.display}: export skips {row}: {reason}", RuntimeWarning, stacklevel=2)
        source.rejected = []
        report = ImportReport()
        tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:12]}.tmp")
        try:
            with _open(resolve_target(tmp), readonly=False, create=True, wal=False) as out:
                trials, best = transfer.write_rows(
                    out._engine, f"{dest}: export", source, report, provenance_prefix=None
                )
            _publish(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)
            Path(f"{tmp}-journal").unlink(missing_ok=True)
        return best if best_only else trials

    def import_from(self, source: "str | os.PathLike | Store", *, mode: str = "merge") -> ImportReport:
        """Merge another database into this one, validating every row first (see transfer.py):
        bad rows are rejected with a reason and nothing from them is written; trials are copied
        (duplicates skipped); per (fingerprint, problem) the faster best entry is kept, with
        provenance "imported from <source>; <original provenance>". Simulated rows are rejected
        unless this store allows them (see `open_store`)."""
        if mode != "merge":
            raise ValueError(f"mode: {mode!r} is not supported (only 'merge')")
        self._check_writable("import_from")
        owned = not isinstance(source, Store)
        src = _open(resolve_target(source), readonly=True, create=False, allow_old=True) if owned else source
        try:
            name = src._target.path.name if src._target.path is not None else src.url
            name = "".join(c if c.isprintable() else "?" for c in name)
            report = ImportReport()
            rows_in = src._read("import_from", transfer.read_source)
            if not self.allow_simulated:
                transfer.drop_simulated(
                    rows_in, f"kept out of {self._target.display} (open it with allow_simulated=True to take them)"
                )
            transfer.write_rows(
                self._engine,
                f"{self._target.display}: import_from",
                rows_in,
                report,
                provenance_prefix=f"imported from {name}",
            )
            return report
        finally:
            if owned:
                src.close()

    # ---- internals ----------------------------------------------------------------------------
    def _check_simulated(self, fingerprint: Fingerprint) -> None:
        if fingerprint.simulated and not self.allow_simulated:
            raise DatabaseError(
                f"{self._target.display}: refusing a simulated ({fingerprint.runner}) result: the default "
                f"database feeds the dispatcher; record elsewhere, or open it with allow_simulated=True"
            )

    def _check_writable(self, op: str) -> None:
        if self._closed:
            raise DatabaseError(f"{self._target.display}: {op} on a closed store")
        if self.readonly:
            raise DatabaseError(f"{self._target.display}: opened readonly; {op} needs a writable store")

    def _write(self, op: str, work: Callable[[Session], Any]) -> Any:
        self._check_writable(op)
        return run_transaction(self._engine, work, where=f"{self._target.display}: {op}")

    def _read(self, op: str, work: Callable[[Session], Any]) -> Any:
        if self._closed:
            raise DatabaseError(f"{self._target.display}: {op} on a closed store")
        return run_transaction(reading(self._engine), work, where=f"{self._target.display}: {op}")

    def _best(self, where: list, order: tuple) -> list[BestEntry]:
        stmt = (
            select(*_entry_columns(B, B.updated_at, self.version))
            .join_from(B, E, B.environment_id == E.id)
            .join(P, B.problem_id == P.id)
            .join(V, B.variant_id == V.id)
            .outerjoin(T, B.trial_id == T.id)
            .where(*where)
            .order_by(*order, B.median_ms)
        )
        return [entry for _, entry in self._entries(stmt, "best entries")]

    def _entries(self, stmt, what: str) -> list[tuple[dict[str, Any], BestEntry]]:
        """(raw row, BestEntry) of every row of `stmt` that validates; a damaged row is skipped with a
        warning naming the database."""
        out = []
        for r in self._read(what, lambda s: [dict(row._mapping) for row in s.execute(stmt)]):
            try:
                out.append((r, _best_entry(r)))
            except ValueError as exc:
                warnings.warn(
                    f"{self._target.display}: skipping a damaged row of {what}: {exc}", RuntimeWarning, stacklevel=4
                )
        return out


def _entry_columns(timed, stamp, version: int) -> list:
    """The columns of a BestEntry row: fingerprint (without the runner before version 3), problem
    key (the columns of its version: `rows.key_fields`), variant, the time, error and provenance of `timed` (the
    best table, or a trial) with `stamp` as its time, the trial's shape, SM clock, status and time,
    and from version 4 its recipe and reference error."""
    fingerprint = [n for n in rows.FINGERPRINT_FIELDS if n != "runner" or version >= 3]
    return (
        [rows.raw(getattr(E, n)) for n in fingerprint]
        + [rows.raw(getattr(P, n)) for n in rows.key_fields(version)]
        + ([rows.raw(getattr(T, n)) for n in TRIAL_V4] if version >= 4 else [])
        + [rows.raw(V.backend), rows.raw(V.config_json), rows.raw(V.source_hash)]
        + [rows.raw(getattr(timed, n)) for n in ("median_ms", "tflops", "error_rel_l2", "provenance")]
        + [rows.raw(stamp, "updated_at")]
        + [rows.raw(getattr(T, n)) for n in TRIAL_SHAPE]
        + [rows.raw(T.sm_clock_mhz)]
        + [rows.raw(T.status, "trial_status"), rows.raw(T.median_ms, "trial_median_ms")]
    )


def _best_entry(r: dict[str, Any]) -> BestEntry:
    """A BestEntry from one raw row, checked as import checks it (validity.py): the config parses
    and fits the key, the trial is "ok" with the same time, and the time is possible."""
    key = rows.key_from(r)
    backend, source_hash = validity.check_kernel_ids(r["backend"], r["source_hash"])
    validity.check_config_matches(validity.variant_config(backend, r["config_json"]), key)
    median_ms, tflops = validity.check_best(
        key,
        median_ms=r["median_ms"],
        tflops=r["tflops"],
        trial_status=r["trial_status"],
        trial_median_ms=r["trial_median_ms"],
    )
    recipe = validity.check_recipe(r.get("recipe"))
    validity.check_recipe_fits(key, recipe)
    error_ref = r.get("error_ref")
    return BestEntry(
        recipe=recipe,
        error_ref=None if error_ref is None else finite_float("error_ref", error_ref, positive=True),
        fingerprint=rows.fingerprint_from(r),
        key=key,
        backend=backend,
        config_json=r["config_json"],
        source_hash=source_hash,
        median_ms=median_ms,
        tflops=tflops,
        error_rel_l2=optional_float("error_rel_l2", r["error_rel_l2"]),
        provenance=text("provenance", r["provenance"] or "", max_len=rows.MAX_PROVENANCE_CHARS, clean=True),
        updated_at=rows.aware(rows.as_utc("updated_at", r["updated_at"])),
        sm_clock_mhz=_clock_or_none(r["sm_clock_mhz"]),
        **{n: _shape_or_none(r[n]) for n in TRIAL_SHAPE},
    )


def _shape_or_none(value: Any) -> int | None:
    return value if type(value) is int and value > 0 else None


def _clock_or_none(value: Any) -> float | None:
    """A stored clock as a float, or None when absent or not a finite positive number (a damaged clock
    loses only the clock, not the entry)."""
    try:
        return finite_float("sm_clock_mhz", value, positive=True) if value is not None else None
    except ValueError:
        return None


def _key_where(key: ProblemKey, version: int) -> list | None:
    """The filter of one problem key; None where no row can match (an older file lacks a column:
    every problem there has the key's default for it, "fp8" api and no packed sequences)."""
    _expect("key", key, ProblemKey)
    values, present = key.to_dict(), rows.key_fields(version)
    if any(values[n] != _KEY_DEFAULTS[n] for n in rows.KEY_SINCE if n not in present):
        return None
    return [getattr(P, n) == values[n] for n in present]


def _trial_filters(key: ProblemKey | None, status: str | None, version: int) -> list | None:
    """The filters of `trials` / `count_trials`; None where no row can match."""
    where = []
    if status is not None:
        if status not in TRIAL_STATUSES:
            raise ValueError(f"status: {status!r} is not one of {list(TRIAL_STATUSES)}")
        where.append(T.status == status)
    if key is not None:
        key_where = _key_where(key, version)
        return None if key_where is None else where + key_where
    return where


def _expect(name: str, value: Any, cls: type) -> None:
    if not isinstance(value, cls):
        raise TypeError(f"{name}: expected {cls.__name__}, got {type(value).__name__}")


def _publish(tmp: Path, dest: Path) -> None:
    """Move the finished export into place without ever replacing a file that appeared meanwhile."""
    try:
        os.link(tmp, dest)
    except FileExistsError:
        raise DatabaseError(f"{dest}: already exists; export writes a new file and never overwrites") from None
    except OSError:  # no hard links on this filesystem
        if os.path.lexists(dest):
            raise DatabaseError(f"{dest}: already exists; export writes a new file and never overwrites") from None
        os.rename(tmp, dest)


def open_store(
    target: str | os.PathLike | None = None,
    *,
    readonly: bool = False,
    create: bool = True,
    allow_simulated: bool = False,
) -> Store:
    """Open (and if needed create or upgrade) a tuning database.

    target: None -> default_db_path(); a filesystem path -> that SQLite file; a string containing
    "://" -> an SQLAlchemy URL as is (e.g. postgresql+psycopg://user:pw@host/db).
    readonly: never writes (SQLite: opened with mode=ro); a schema older than
    migrations.READABLE_FROM is then an error, a newer old one is read as it is.
    create: create a missing (or 0-byte) database; otherwise that is a DatabaseError.
    allow_simulated: let results of a simulating runner (`Fingerprint.simulated`: replay, fault
    injection; no kernel timed on a GPU) into the default database (default_db_path(), which the
    dispatcher reads): `record_trial` refuses them there otherwise (DatabaseError) and `import_from`
    rejects them. A tuner running such a runner passes True only when asked to. Other databases
    always take them (the dispatcher never serves them to a GPU).
    """
    resolved = resolve_target(target)
    if target is None and create and not readonly:
        resolved.path.parent.mkdir(parents=True, exist_ok=True)
    default = resolve_target(default_db_path())
    is_default = resolved.path is not None and resolved.path == default.path
    return _open(resolved, readonly=readonly, create=create, allow_simulated=allow_simulated or not is_default)


def _open(
    target: Target,
    *,
    readonly: bool,
    create: bool,
    wal: bool = True,
    allow_old: bool = False,
    allow_simulated: bool = True,
) -> Store:
    if target.path is not None:
        # decide on the untouched file first: opening it through the engine switches it to WAL
        state = inspect_file(target.path)
        if state.version is None and (readonly or not create):
            what = "does not exist" if not state.exists else "holds no zyfa-tune database"
            raise DatabaseError(f"{target.path}: {what}")
        refuse_newer(state.version, target.display)
        if state.version is not None and state.version < SCHEMA_VERSION and not readonly:
            backup(target.path, state.version)
    engine = make_engine(target, readonly=readonly, wal=wal)
    try:
        version = ensure_schema(engine, where=target.display, readonly=readonly, create=create, allow_old=allow_old)
    except BaseException:
        engine.dispose()
        raise
    return Store(engine, target, readonly=readonly, version=version, allow_simulated=allow_simulated)
