"""Schema versions: a hand-built version-1 file is upgraded in place (after a backup), data intact;
a newer version is refused untouched; a read-only open never migrates; a failed upgrade rolls back."""

from __future__ import annotations

import sqlite3

import pytest
from sqlalchemy import create_engine, inspect
from test_db_support import config, fake_hash, fingerprint, key, record, sha256

from zyfa_tune.db import SCHEMA_VERSION, DatabaseCorruptError, DatabaseError, TrialResult, migrations, open_store

pytest_plugins = ["test_db_support"]  # fixtures: target (sqlite + postgres), pg_url

#: Version 1 of the schema, written out by hand: trials has no energy_j / tflop_per_j yet.
V1_SCHEMA = """
CREATE TABLE zyfa_meta ("key" VARCHAR(64) NOT NULL PRIMARY KEY, value VARCHAR(256) NOT NULL);
CREATE TABLE environments (
    id INTEGER NOT NULL PRIMARY KEY, digest VARCHAR(16) NOT NULL UNIQUE, gpu_name VARCHAR(128) NOT NULL,
    compute_capability VARCHAR(8) NOT NULL, sm_count INTEGER NOT NULL, memory_bytes BIGINT NOT NULL,
    driver VARCHAR(64) NOT NULL, cuda VARCHAR(64) NOT NULL, torch VARCHAR(64) NOT NULL,
    triton VARCHAR(64) NOT NULL, generator_version VARCHAR(64) NOT NULL);
CREATE INDEX ix_environments_gpu_name ON environments (gpu_name);
CREATE TABLE problems (
    id INTEGER NOT NULL PRIMARY KEY, dtype VARCHAR(8) NOT NULL, head_dim_qk INTEGER NOT NULL,
    head_dim_v INTEGER NOT NULL, causal BOOLEAN NOT NULL, gqa_group INTEGER NOT NULL,
    seqlen_bucket INTEGER NOT NULL, bh_bucket INTEGER NOT NULL,
    CONSTRAINT uq_problems_key UNIQUE (dtype, head_dim_qk, head_dim_v, causal, gqa_group, seqlen_bucket, bh_bucket));
CREATE TABLE variants (
    id INTEGER NOT NULL PRIMARY KEY, backend VARCHAR(32) NOT NULL, config_json TEXT NOT NULL,
    source_hash VARCHAR(64) NOT NULL, generator_version VARCHAR(64) NOT NULL,
    CONSTRAINT uq_variants_source UNIQUE (backend, source_hash));
CREATE TABLE trials (
    id INTEGER NOT NULL PRIMARY KEY,
    environment_id INTEGER NOT NULL REFERENCES environments (id),
    problem_id INTEGER NOT NULL REFERENCES problems (id),
    variant_id INTEGER NOT NULL REFERENCES variants (id),
    status VARCHAR(16) NOT NULL, median_ms FLOAT, p20_ms FLOAT, p80_ms FLOAT, tflops FLOAT,
    error_rel_l2 FLOAT, error_max FLOAT, sm_clock_mhz FLOAT, power_w FLOAT, message TEXT NOT NULL,
    batch INTEGER, heads INTEGER, seqlen INTEGER, study VARCHAR(256), provenance TEXT NOT NULL,
    created_at DATETIME NOT NULL,
    CONSTRAINT ck_trials_status CHECK (status IN ('ok', 'compile_error', 'wrong', 'timeout', 'crash')));
CREATE INDEX ix_trials_env_problem_variant ON trials (environment_id, problem_id, variant_id);
CREATE INDEX ix_trials_problem_status ON trials (problem_id, status);
CREATE INDEX ix_trials_status ON trials (status);
CREATE TABLE best (
    environment_id INTEGER NOT NULL REFERENCES environments (id),
    problem_id INTEGER NOT NULL REFERENCES problems (id),
    variant_id INTEGER NOT NULL REFERENCES variants (id),
    trial_id INTEGER NOT NULL REFERENCES trials (id),
    median_ms FLOAT NOT NULL, tflops FLOAT, error_rel_l2 FLOAT, provenance TEXT NOT NULL,
    updated_at DATETIME NOT NULL, PRIMARY KEY (environment_id, problem_id));
CREATE INDEX ix_best_problem_id ON best (problem_id);
INSERT INTO zyfa_meta ("key", value) VALUES ('schema_version', '1');
"""


