"""Schema version 4: problems have an api ("fp8" / "bf16"), trials a quantisation recipe and a
reference error. Round trips through record, read, export and import; upgrades from versions 3 and
2 (and read-only reads of them as they are); crafted recipes rejected like bad configs."""

from __future__ import annotations

import dataclasses
import sqlite3
import warnings

import pytest
from alembic.migration import MigrationContext
from alembic.operations import Operations
from sqlalchemy import create_engine, inspect
from test_db_migration import columns, make_v1, version_of
from test_db_support import config, key, record

from zyfa_tune.db import SCHEMA_VERSION, ProblemKey, TrialResult, migrations, open_store
from zyfa_tune.generator import ConfigError
from zyfa_tune.generator.recipe import PLAIN, Recipe

pytest_plugins = ["test_db_support"]  # fixtures: target (sqlite + postgres), pg_url

FANCY = Recipe(hadamard=True, smooth_k=True, v_rounding="balanced", v_layout="k_major")


def bf16_key(**kw) -> ProblemKey:
    return dataclasses.replace(key(**kw), api="bf16")


def make_v3(path) -> None:
    """A version-3 file: the hand-written version 1 taken through the real upgrades to 3."""
    make_v1(path)
    engine = create_engine(f"sqlite:///{path}")
    try:
        with engine.begin() as conn:
            op = Operations(MigrationContext.configure(connection=conn))
            migrations.MIGRATIONS[1](op)
            migrations.MIGRATIONS[2](op)
            conn.exec_driver_sql("UPDATE zyfa_meta SET value = '3' WHERE key = 'schema_version'")
    finally:
        engine.dispose()


def test_problem_key_api():
    assert key().api == "fp8" and "api" not in str(key()) and str(bf16_key()).endswith("api=bf16")
    assert bf16_key() != key()
    with pytest.raises(ValueError, match="api"):
        dataclasses.replace(key(), api="fp16")
    with pytest.raises(ValueError, match="api"):
        dataclasses.replace(key(dtype="bf16"), api="bf16")  # the bf16 API runs FP8 kernels


def test_trial_result_recipe_and_error_ref_are_checked():
    r = TrialResult("ok", median_ms=1.0, recipe=FANCY, error_ref=0.02)
    assert r.recipe == FANCY.to_json() and Recipe.from_json(r.recipe) == FANCY
    assert TrialResult("ok", median_ms=1.0, recipe=FANCY.to_json()) == r.__class__("ok", median_ms=1.0, recipe=FANCY)
    assert TrialResult("ok", median_ms=1.0, recipe=PLAIN).recipe is None  # one way to store plain
    assert TrialResult("ok", median_ms=1.0, recipe=PLAIN.to_json()).recipe is None
    for bad in ('{"hadamard": "yes"}', '{"rotate": true}', "not json", "", 7):
        with pytest.raises(ValueError, match="recipe"):
            TrialResult("ok", median_ms=1.0, recipe=bad)
    with pytest.raises(ConfigError):
        TrialResult("ok", median_ms=1.0, recipe='{"v_layout": "sideways"}')
    for bad in (0.0, -1.0, float("inf"), float("nan"), "0.1"):
        with pytest.raises(ValueError, match="error_ref"):
            TrialResult("ok", median_ms=1.0, error_ref=bad)


