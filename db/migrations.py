"""Schema creation and in-place upgrades (alembic's Operations API, driven from code).

Each step `MIGRATIONS[v]` takes a version-v database to v+1 and only adds: data is never dropped
(versions 4 and 5 widen the problems table's unique key; SQLite rebuilds that table, rows and ids
kept).
The whole upgrade runs in one transaction (SQLite and PostgreSQL both have transactional DDL) under
the write lock (SQLite: BEGIN IMMEDIATE; PostgreSQL: an advisory lock), re-reading the version
inside it, so concurrent openers upgrade once. A newer version than SCHEMA_VERSION is refused.
A read-only opener cannot upgrade; versions from READABLE_FROM on are read as they are (the store
leaves out the columns they lack), so shipped and shared files keep working after an upgrade.
"""

from __future__ import annotations

from collections.abc import Callable

from alembic.migration import MigrationContext
from alembic.operations import Operations
from sqlalchemy import (
    Boolean,
    Column,
    Float,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
    insert,
    inspect,
    select,
    text,
    update,
)
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import Session

from .errors import DatabaseError
from .fingerprint import SIMULATED_SUFFIX
from .models import META_TABLE, SCHEMA_VERSION, Base, MetaModel
from .session import reading, run_transaction
from .sqlite_file import parse_version

#: Arbitrary constant key of the PostgreSQL advisory lock held while creating/upgrading.
_PG_LOCK_KEY = 0x7A79_6661


def _v1_to_v2(op: Operations) -> None:
    """Version 2 records energy: joules per call and TFLOP per joule."""
    op.add_column("trials", Column("energy_j", Float(precision=53), nullable=True))
    op.add_column("trials", Column("tflop_per_j", Float(precision=53), nullable=True))


def _v2_to_v3(op: Operations) -> None:
    """Version 3 records what measured (environments.runner): "gpu", or the simulating runner,
    which earlier versions named only in the GPU name ("replay (no GPU)")."""
    op.add_column("environments", Column("runner", String(32), nullable=False, server_default="gpu"))
    cut = len(SIMULATED_SUFFIX)
    op.execute(
        text(
            "UPDATE environments SET runner = substr(gpu_name, 1, length(gpu_name) - :cut) WHERE gpu_name LIKE :pattern"
        ).bindparams(cut=cut, pattern="%" + SIMULATED_SUFFIX)
    )


#: The problem key's columns before version 4 (the unique constraint's, in its order), and after.
_KEY_V3 = ("dtype", "head_dim_qk", "head_dim_v", "causal", "gqa_group", "seqlen_bucket", "bh_bucket")
_KEY_V4 = (*_KEY_V3, "api")
_KEY_V5 = (*_KEY_V4, "tokens_bucket")


def _v3_to_v4(op: Operations) -> None:
    """Version 4 records the API a problem is timed for (problems.api: "fp8", the kernel alone on
    FP8 codes, for every earlier row; or "bf16", quantiser and kernel together) and per trial the
    quantisation recipe (NULL: the plain one) and the reference error on the same inputs. The
    problem key's unique constraint gains api. Columns already there are left as they are."""
    _add_missing(op, "trials", Column("recipe", Text, nullable=True))
    _add_missing(op, "trials", Column("error_ref", Float(precision=53), nullable=True))
    _widen_problem_key(op, _KEY_V3, "api")


def _v4_to_v5(op: Operations) -> None:
    """Version 5 records packed-sequence (varlen) problem classes: problems.tokens_bucket, the packed
    batch's total tokens bucket (0, a rectangular problem, for every earlier row). The problem key's
    unique constraint gains it."""
    _widen_problem_key(op, _KEY_V4, "tokens_bucket")


def _widen_problem_key(op: Operations, key: tuple[str, ...], added: str) -> None:
    """Add the column `added` (its server default for the rows there) to the problems table and to its
    unique key `key`; nothing where the column is there already."""
    conn = op.get_bind()
    if added in {c["name"] for c in inspect(conn).get_columns("problems")}:
        return
    if conn.dialect.name != "sqlite":
        op.add_column("problems", _problem_column(added))
        op.drop_constraint("uq_problems_key", "problems", type_="unique")
        op.create_unique_constraint("uq_problems_key", "problems", [*key, added])
        return
    _rebuild_sqlite_problems(conn, key, added)


