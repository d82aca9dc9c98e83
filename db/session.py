"""Where the database is, how to connect to it, and short transactions that survive contention.

SQLite is the embedded default. Every connection gets busy_timeout (waits for a lock instead of
failing), foreign_keys=ON, and, when writable, WAL (readers never block the writer). Write
transactions start with BEGIN IMMEDIATE, i.e. they take the write lock up front, so two processes
never both read and then fail to upgrade their lock. Anything still reported as locked/busy (or,
on PostgreSQL, a serialization failure or a lost race on a unique constraint) is retried with
jittered exponential backoff, so concurrent writers lose nothing.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar
from urllib.parse import quote

from sqlalchemy import create_engine, event
from sqlalchemy.engine import URL, Engine, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session

from .errors import DatabaseError

ENV_DB = "ZYFA_TUNE_DB"
BUSY_TIMEOUT_MS = 30_000
#: Give up on a contended transaction after this long (each try may itself wait busy_timeout).
RETRY_SECONDS = 120.0
#: Lost races on unique constraints resolve on the next try; more than this is a real error.
MAX_INTEGRITY_RETRIES = 8
#: PostgreSQL SQLSTATEs worth retrying: serialization failure, deadlock, lock not available.
_PG_RETRY_STATES = {"40001", "40P01", "55P03"}

#: Python modules of the PostgreSQL drivers SQLAlchemy may ask for, and what provides ours.
POSTGRES_DRIVERS = {"psycopg", "psycopg2", "pg8000", "asyncpg"}
POSTGRES_HINT = (
    'the PostgreSQL driver is not installed: pip install "zyfa-tune[postgres]" '
    "(psycopg 3; name it in the URL: postgresql+psycopg://...)"
)

T = TypeVar("T")


def default_db_path() -> Path:
    """$ZYFA_TUNE_DB, else $XDG_CACHE_HOME/zyfa_tune/tuning.db, else ~/.cache/zyfa_tune/tuning.db."""
    explicit = os.environ.get(ENV_DB)
    if explicit:
        return Path(explicit).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME")
    base = Path(cache) if cache and os.path.isabs(cache) else Path.home() / ".cache"
    return base / "zyfa_tune" / "tuning.db"


@dataclass(frozen=True)
class Target:
    """A resolved database location. `path` is set for SQLite files (they get file-level checks)."""

    url: URL
    path: Path | None

    @property
    def display(self) -> str:
        """What messages name: the file, or the URL with its password masked."""
        return str(self.path) if self.path is not None else self.url.render_as_string(hide_password=True)

    @property
    def url_text(self) -> str:
        if self.path is not None:
            return "sqlite:///" + str(self.path)
        return self.url.render_as_string(hide_password=True)

    @property
    def is_sqlite(self) -> bool:
        return self.url.get_backend_name() == "sqlite"


def resolve_target(target: str | os.PathLike | None) -> Target:
    """None -> default_db_path(); a path -> that SQLite file; a string with "://" -> a URL."""
    if target is None:
        target = default_db_path()
    if isinstance(target, str) and "://" in target:
        try:
            url = make_url(target)
        except ArgumentError as exc:
            raise DatabaseError(f"not a database URL: {exc}") from None
        database = url.database or ""
        if (
            url.get_backend_name() == "sqlite"
            and database not in ("", ":memory:")
            and not database.startswith("file:")
            and not url.query
        ):
            return _file_target(Path(database))
        return Target(url=url, path=None)
    return _file_target(Path(os.fspath(target)))


def _file_target(path: Path) -> Target:
    path = Path(os.path.abspath(path.expanduser()))
    return Target(url=URL.create("sqlite", database=str(path)), path=path)


def make_engine(target: Target, *, readonly: bool, wal: bool = True) -> Engine:
    """An engine with the connection settings above; `wal=False` keeps a rollback journal
    (exported files: one self-contained file that also opens from a read-only directory)."""
    url = target.url
    if target.is_sqlite and target.path is not None and readonly:
        url = URL.create(
            "sqlite", database="file:" + quote(str(target.path), safe="/"), query={"mode": "ro", "uri": "true"}
        )
    try:
        engine = create_engine(url)
    except (ArgumentError, ImportError) as exc:  # unknown dialect, driver not installed
        raise DatabaseError(f"{target.display}: cannot create an engine: {exc}{driver_hint(exc)}") from exc
    if engine.dialect.name == "sqlite":
        _configure_sqlite(engine, readonly=readonly, wal=wal)
    elif engine.dialect.name == "postgresql" and readonly:
        engine = engine.execution_options(postgresql_readonly=True)
    return engine


def driver_hint(exc: BaseException) -> str:
    """ "; <what to install>" when `exc` (or what caused it) is a missing PostgreSQL driver, else ""."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        name = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
        if name and name.split(".")[0] in POSTGRES_DRIVERS:
            return f"; {POSTGRES_HINT}"
        exc = exc.__cause__ or exc.__context__
    return ""


def _configure_sqlite(engine: Engine, *, readonly: bool, wal: bool) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record) -> None:
        dbapi_conn.isolation_level = None  # we emit BEGIN ourselves (see _on_begin)
        cur = dbapi_conn.cursor()
        try:
            cur.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            cur.execute("PRAGMA foreign_keys = ON")
            if readonly:
                cur.execute("PRAGMA query_only = ON")
            else:
                cur.execute(f"PRAGMA journal_mode = {'WAL' if wal else 'DELETE'}")
                cur.execute("PRAGMA synchronous = NORMAL")
        finally:
            cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn) -> None:
        writing = not readonly and not conn.get_execution_options().get("zyfa_read", False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if writing else "BEGIN")


def reading(engine: Engine) -> Engine:
    """The same engine, but its SQLite transactions start deferred (no write lock for reads)."""
    return engine.execution_options(zyfa_read=True)


def _retryable(exc: DBAPIError) -> bool:
    if getattr(exc.orig, "sqlstate", None) in _PG_RETRY_STATES:
        return True
    text = str(exc.orig).lower()
    return any(word in text for word in ("database is locked", "database table is locked", "busy", "deadlock"))


def run_transaction(engine: Engine, work: Callable[[Session], T], *, where: str) -> T:
    """Run `work` in one transaction, retrying contention; DatabaseError naming `where` otherwise.
    `work` may run more than once, so it must not have side effects outside the session."""
    deadline = time.monotonic() + RETRY_SECONDS
    delay, integrity_failures = 0.002, 0
    while True:
        try:
            with Session(engine, expire_on_commit=False) as session, session.begin():
                return work(session)
        except IntegrityError as exc:
            integrity_failures += 1
            if integrity_failures > MAX_INTEGRITY_RETRIES:
                raise DatabaseError(f"{where}: {exc.orig}") from exc
        except DBAPIError as exc:
            if not _retryable(exc) or time.monotonic() > deadline:
                raise DatabaseError(f"{where}: {exc.orig}") from exc
        except SQLAlchemyError as exc:
            raise DatabaseError(f"{where}: {exc}") from exc
        time.sleep(delay * random.uniform(0.5, 1.5))
        delay = min(delay * 2, 0.25)
