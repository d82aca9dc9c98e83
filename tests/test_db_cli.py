"""The database commands (`show`, `best`, `export`, `import` / `merge`) as a user meets them: the
shipped database when there is none yet, one-line errors, counts that match what was done, stored
text printed literally, and `--version` / `--help`."""

from __future__ import annotations

import argparse
import sqlite3
import sys

import pytest
from test_db_support import H100, config, fingerprint, key, record

from zyfa_tune import cli
from zyfa_tune.cli import common
from zyfa_tune.db import TrialResult, open_store


@pytest.fixture(autouse=True)
def wide_console(monkeypatch, tmp_path):
    """A wide console (table cells unfolded) and a default database path that does not exist."""
    monkeypatch.setattr(common.console, "_width", 400)
    monkeypatch.setenv("ZYFA_TUNE_DB", str(tmp_path / "cache" / "tuning.db"))


@pytest.fixture
def no_postgres_driver(monkeypatch):
    """As on a machine without the postgres extra: importing a PostgreSQL driver fails."""
    from zyfa_tune.db.session import POSTGRES_DRIVERS

    for name in POSTGRES_DRIVERS:
        monkeypatch.setitem(sys.modules, name, None)


def run(capsys, *argv: str) -> tuple[int, str]:
    rc = cli.main(list(argv))
    out = capsys.readouterr()
    return rc, out.out + out.err


@pytest.mark.parametrize("command", ["show", "best"])
def test_without_a_database_the_shipped_one_is_shown(capsys, tmp_path, command):
    rc, out = run(capsys, command)
    assert rc == 0
    assert "h200.db" in out and "shipped" in out and "NVIDIA H200" in out
    assert not (tmp_path / "cache").exists()  # nothing created at the default path


@pytest.mark.parametrize(
    "url, words",
    [
        ("nosuchdialect://user:secret@host/db", ["nosuchdialect"]),
        ("postgresql://user:secret@localhost/db", ['pip install "zyfa-tune[postgres]"']),
        ("://", ["URL"]),
    ],
)
def test_a_bad_storage_url_is_one_line(capsys, url, words, no_postgres_driver):
    rc, out = run(capsys, "show", "--storage", url)
    assert rc == 2
    lines = out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), out
    assert "Traceback" not in out and "secret" not in out
    for w in words:
        assert w in out


def test_a_bad_study_storage_url_is_one_line(capsys, tmp_path, no_postgres_driver):
    rc, out = run(
        capsys,
        "tune",
        "--head-dim",
        "128",
        "--seqlens",
        "4096",
        "--trials",
        "1",
        "--runner",
        "simulate",
        "--storage",
        str(tmp_path / "t.db"),
        "--study-storage",
        "postgresql://u:secret@localhost/x",
    )
    errors = [line[line.index("error:") :] for line in out.splitlines() if "error:" in line]  # (after the
    assert rc == 2 and len(errors) == 1 and "Traceback" not in out, out  # live display)
    assert 'pip install "zyfa-tune[postgres]"' in errors[0] and "secret" not in out