def make_v1(path) -> None:
    fp, k, cfg = fingerprint(), key(), config(num_stages=2)
    con = sqlite3.connect(path)
    with con:
        con.executescript(V1_SCHEMA)
        con.execute(
            "INSERT INTO environments VALUES (1, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (fp.digest(), *[v for n, v in fp.to_dict().items() if n != "runner"]),
        )
        con.execute(
            "INSERT INTO problems VALUES (1, ?, ?, ?, ?, ?, ?, ?)",
            tuple(v for n, v in k.to_dict().items() if n not in ("api", "tokens_bucket")),
        )
        con.execute(
            "INSERT INTO variants VALUES (1, 'triton', ?, ?, ?)", (cfg.to_json(), fake_hash(cfg), fp.generator_version)
        )
        trial = (
            "INSERT INTO trials (environment_id, problem_id, variant_id, status, median_ms, tflops, power_w, "
            "message, batch, heads, seqlen, study, provenance, created_at) "
            "VALUES (1, 1, 1, ?, ?, 420.5, 650.0, ?, 2, 32, 8192, 'v1-study', 'study=v1 host=old', ?)"
        )
        con.execute(trial, ("ok", 1.25, "", "2026-11-01 10:00:00.000000"))
        con.execute(trial, ("wrong", 0.5, "rel. L2 too large", "2026-11-01 10:01:00.000000"))
        con.execute(trial, ("compile_error", None, "ptxas: out of registers", "2026-11-01 10:02:00.000000"))
        con.execute(
            "INSERT INTO best VALUES (1, 1, 1, 1, 1.25, 420.5, NULL, 'study=v1 host=old', '2026-11-01 10:00:00.000000')"
        )
    con.close()


def columns(path, table: str = "trials") -> set[str]:
    con = sqlite3.connect(path)
    try:
        return {r[1] for r in con.execute(f"PRAGMA table_info({table})")}
    finally:
        con.close()


def dump(path) -> list[str]:
    con = sqlite3.connect(path)
    try:
        return list(con.iterdump())
    finally:
        con.close()


def version_of(path) -> str:
    con = sqlite3.connect(path)
    try:
        return con.execute("SELECT value FROM zyfa_meta WHERE key = 'schema_version'").fetchone()[0]
    finally:
        con.close()


def test_v1_file_is_upgraded_in_place_with_a_backup(tmp_path):
    path = tmp_path / "old.db"
    make_v1(path)
    v1_dump = dump(path)
    assert "energy_j" not in columns(path)
    with open_store(path) as s:
        assert s.count_trials() == 3 and s.count_trials(status="ok") == 1
        (best,) = s.best_entries()
        assert (best.median_ms, best.tflops, best.provenance) == (1.25, 420.5, "study=v1 host=old")
        assert (best.batch, best.heads, best.seqlen) == (2, 32, 8192)
        assert best.updated_at.isoformat() == "2026-11-01T10:00:00+00:00"
        (failed,) = s.trials(status="compile_error")
        assert failed["message"] == "ptxas: out of registers" and failed["energy_j"] is None
        # version-2 columns work
        s.record_trial(
            fingerprint(),
            key(),
            config(num_stages=3),
            TrialResult("ok", median_ms=1.0, energy_j=0.02, tflop_per_j=1.5),
            source_hash=fake_hash(config(num_stages=3)),
        )
        assert s.trials(limit=1)[0]["tflop_per_j"] == 1.5 and s.best_entries()[0].median_ms == 1.0
    assert version_of(path) == str(SCHEMA_VERSION) == "5"
    assert {"energy_j", "tflop_per_j"} <= columns(path) and "runner" in columns(path, "environments")
    # the model and the upgraded file agree on every table's columns
    engine = create_engine(f"sqlite:///{path}")
    try:
        insp = inspect(engine)
        for table in migrations.Base.metadata.sorted_tables:
            assert {c["name"] for c in insp.get_columns(table.name)} == set(table.columns.keys()), table.name
    finally:
        engine.dispose()
    backup = tmp_path / "old.db.v1.bak"
    assert backup.exists() and dump(backup) == v1_dump  # same schema and rows as before the upgrade
    assert version_of(backup) == "1" and "energy_j" not in columns(backup)
    with open_store(path) as s:  # already current: no second backup
        assert s.count_trials() == 4
    assert sorted(p.name for p in tmp_path.iterdir() if ".bak" in p.name) == ["old.db.v1.bak"]


