"""Store: recording trials and keeping the best, on SQLite and PostgreSQL; opening and paths."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
from test_db_support import H100, H200, config, fake_hash, fingerprint, key, record, sha256

from zyfa_tune.db import DatabaseError, TrialResult, default_db_path, open_store
from zyfa_tune.generator import KernelConfig

pytest_plugins = ["test_db_support"]  # fixtures: target (sqlite + postgres), pg_url


def test_faster_replaces_slower_and_failed_do_not(target):
    with open_store(target) as s:
        record(
            s,
            1.0,
            cfg=config(num_stages=2),
            tflops=400.0,
            error_rel_l2=0.02,
            batch=2,
            heads=32,
            seqlen=8000,
            sm_clock_mhz=1980.0,
        )
        assert [e.median_ms for e in s.best_entries()] == [1.0]
        record(s, 2.0, cfg=config(num_stages=3))  # slower: not best
        record(s, 0.1, status="wrong", cfg=config(num_stages=4), error_rel_l2=0.9)  # fast but wrong
        record(s, None, status="compile_error", cfg=config(num_stages=5), message="ptxas error\nline 2")
        record(s, None, status="timeout", cfg=config(block_n=64))
        record(s, 0.3, status="crash", cfg=config(block_m=64))
        (best,) = s.best_entries()
        assert best.median_ms == 1.0 and best.tflops == 400.0 and best.error_rel_l2 == 0.02
        assert KernelConfig.from_json(best.config_json) == config(num_stages=2)
        assert (best.batch, best.heads, best.seqlen, best.sm_clock_mhz) == (2, 32, 8000, 1980.0)
        assert best.fingerprint == fingerprint() and best.key == key() and best.backend == "triton"
        assert best.source_hash == fake_hash(config(num_stages=2))
        assert best.provenance.startswith("study=test host=")
        assert best.updated_at.tzinfo is not None
        assert abs(best.updated_at - dt.datetime.now(dt.timezone.utc)) < dt.timedelta(minutes=5)

        record(s, 0.5, cfg=config(num_stages=1))  # faster and ok: replaces
        (best,) = s.best_entries()
        assert best.median_ms == 0.5 and KernelConfig.from_json(best.config_json) == config(num_stages=1)
        assert best.tflops is None and best.batch is None and best.sm_clock_mhz is None  # the new trial's, not a mix

        assert s.count_trials() == 7
        assert {st: s.count_trials(status=st) for st in ("ok", "wrong", "compile_error", "timeout", "crash")} == {
            "ok": 3,
            "wrong": 1,
            "compile_error": 1,
            "timeout": 1,
            "crash": 1,
        }
        (failed,) = s.trials(status="compile_error")
        assert failed["message"] == "ptxas error line 2" and failed["median_ms"] is None  # one line
        assert failed["causal"] is True and failed["dtype"] == "fp8" and failed["study"] == "test"
        newest = s.trials(limit=2)
        assert [t["median_ms"] for t in newest] == [0.5, 0.3]
        assert newest[0]["created_at"].tzinfo is not None


def test_equal_time_keeps_the_first(target):
    with open_store(target) as s:
        record(s, 1.0, cfg=config(num_stages=2))
        s.record_trial(
            fingerprint(),
            key(),
            config(num_stages=3),
            TrialResult("ok", median_ms=1.0),
            source_hash=fake_hash(config(num_stages=3)),
            provenance="second",
        )
        (best,) = s.best_entries()
        assert KernelConfig.from_json(best.config_json) == config(num_stages=2)
        assert best.provenance != "second"


def test_best_per_fingerprint_and_problem_and_filters(target):
    with open_store(target) as s:
        record(s, 1.0, fp=fingerprint(H200))
        record(s, 0.8, fp=fingerprint(H200, driver="999.9"))  # another driver: its own environment
        record(s, 2.0, fp=fingerprint(H100))
        record(s, 3.0, k=key(d=64), cfg=config(64))
        record(s, 4.0, k=key(dtype="bf16"), cfg=config(dtype="bf16"))
        record(s, 50.0, k=key(seqlen=100_000))  # (a realistic time: impossible ones are refused)
        assert len(s.best_entries()) == 6
        assert [e.median_ms for e in s.best_for(key())] == [0.8, 1.0, 2.0]  # fastest first
        assert {e.fingerprint.gpu_name for e in s.best_for(key())} == {H200, H100}
        assert sorted(e.median_ms for e in s.best_entries(gpu_name=H100)) == [2.0]
        assert sorted(e.median_ms for e in s.best_entries(head_dims=(64, 64))) == [3.0]
        assert sorted(e.median_ms for e in s.best_entries(dtype="bf16")) == [4.0]
        assert sorted(e.median_ms for e in s.best_entries(gpu_name=H200, dtype="fp8", head_dims=(128, 128))) == [
            0.8,
            1.0,
            50.0,
        ]
        assert s.best_for(key(seqlen=300)) == []
        assert s.count_trials(key=key(d=64)) == 1 and len(s.trials(key=key())) == 3


def test_invalid_trials_are_refused_and_nothing_is_written(target):
    with open_store(target) as s:
        with pytest.raises(ValueError, match="status"):
            record(s, 1.0, status="fastest")
        with pytest.raises(ValueError, match="problem is fp8 128/128"):  # config of other head dims
            s.record_trial(
                fingerprint(), key(), config(64), TrialResult("ok", median_ms=1.0), source_hash=fake_hash(config(64))
            )
        with pytest.raises(ValueError, match="source_hash"):
            s.record_trial(fingerprint(), key(), config(), TrialResult("ok", median_ms=1.0), source_hash="x'; --")
        with pytest.raises(TypeError, match="config"):
            s.record_trial(
                fingerprint(), key(), config().to_dict(), TrialResult("ok", median_ms=1.0), source_hash="abcdef12"
            )
        with pytest.raises(ValueError, match="provenance"):
            s.record_trial(
                fingerprint(),
                key(),
                config(),
                TrialResult("ok", median_ms=1.0),
                source_hash="abcdef12",
                provenance=b"bytes",
            )
        with pytest.raises(ValueError, match="median_ms"):  # faster than any Hopper GPU can be
            record(s, 1e-6)
        assert s.count_trials() == 0 and s.best_entries() == []


def test_one_variant_per_source_hash(target):
    """Configs that emit the same source share a variant; a hash reused for other head dims is refused."""
    a, b = config(lean_fold="fma"), config(lean_fold="sub_fma")  # lean fields unused with softmax=exact
    with open_store(target) as s:
        s.record_trial(fingerprint(), key(), a, TrialResult("ok", median_ms=2.0), source_hash="abcdef0123456789")
        s.record_trial(fingerprint(), key(), b, TrialResult("ok", median_ms=1.0), source_hash="abcdef0123456789")
        (best,) = s.best_entries()
        assert best.median_ms == 1.0 and KernelConfig.from_json(best.config_json) == a  # first config kept
        with pytest.raises(ValueError, match="another kernel"):
            s.record_trial(
                fingerprint(), key(d=64), config(64), TrialResult("ok", median_ms=1.0), source_hash="abcdef0123456789"
            )
        assert s.count_trials() == 2


def test_message_is_clipped_to_its_tail(target):
    with open_store(target) as s:
        record(s, None, status="compile_error", message="x" * 100_000 + "THE ERROR")
        (t,) = s.trials()
        assert t["message"].endswith("THE ERROR") and len(t["message"]) < 20_000


def test_readonly_never_writes(tmp_path):
    path = tmp_path / "t.db"
    with open_store(path) as s:
        record(s, 1.0)
    before = sha256(path)
    with open_store(path, readonly=True) as s:
        assert len(s.best_entries()) == 1 and s.count_trials() == 1 and s.trials()
        with pytest.raises(DatabaseError, match="readonly"):
            record(s, 0.5)
        with pytest.raises(DatabaseError, match="readonly"):
            s.import_from(path)
        assert s.export(tmp_path / "copy.db") == 1  # exporting only reads
    assert sha256(path) == before  # (SQLite may leave empty -wal/-shm side files: never the data)


def test_readonly_postgres_refuses_writes(pg_url):
    with open_store(pg_url) as s:
        record(s, 1.0)
    with open_store(pg_url, readonly=True) as s:
        assert s.count_trials() == 1
        with pytest.raises(DatabaseError):
            record(s, 0.5)
    with open_store(pg_url, readonly=True) as s:
        assert s.count_trials() == 1


def test_postgres_url_password_is_masked(pg_url):
    from sqlalchemy import make_url

    password = make_url(pg_url).password
    with open_store(pg_url) as s:
        assert password and password not in s.url and "***" in s.url and password not in repr(s)
    bad = pg_url.rsplit("/", 1)[0] + "/no_such_database_here"
    with pytest.raises(DatabaseError) as err:
        open_store(bad)
    assert password not in str(err.value) and "no_such_database_here" in str(err.value)


def test_closed_store_refuses_use(tmp_path):
    s = open_store(tmp_path / "t.db")
    s.close()
    s.close()  # idempotent
    with pytest.raises(DatabaseError, match="closed"):
        s.best_entries()
    with pytest.raises(DatabaseError, match="closed"):
        record(s, 1.0)


def test_missing_and_empty_files(tmp_path):
    missing = tmp_path / "missing.db"
    for kw in ({"create": False}, {"readonly": True}):
        with pytest.raises(DatabaseError, match="missing.db"):
            open_store(missing, **kw)
        assert not missing.exists()
    with pytest.raises(DatabaseError):  # explicit paths do not get their folders created
        open_store(tmp_path / "no" / "such" / "dir.db")
    empty = tmp_path / "empty.db"
    empty.touch()
    with open_store(empty) as s:
        record(s, 1.0)
    with open_store(f"sqlite:///{empty}", readonly=True) as s:  # a URL string reaches the same file
        assert s.count_trials() == 1 and s.url == f"sqlite:///{empty}"
    with pytest.raises(DatabaseError, match="not a regular file"):
        open_store(tmp_path)


def test_default_db_path(tmp_path, monkeypatch):
    monkeypatch.setenv("ZYFA_TUNE_DB", str(tmp_path / "explicit.db"))
    assert default_db_path() == tmp_path / "explicit.db"
    monkeypatch.delenv("ZYFA_TUNE_DB")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_db_path() == tmp_path / "xdg" / "zyfa_tune" / "tuning.db"
    with open_store() as s:  # the default file's folder is created
        record(s, 1.0)
        assert s.url == f"sqlite:///{tmp_path / 'xdg' / 'zyfa_tune' / 'tuning.db'}"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_db_path() == Path(tmp_path / "home" / ".cache" / "zyfa_tune" / "tuning.db")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")  # XDG: relative paths are invalid
    assert default_db_path() == Path(tmp_path / "home" / ".cache" / "zyfa_tune" / "tuning.db")


def test_sqlite_connection_settings(tmp_path):
    import sqlite3

    path = tmp_path / "t.db"
    with open_store(path) as s:
        record(s, 1.0)
        with s._engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
            assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 30_000
    con = sqlite3.connect(path)
    try:
        with pytest.raises(sqlite3.IntegrityError):  # the CHECK constraint guards statuses too
            con.execute("UPDATE trials SET status = 'great'")
    finally:
        con.close()


def test_unknown_url_scheme_is_a_database_error():
    with pytest.raises(DatabaseError) as err:
        open_store("nosuchdialect://user:secret@localhost/db")
    assert "secret" not in str(err.value) and "nosuchdialect" in str(err.value)


def test_a_damaged_clock_loses_only_the_clock(tmp_path):
    import sqlite3

    path = tmp_path / "mine.db"
    with open_store(path) as s:
        record(s, 1.0, sm_clock_mhz=1980.0)
    con = sqlite3.connect(path)
    with con:  # damage the winning trial's clock behind the store's back
        con.execute("UPDATE trials SET sm_clock_mhz = 'fast'")
    con.close()
    with open_store(path, readonly=True) as s:
        (best,) = s.best_entries()
        assert best.median_ms == 1.0 and best.sm_clock_mhz is None