def test_round_trip_per_api(target, tmp_path):
    with open_store(target) as s:
        record(s, 1.0, error_rel_l2=0.020)  # FP8 API, plain
        record(s, 1.2, k=bf16_key(), error_rel_l2=0.018, error_ref=0.021, recipe=FANCY)
        record(s, 1.1, k=bf16_key(), cfg=config(num_stages=3), error_rel_l2=0.030, error_ref=0.021)
        with pytest.raises(ValueError, match="recipe"):  # the FP8 API has no recipe
            record(s, 0.5, recipe=FANCY)
        best = {b.key.api: b for b in s.best_entries()}
        assert set(best) == {"fp8", "bf16"} and best["fp8"].median_ms == 1.0
        assert best["fp8"].recipe is None and best["fp8"].error_ref is None and best["fp8"].error_ratio is None
        assert best["bf16"].median_ms == 1.1 and best["bf16"].recipe is None  # fastest, plain recipe
        assert best["bf16"].error_ratio == pytest.approx(0.030 / 0.021)
        assert [b.key.api for b in s.best_entries(api="bf16")] == ["bf16"]
        assert [b.median_ms for b in s.best_for(bf16_key())] == [1.1]
        within = {b.key.api: b for b in s.fastest_within(0.02)}
        assert within["bf16"].recipe == FANCY.to_json() and within["bf16"].error_ref == 0.021
        rows = s.trials(key=bf16_key())
        assert [(t["api"], t["recipe"], t["error_ref"]) for t in rows] == [
            ("bf16", None, 0.021),
            ("bf16", FANCY.to_json(), 0.021),
        ]
        assert s.count_trials(key=key()) == 1 and s.count_trials(key=bf16_key()) == 2
        s.export(tmp_path / "out.db", best_only=False)
    with open_store(tmp_path / "copy.db") as c:
        report = c.import_from(tmp_path / "out.db")
        assert not report.rejected and report.added == 3
        assert {(t["api"], t["recipe"], t["error_ref"]) for t in c.trials()} == {
            ("fp8", None, None),
            ("bf16", None, 0.021),
            ("bf16", FANCY.to_json(), 0.021),
        }
        assert {b.key.api: b.median_ms for b in c.best_entries()} == {"fp8": 1.0, "bf16": 1.1}


def test_v3_file_reads_as_is_and_upgrades(tmp_path):
    path = tmp_path / "v3.db"
    make_v3(path)
    assert version_of(path) == "3" and "api" not in columns(path, "problems")
    with open_store(path, readonly=True) as s:  # read as it is: every problem is "fp8", no recipe
        (best,) = s.best_entries()
        assert best.key == key() and best.recipe is None and best.error_ref is None
        assert s.best_for(bf16_key()) == [] and s.best_entries(api="bf16") == []
        assert s.count_trials(key=key()) == 3 and s.count_trials(key=bf16_key()) == 0
        assert {t["api"] for t in s.trials()} == {"fp8"} and s.trials()[0]["recipe"] is None
    assert version_of(path) == "3"
    with open_store(path) as s:  # writable: upgraded, rows and ids kept
        assert s.version == SCHEMA_VERSION
        assert [b.median_ms for b in s.best_entries()] == [1.25] and s.count_trials() == 3
        record(s, 0.9, k=bf16_key(), recipe=FANCY, error_rel_l2=0.01, error_ref=0.02)  # a new problem row
        record(s, 1.0)
        assert {b.key.api: b.median_ms for b in s.best_entries()} == {"fp8": 1.0, "bf16": 0.9}
    assert version_of(path) == str(SCHEMA_VERSION) and (tmp_path / "v3.db.v3.bak").exists()
    con = sqlite3.connect(path)
    try:
        assert con.execute("PRAGMA foreign_key_check").fetchall() == []
        assert con.execute("SELECT id, api FROM problems ORDER BY id").fetchall() == [(1, "fp8"), (2, "bf16")]
    finally:
        con.close()
    engine = create_engine(f"sqlite:///{path}")
    try:  # the model and the upgraded file agree on every table's columns and on the problem key
        insp = inspect(engine)
        for table in migrations.Base.metadata.sorted_tables:
            assert {c["name"] for c in insp.get_columns(table.name)} == set(table.columns.keys()), table.name
        (unique,) = insp.get_unique_constraints("problems")
        assert unique["column_names"][-2:] == ["api", "tokens_bucket"]
    finally:
        engine.dispose()


def test_v2_file_reads_as_is_and_upgrades(tmp_path):
    path = tmp_path / "v2.db"
    make_v1(path)
    engine = create_engine(f"sqlite:///{path}")
    with engine.begin() as conn:
        migrations.MIGRATIONS[1](Operations(MigrationContext.configure(connection=conn)))
        conn.exec_driver_sql("UPDATE zyfa_meta SET value = '2' WHERE key = 'schema_version'")
    engine.dispose()
    with open_store(path, readonly=True) as s:
        assert [b.key.api for b in s.best_entries()] == ["fp8"] and s.best_for(bf16_key()) == []
    with open_store(path) as s:
        record(s, 0.9, k=bf16_key(), error_ref=0.02)
        assert len(s.best_entries()) == 2
    assert version_of(path) == str(SCHEMA_VERSION)