def test_counts_agree_with_what_was_done(capsys, tmp_path):
    """import/merge print how many trials were added or already there, and how many best entries
    were new, replaced or kept; export how many entries and trials it wrote."""
    ours, theirs = tmp_path / "ours.db", tmp_path / "theirs.db"
    with open_store(ours) as s:
        record(s, 1.0, cfg=config(num_stages=2))
        record(s, 1.0, k=key(d=64), cfg=config(64, num_stages=2))
    with open_store(theirs) as s:
        record(s, 0.5, cfg=config(num_stages=4))  # replaces ours
        record(s, 3.0, k=key(d=64), cfg=config(64, num_stages=4))  # ours is kept
        record(s, 2.0, k=key(seqlen=4096), cfg=config(block_n=64))  # new
        record(s, 2.0, fp=fingerprint(H100), cfg=config(num_stages=3))  # new (another GPU)
        record(s, 2.5, k=key(seqlen=16384), cfg=config(num_stages=3))  # will be damaged
    con = sqlite3.connect(theirs)
    with con:  # one damaged trial (and so its best row) is rejected
        con.execute("UPDATE trials SET median_ms = -1 WHERE median_ms = 2.5")
    con.close()
    rc, out = run(capsys, "import", str(theirs), "--storage", str(ours))
    assert rc == 1
    assert "trials: 4 added, 0 already present; best entries: 2 new, 1 replaced, 1 kept" in out
    assert "rejected 2 rows" in out
    with open_store(ours, readonly=True) as s:
        assert s.count_trials() == 2 + 4 and len(s.best_entries()) == 2 + 2

    rc, out = run(capsys, "merge", str(theirs), "--storage", str(ours))
    assert "trials: 0 added, 4 already present; best entries: 0 new, 0 replaced, 4 kept" in out

    rc, out = run(capsys, "export", str(tmp_path / "out.db"), "--storage", str(ours))
    assert rc == 0 and "exported 4 best entries (4 trials)" in out
    with open_store(tmp_path / "out.db", readonly=True) as s:
        assert len(s.best_entries()) == 4 and s.count_trials() == 4
    rc, out = run(capsys, "export", str(tmp_path / "all.db"), "--storage", str(ours), "--all-trials")
    assert rc == 0 and "exported 4 best entries (6 trials)" in out


def test_stored_text_is_printed_literally(capsys, tmp_path):
    path = tmp_path / "t.db"
    gpu = "[/]NVIDIA [bold red]H200"
    with open_store(path) as s:
        s.record_trial(
            fingerprint(gpu),
            key(),
            config(),
            TrialResult("ok", median_ms=1.0),
            source_hash="abcdef12",
            provenance="[link=http://x]click[/link] [/]",
        )
    for command in ("show", "best"):
        rc, out = run(capsys, command, "--storage", str(path))
        assert rc == 0, out
        assert gpu in out and "[link=http://x]click[/link] [/]" in out
    con = sqlite3.connect(path)
    with con:  # a GPU name written by hand: its rejection reason quotes it
        con.execute("UPDATE environments SET gpu_name = '[/]evil' || char(27) || '[2J'")
    con.close()
    rc, out = run(capsys, "import", str(path), "--storage", str(tmp_path / "into.db"))
    assert rc == 1 and "'[/]evil" in out and "\x1b" not in out


def test_version_and_defaults_in_help(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0
    from importlib.metadata import version

    assert version("zyfa-tune") in capsys.readouterr().out
    commands = next(a for a in cli.parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert {"tune", "bench", "show", "best", "export", "import", "verify"} <= set(commands)
    for command in commands:  # every command's help renders (a stray % in a help text would raise)
        with pytest.raises(SystemExit) as done:
            cli.main([command, "--help"])
        assert done.value.code == 0
        out = capsys.readouterr().out
        assert out.startswith(f"usage: zyfa-tune {command}") and "(default: " in out, (command, out)
    with pytest.raises(SystemExit):
        cli.main(["verify", "--help"])
    assert "(default: 0.1)" in capsys.readouterr().out


def test_best_names_each_entry_api_recipe_and_error_against_the_reference(capsys, tmp_path):
    import dataclasses

    from zyfa_tune.generator.recipe import Recipe

    path = tmp_path / "t.db"
    with open_store(path) as store:
        record(store, 1.0)
        record(
            store,
            1.2,
            k=dataclasses.replace(key(), api="bf16"),
            recipe=Recipe(hadamard=True, v_rounding="balanced"),
            error_rel_l2=0.021,
            error_ref=0.02,
        )
    rc, out = run(capsys, "best", "--storage", str(path))
    assert rc == 0
    rows = [line for line in out.splitlines() if "NVIDIA H200" in line]
    bf16 = next(r for r in rows if "│ bf16 " in r)
    assert "hadamard v_rounding=balanced" in bf16 and "1.050" in bf16
    assert any("│ fp8 " in r and "plain" in r for r in rows)