def _problem_column(name: str) -> Column:
    """A column of the problems table as the version that added it defines it."""
    if name == "api":
        return Column(name, String(8), nullable=False, server_default="fp8")
    if name == "tokens_bucket":
        return Column(name, Integer, nullable=False, server_default="0")
    kind = String(8) if name == "dtype" else Boolean if name == "causal" else Integer
    return Column(name, kind, nullable=False)


def _rebuild_sqlite_problems(conn: Connection, key: tuple[str, ...], added: str) -> None:
    """SQLite cannot change a table's constraints: the table is rebuilt under its name, ids kept,
    `added` taking its server default. Its rows wait in a temporary copy while it is dropped and
    created anew; foreign keys are deferred meanwhile (trials and best reference it), and
    re-inserting the rows satisfies them again before the commit, which SQLite checks; a foreign key
    check confirms."""
    conn.exec_driver_sql("PRAGMA defer_foreign_keys = ON")  # until this transaction ends
    conn.exec_driver_sql("CREATE TEMP TABLE _problems_old AS SELECT * FROM problems")
    conn.exec_driver_sql("DROP TABLE problems")
    names = (*key, added)
    table = Table(
        "problems",
        MetaData(),
        Column("id", Integer, primary_key=True),
        *(_problem_column(n) for n in names),
        UniqueConstraint(*names, name="uq_problems_key"),
    )
    table.create(conn)
    copied = ", ".join(("id", *key))
    conn.exec_driver_sql(f"INSERT INTO problems ({copied}) SELECT {copied} FROM temp._problems_old")
    conn.exec_driver_sql("DROP TABLE temp._problems_old")
    broken = conn.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
    if broken:
        raise DatabaseError(f"rebuilding the problems table left {len(broken)} broken references")


def _add_missing(op: Operations, table: str, column: Column) -> None:
    if column.name not in {c["name"] for c in inspect(op.get_bind()).get_columns(table)}:
        op.add_column(table, column)


MIGRATIONS: dict[int, Callable[[Operations], None]] = {1: _v1_to_v2, 2: _v2_to_v3, 3: _v3_to_v4, 4: _v4_to_v5}
#: The oldest version a read-only store reads as is.
READABLE_FROM = 2


def read_version(conn: Connection, where: str) -> int | None:
    """The schema version, or None when the database has no zyfa-tune schema yet."""
    if not inspect(conn).has_table(META_TABLE):
        return None
    rows = conn.execute(select(MetaModel.value).where(MetaModel.key == "schema_version")).fetchall()
    return parse_version([tuple(r) for r in rows], where)


def ensure_schema(engine: Engine, *, where: str, readonly: bool, create: bool = True, allow_old: bool = False) -> int:
    """Create the schema in an empty database (if `create`) or upgrade an older one; refuse a newer
    one. `allow_old` (read-only import sources) reads an older version as it is. Returns the version."""
    version = run_transaction(reading(engine), lambda s: read_version(s.connection(), where), where=where)
    refuse_newer(version, where)
    if version == SCHEMA_VERSION or (readonly and version is not None and (allow_old or version >= READABLE_FROM)):
        return version
    if version is None and (readonly or not create):
        raise DatabaseError(
            f"{where}: holds no zyfa-tune database" + ("; open it writable once to create one" if readonly else "")
        )
    if readonly:
        raise DatabaseError(
            f"{where}: schema version {version} is older than {SCHEMA_VERSION}; open "
            f"it writable once (open_store without readonly=True) to upgrade it"
        )
    run_transaction(engine, lambda s: _create_or_upgrade(s, where), where=where)
    return SCHEMA_VERSION


def refuse_newer(version: int | None, where: str) -> None:
    if version is not None and version > SCHEMA_VERSION:
        raise DatabaseError(
            f"{where}: schema version {version} is newer than this zyfa-tune "
            f"understands ({SCHEMA_VERSION}); upgrade zyfa-tune to use it"
        )


def _create_or_upgrade(session: Session, where: str) -> None:
    conn = session.connection()
    if conn.dialect.name == "postgresql":
        conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_LOCK_KEY})
    version = read_version(conn, where)  # again, under the lock: someone may have done it
    refuse_newer(version, where)
    if version is None:
        Base.metadata.create_all(conn)
        conn.execute(insert(MetaModel).values(key="schema_version", value=str(SCHEMA_VERSION)))
        return
    op = Operations(MigrationContext.configure(connection=conn))
    while version < SCHEMA_VERSION:
        MIGRATIONS[version](op)
        version += 1
    conn.execute(update(MetaModel).where(MetaModel.key == "schema_version").values(value=str(version)))