def test_failed_v4_upgrade_rolls_back(tmp_path, monkeypatch):
    path = tmp_path / "v3.db"
    make_v3(path)

    def half_done(op):
        migrations._v3_to_v4(op)
        raise RuntimeError("power cut")

    monkeypatch.setitem(migrations.MIGRATIONS, 3, half_done)
    with pytest.raises(RuntimeError, match="power cut"):
        open_store(path)
    assert version_of(path) == "3" and "api" not in columns(path, "problems") and "recipe" not in columns(path)
    monkeypatch.undo()
    with open_store(path) as s:
        assert s.count_trials() == 3


def test_crafted_recipes_are_rejected(tmp_path):
    path = tmp_path / "crafted.db"
    with open_store(path) as s:
        good = record(s, 1.0, k=bf16_key(), recipe=FANCY, error_ref=0.02)
        bad = record(s, 0.5, k=bf16_key(seqlen=4096), cfg=config(num_stages=3), error_ref=0.02)
        fp8 = record(s, 0.7, k=key(seqlen=16384), cfg=config(num_stages=4))
        ref = record(s, 0.8, k=bf16_key(seqlen=16384), cfg=config(num_stages=4), error_ref=0.02)
    con = sqlite3.connect(path)
    with con:
        con.execute('UPDATE trials SET recipe = \'{"hadamard": "yes; import os"}\' WHERE id = ?', (bad,))
        con.execute("UPDATE trials SET recipe = ? WHERE id = ?", (FANCY.to_json(), fp8))  # not on the FP8 API
        con.execute("UPDATE trials SET error_ref = -1.0 WHERE id = ?", (ref,))
    con.close()
    with open_store(tmp_path / "target.db") as t:
        reasons = dict(t.import_from(path).rejected)
        assert "recipe" in reasons[f"trials row id={bad}"] and "hadamard" in reasons[f"trials row id={bad}"]
        assert "only api 'bf16'" in reasons[f"trials row id={fp8}"]
        assert "error_ref" in reasons[f"trials row id={ref}"]
        assert [(b.key.seqlen_bucket, b.recipe) for b in t.best_entries()] == [(8192, FANCY.to_json())]
        assert [t["id"] for t in t.trials()] == [1] and good == 1
    with open_store(path, readonly=True) as s, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert [b.key.seqlen_bucket for b in s.best_entries()] == [8192]  # the others are skipped
        skipped = [
            str(w.message).partition("best entries: ")[2] for w in caught if "skipping a damaged row" in str(w.message)
        ]
        assert len(skipped) == 3 and sum("recipe" in m for m in skipped) == 2, skipped


def test_postgres_v3_is_upgraded(pg_url):
    with open_store(pg_url) as s:
        record(s, 1.0)
    engine = create_engine(pg_url)
    try:
        with engine.begin() as conn:  # turn it into a version-3 database
            conn.exec_driver_sql("ALTER TABLE trials DROP COLUMN recipe, DROP COLUMN error_ref")
            conn.exec_driver_sql("ALTER TABLE problems DROP CONSTRAINT uq_problems_key")
            conn.exec_driver_sql("ALTER TABLE problems DROP COLUMN api")
            conn.exec_driver_sql(
                "ALTER TABLE problems ADD CONSTRAINT uq_problems_key UNIQUE "
                "(dtype, head_dim_qk, head_dim_v, causal, gqa_group, seqlen_bucket, bh_bucket)"
            )
            conn.exec_driver_sql("UPDATE zyfa_meta SET value = '3' WHERE key = 'schema_version'")
        with open_store(pg_url, readonly=True) as s:
            assert [b.key.api for b in s.best_entries()] == ["fp8"]
        with open_store(pg_url) as s:
            record(s, 0.9, k=bf16_key(), recipe=FANCY, error_ref=0.02)
            assert {b.key.api for b in s.best_entries()} == {"fp8", "bf16"}
        assert "api" in {c["name"] for c in inspect(engine).get_columns("problems")}
    finally:
        engine.dispose()
