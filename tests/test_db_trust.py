"""What a database row must be to be trusted, checked the same way wherever rows enter or leave: a
best entry whose trial failed, an impossible timing, a simulated (no GPU) measurement, and text
with control characters or markup."""

from __future__ import annotations

import sqlite3
import warnings

import pytest
from test_db_support import H100, config, fake_hash, fingerprint, key, record

from zyfa_tune.db import SCHEMA_VERSION, DatabaseError, Fingerprint, TrialResult, open_store
from zyfa_tune.db.checks import clean_text
from zyfa_tune.db.validity import MAX_TFLOPS, min_plausible_ms
from zyfa_tune.kernels import dispatch

H200_DEVICE = fingerprint().device_key()


def tamper(path, *statements) -> None:
    """Edit a database behind the store's back (as a damaged or hand-edited file would be)."""
    con = sqlite3.connect(path)
    with con:
        for sql in statements:
            con.execute(sql)
    con.close()


def served(path) -> str:
    """Where the dispatcher's choice for key() on an H200 came from."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return dispatch.Dispatcher([str(path)]).choose(key(), H200_DEVICE).source


def everywhere_rejected(path, tmp_path, reason: str) -> None:
    """The row is refused by the dispatcher, by best_entries (show/best) and by import, alike."""
    assert served(path) == "default"
    with open_store(path, readonly=True) as s, pytest.warns(RuntimeWarning, match=reason):
        assert s.best_entries() == []
    with open_store(tmp_path / "into.db") as s:
        report = s.import_from(path)
        assert s.best_entries() == []
    assert any(reason in why for _, why in report.rejected), report.rejected
    assert any(d.startswith("best row") for d, _ in report.rejected), report.rejected


# ---- a best entry whose trial failed -----------------------------------------------------------


@pytest.mark.parametrize("status", ["crash", "wrong", "timeout"])
def test_a_best_row_whose_trial_failed_is_never_served(tmp_path, status):
    path = tmp_path / "t.db"
    with open_store(path) as s:
        record(s, 1.0)
    assert served(path) == "exact"
    tamper(path, f"UPDATE trials SET status = '{status}'")
    everywhere_rejected(path, tmp_path, "not 'ok'")


def test_a_best_row_with_another_time_than_its_trial_is_never_served(tmp_path):
    path = tmp_path / "t.db"
    with open_store(path) as s:
        record(s, 1.0)
    tamper(path, "UPDATE best SET median_ms = 0.5")
    everywhere_rejected(path, tmp_path, "median_ms")


# ---- impossible timings ------------------------------------------------------------------------


def test_the_timing_bound_admits_real_hopper_measurements():
    # the shipped H200 database: every entry is a real measurement and must pass
    shipped = dispatch.TUNED_DIR / "h200.db"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with open_store(shipped, readonly=True) as s:
            entries = s.best_entries()
    assert len(entries) > 10
    for e in entries:
        assert min_plausible_ms(e.key) < e.median_ms / 5, (e.key, e.median_ms)
    # FA3-class speed on the largest class (about 1 PFLOP/s) is well within the bound
    big = key(seqlen=131072, batch=1, heads=8, kv_heads=8)
    assert min_plausible_ms(big) < 2 * 131072**2 * 256 * 8 / 2 / 1e15 * 1e3 / 2
    assert MAX_TFLOPS >= 2 * 1979


@pytest.mark.parametrize("ms", [1e-300, 1e-9])
def test_an_impossible_time_is_refused_when_recorded(tmp_path, ms):
    with open_store(tmp_path / "t.db") as s:
        with pytest.raises(ValueError, match="median_ms.*TFLOP/s"):
            record(s, ms)
        with pytest.raises(ValueError, match="tflops"):
            record(s, 1.0, tflops=1e6)
        assert s.count_trials() == 0


def test_an_impossible_time_in_a_file_is_refused_everywhere(tmp_path):
    path = tmp_path / "t.db"
    with open_store(path) as s:
        record(s, 1.0)
    tamper(path, "UPDATE trials SET median_ms = 1e-300", "UPDATE best SET median_ms = 1e-300")
    everywhere_rejected(path, tmp_path, "TFLOP/s")


# ---- simulated measurements --------------------------------------------------------------------


def replay_fp() -> Fingerprint:
    return Fingerprint(
        gpu_name="replay (no GPU)",
        compute_capability="9.0",
        sm_count=132,
        memory_bytes=1,
        driver="none",
        cuda="none",
        torch="none",
        triton="none",
        generator_version=fingerprint().generator_version,
    )


def test_a_simulated_fingerprint_is_marked_and_cannot_pose_as_a_gpu():
    assert replay_fp().runner == "replay" and replay_fp().simulated
    assert not fingerprint().simulated and fingerprint().runner == "gpu"
    with pytest.raises(ValueError, match="runner"):
        Fingerprint(**dict(fingerprint().to_dict(), runner="replay"))  # names a real GPU
    # the mark does not change the digest of real environments (they are found by it)
    assert fingerprint().digest() == Fingerprint(**fingerprint().to_dict()).digest()


def test_simulated_results_are_never_served_to_a_gpu(tmp_path):
    path = tmp_path / "t.db"
    with open_store(path) as s:
        record(s, 0.5, fp=replay_fp())
        record(s, 0.9, fp=fingerprint(H100), k=key(seqlen=4096))
        (sim,) = [e for e in s.best_entries() if e.fingerprint.simulated]
        assert sim.fingerprint.runner == "replay"
    d = dispatch.Dispatcher([str(path)])
    with pytest.warns(RuntimeWarning, match="tuned on NVIDIA H100"):
        choice = d.choose(key(), H200_DEVICE)  # same architecture: never the replay entry
    assert choice.tuned_on == H100
    # the simulated device itself (CPU pipelines) gets its own entries back
    assert d.choose(key(), replay_fp().device_key()).source == "exact"


def test_simulated_rows_stay_out_of_the_default_database(tmp_path, monkeypatch):
    monkeypatch.setenv("ZYFA_TUNE_DB", str(tmp_path / "default.db"))
    with open_store() as s:
        with pytest.raises(DatabaseError, match="allow_simulated"):
            record(s, 0.5, fp=replay_fp())
        record(s, 0.5)  # a GPU's results are welcome
        assert s.count_trials() == 1
    other = tmp_path / "sim.db"
    with open_store(other) as s:  # any other database takes them
        record(s, 0.5, fp=replay_fp(), k=key(seqlen=4096))
    with open_store(tmp_path / "default.db") as s:
        report = s.import_from(other)
        assert report.rejected and all("simulated" in why for _, why in report.rejected)
        assert s.count_trials() == 1
    with open_store(allow_simulated=True) as s:
        record(s, 0.5, fp=replay_fp())
        assert s.count_trials() == 2


def test_legacy_simulated_rows_are_marked_by_the_upgrade(tmp_path):
    """A version-2 file whose replay results carry no mark: read as is, it is already recognised;
    upgraded, its environments row records the runner."""
    from test_db_migration import columns, version_of

    path = tmp_path / "v2.db"
    with open_store(path) as s:
        record(s, 0.5, fp=replay_fp())
    tamper(
        path,
        "ALTER TABLE environments DROP COLUMN runner",
        "UPDATE zyfa_meta SET value = '2' WHERE key = 'schema_version'",
    )
    assert "runner" not in columns(path, "environments")
    with open_store(path, readonly=True) as s:  # version 2 still opens read-only (shipped files)
        assert [e.fingerprint.runner for e in s.best_entries()] == ["replay"]
    assert served(path) == "default"
    with open_store(path) as s:
        assert s.best_entries()[0].fingerprint.simulated
    con = sqlite3.connect(path)
    assert con.execute("SELECT runner FROM environments").fetchall() == [("replay",)]
    con.close()
    assert version_of(path) == str(SCHEMA_VERSION)


# ---- text --------------------------------------------------------------------------------------


def test_clean_text_strips_ansi_and_control_characters():
    assert clean_text("\x1b[31mred\x1b[0m\x1b]0;title\x07ok") == "redok"
    assert clean_text("a\x00b\nc\td\x85e\x9b31mf\u2028g") == "a b c d ef g"
    assert clean_text("[bold red]x[/]") == "[bold red]x[/]"  # markup is the display's business


def test_control_characters_are_stripped_when_written(tmp_path):
    with open_store(tmp_path / "t.db") as s:
        s.record_trial(
            fingerprint(),
            key(),
            config(),
            TrialResult("crash", message="boom\x1b[2J\x07\nline 2"),
            source_hash=fake_hash(config()),
            provenance="by \x1b[31mme\x1b[0m",
        )
        (t,) = s.trials()
    assert t["message"] == "boom  line 2" and t["provenance"] == "by me"