def test_readonly_open_of_v1_refuses_and_does_not_touch_it(tmp_path):
    path = tmp_path / "old.db"
    make_v1(path)
    before = sha256(path)
    with pytest.raises(DatabaseError, match="writable"):
        open_store(path, readonly=True)
    assert sha256(path) == before and version_of(path) == "1"
    assert not list(tmp_path.glob("*.bak"))


def test_failed_upgrade_rolls_back(tmp_path, monkeypatch):
    path = tmp_path / "old.db"
    make_v1(path)

    def half_done(op):
        op.add_column("trials", migrations.Column("energy_j", migrations.Float(precision=53), nullable=True))
        raise RuntimeError("power cut")

    monkeypatch.setitem(migrations.MIGRATIONS, 1, half_done)
    with pytest.raises(RuntimeError, match="power cut"):
        open_store(path)
    assert version_of(path) == "1" and "energy_j" not in columns(path)
    monkeypatch.undo()
    with open_store(path) as s:
        assert s.count_trials() == 3


def test_postgres_v1_is_upgraded(pg_url):
    with open_store(pg_url) as s:
        record(s, 1.0)
    engine = create_engine(pg_url)
    try:
        with engine.begin() as conn:  # turn it into a version-1 database
            conn.exec_driver_sql("ALTER TABLE trials DROP COLUMN energy_j, DROP COLUMN tflop_per_j")
            conn.exec_driver_sql("ALTER TABLE environments DROP COLUMN runner")
            conn.exec_driver_sql("UPDATE zyfa_meta SET value = '1' WHERE key = 'schema_version'")
        with pytest.raises(DatabaseError, match="writable"):
            open_store(pg_url, readonly=True)
        with open_store(pg_url) as s:
            assert s.count_trials() == 1 and s.best_entries()[0].median_ms == 1.0
            record(s, 0.5, energy_j=1.0)
        assert {"energy_j", "tflop_per_j"} <= {c["name"] for c in inspect(engine).get_columns("trials")}
        assert "runner" in {c["name"] for c in inspect(engine).get_columns("environments")}
    finally:
        engine.dispose()


def test_newer_version_is_refused_untouched(target):
    with open_store(target) as s:
        record(s, 1.0)
    if "://" in target:
        engine = create_engine(target)
        with engine.begin() as conn:
            conn.exec_driver_sql(f"UPDATE zyfa_meta SET value = '{SCHEMA_VERSION + 1}' WHERE key = 'schema_version'")
        engine.dispose()
        before = None
    else:
        con = sqlite3.connect(target)
        with con:
            con.execute(f"UPDATE zyfa_meta SET value = '{SCHEMA_VERSION + 1}' WHERE key = 'schema_version'")
            con.execute("PRAGMA journal_mode = DELETE")
        con.close()
        before = sha256(target)
    for readonly in (False, True):
        with pytest.raises(DatabaseError, match="newer") as err:
            open_store(target, readonly=readonly)
        assert not isinstance(err.value, DatabaseCorruptError)
    if before is not None:
        assert sha256(target) == before
