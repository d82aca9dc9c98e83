"""Schema version 5: problem classes of packed sequences (problems.tokens_bucket). A version-4 file
reads as it is (every problem rectangular) and upgrades in place, rows and ids kept; packed keys
round-trip through record, read, export and import apart from the rectangular key of the same
buckets; bad keys are refused."""

from __future__ import annotations

import dataclasses
import sqlite3

import pytest
from alembic.migration import MigrationContext
from alembic.operations import Operations
from sqlalchemy import create_engine, inspect
from test_db_migration import columns, version_of
from test_db_recipes import make_v3
from test_db_support import record

from zyfa_tune.db import SCHEMA_VERSION, ProblemKey, migrations, open_store, tokens_bucket
from zyfa_tune.db.validity import min_plausible_ms

pytest_plugins = ["test_db_support"]  # fixtures: target (sqlite + postgres), pg_url


def packed_key(tokens: int = 131072, *, nseq: int = 64, max_len: int = 8192, **kw) -> ProblemKey:
    base = dict(dtype="fp8", head_dim_qk=128, head_dim_v=128, causal=True, heads=32, kv_heads=8)
    return ProblemKey.from_shape(**{**base, **kw}, batch=nseq, seqlen=max_len, tokens=tokens)


def dense_key() -> ProblemKey:
    return dataclasses.replace(packed_key(), tokens_bucket=0)


def make_v4(path) -> None:
    """A version-4 file: version 3 taken through the real upgrade to 4."""
    make_v3(path)
    engine = create_engine(f"sqlite:///{path}")
    try:
        with engine.begin() as conn:
            migrations.MIGRATIONS[3](Operations(MigrationContext.configure(connection=conn)))
            conn.exec_driver_sql("UPDATE zyfa_meta SET value = '4' WHERE key = 'schema_version'")
    finally:
        engine.dispose()


def test_packed_key_buckets_and_checks():
    k = packed_key(131930, nseq=64, max_len=8192)
    assert (k.tokens_bucket, k.seqlen_bucket, k.bh_bucket, k.gqa_group) == (262144, 8192, 1024, 4)
    assert k.packed and not dense_key().packed and "varlen tokens<=262144" in str(k)
    assert tokens_bucket(1) == 256 and tokens_bucket(1 << 30) == 1 << 24
    for bad in (3000, -256, 1 << 25, True, 1.0):
        with pytest.raises(ValueError, match="tokens_bucket"):
            dataclasses.replace(k, tokens_bucket=bad)
    with pytest.raises(ValueError, match="tokens_bucket"):
        dataclasses.replace(k, api="bf16")  # the bf16 API has no packed entry point
    with pytest.raises(ValueError, match="tokens"):
        packed_key(0)
    # a packed class's fewest FLOPs: every token a sequence of one, so short times stay plausible
    assert min_plausible_ms(packed_key(300)) < min_plausible_ms(dense_key()) / 1000


def test_packed_rows_round_trip_apart_from_the_rectangular_key(target, tmp_path):
    with open_store(target) as s:
        record(s, 2.0, k=dense_key())
        record(s, 1.5, k=packed_key(), batch=64, heads=32, seqlen=8192)
        record(s, 0.8, k=packed_key(4096, nseq=8, max_len=1024))
        best = {b.key: b.median_ms for b in s.best_entries()}
        assert best == {dense_key(): 2.0, packed_key(): 1.5, packed_key(4096, nseq=8, max_len=1024): 0.8}
        assert [b.median_ms for b in s.best_for(packed_key())] == [1.5]
        assert [t["tokens_bucket"] for t in s.trials(key=packed_key())] == [131072]
        assert s.count_trials(key=dense_key()) == 1
        s.export(tmp_path / "out.db", best_only=False)
    with open_store(tmp_path / "copy.db") as c:
        report = c.import_from(tmp_path / "out.db")
        assert not report.rejected and report.added == 3
        assert {b.key: b.median_ms for b in c.best_entries()} == best


def test_v4_file_reads_as_is_and_gains_the_column(tmp_path):
    path = tmp_path / "v4.db"
    make_v4(path)
    assert version_of(path) == "4" and "tokens_bucket" not in columns(path, "problems")
    with open_store(path, readonly=True) as s:  # read as it is: no problem is of packed sequences
        (best,) = s.best_entries()
        assert not best.key.packed and best.median_ms == 1.25
        assert s.best_for(packed_key()) == [] and s.count_trials(key=packed_key()) == 0
        assert {t["tokens_bucket"] for t in s.trials()} == {0}
    assert version_of(path) == "4"
    with open_store(path) as s:  # writable: upgraded, rows and ids kept
        assert s.version == SCHEMA_VERSION == 5
        assert [b.median_ms for b in s.best_entries()] == [1.25] and s.count_trials() == 3
        record(s, 0.9, k=packed_key())
        assert sorted(b.key.tokens_bucket for b in s.best_entries()) == [0, 131072]
    assert (tmp_path / "v4.db.v4.bak").exists()
    con = sqlite3.connect(path)
    try:
        assert con.execute("PRAGMA foreign_key_check").fetchall() == []
        assert con.execute("SELECT id, api, tokens_bucket FROM problems ORDER BY id").fetchall() == [
            (1, "fp8", 0),
            (2, "fp8", 131072),
        ]
    finally:
        con.close()
    engine = create_engine(f"sqlite:///{path}")
    try:  # the model and the upgraded file agree on the problems table and its key
        insp = inspect(engine)
        assert {c["name"] for c in insp.get_columns("problems")} == set(
            migrations.Base.metadata.tables["problems"].c.keys()
        )
        (unique,) = insp.get_unique_constraints("problems")
        assert unique["column_names"][-2:] == ["api", "tokens_bucket"]
    finally:
        engine.dispose()


def test_failed_v5_upgrade_rolls_back(tmp_path, monkeypatch):
    path = tmp_path / "v4.db"
    make_v4(path)

    def half_done(op):
        migrations._v4_to_v5(op)
        raise RuntimeError("power cut")

    monkeypatch.setitem(migrations.MIGRATIONS, 4, half_done)
    with pytest.raises(RuntimeError, match="power cut"):
        open_store(path)
    assert version_of(path) == "4" and "tokens_bucket" not in columns(path, "problems")
    monkeypatch.undo()
    with open_store(path) as s:
        assert s.count_trials() == 3


def test_postgres_v4_is_upgraded(pg_url):
    with open_store(pg_url) as s:
        record(s, 1.0)
    engine = create_engine(pg_url)
    try:
        with engine.begin() as conn:  # turn it into a version-4 database
            conn.exec_driver_sql("ALTER TABLE problems DROP CONSTRAINT uq_problems_key")
            conn.exec_driver_sql("ALTER TABLE problems DROP COLUMN tokens_bucket")
            conn.exec_driver_sql(
                "ALTER TABLE problems ADD CONSTRAINT uq_problems_key UNIQUE (dtype, head_dim_qk, head_dim_v, "
                "causal, gqa_group, seqlen_bucket, bh_bucket, api)"
            )
            conn.exec_driver_sql("UPDATE zyfa_meta SET value = '4' WHERE key = 'schema_version'")
        with open_store(pg_url, readonly=True) as s:
            assert [b.key.packed for b in s.best_entries()] == [False]
        with open_store(pg_url) as s:
            record(s, 0.5, k=packed_key())
            assert len(s.best_entries()) == 2
        assert "tokens_bucket" in {c["name"] for c in inspect(engine).get_columns("problems")}
    finally:
        engine.dispose()
