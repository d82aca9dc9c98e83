"""`zyfa-tune tune` and `zyfa-tune trials` on the CPU: the first hour's friction (no GPU, a --gpus that is
not there, Optuna's log lines over the live table) and why trials failed, counted and listed."""

from __future__ import annotations

import logging
from pathlib import Path

import optuna
import pytest

from zyfa_tune import cli
from zyfa_tune.cli import tune_cmd
from zyfa_tune.kernels import dispatch
from zyfa_tune.tuning import tuner as tuner_mod
from zyfa_tune.tuning.tuner import open_study_storage

SHIPPED = str(Path(dispatch.TUNED_DIR) / "h200.db")


def argv(tmp_path, *more: str) -> list[str]:
    return [
        "tune",
        "--head-dim",
        "128",
        "--seqlens",
        "4096",
        "--trials",
        "2",
        "--storage",
        str(tmp_path / "t.db"),
        "--study-storage",
        str(tmp_path / "s.journal"),
        "--timeout",
        "60",
        "--warm-start",
        "none",
        *more,
    ]


def studies(tmp_path) -> set[str]:
    path = tmp_path / "s.journal"
    if not path.exists():
        return set()
    return {s.study_name for s in optuna.get_all_study_summaries(open_study_storage(str(path)))}


def test_no_gpu_names_the_simulation_and_leaves_no_study(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(tune_cmd, "_gpu_count", lambda: 0)
    assert cli.main(argv(tmp_path)) == 2
    out = capsys.readouterr().out
    assert "no CUDA GPU" in out and "--runner simulate" in out
    assert studies(tmp_path) == set()
    assert cli.main(argv(tmp_path, "--runner", "simulate")) == 0  # no --resume needed
    assert studies(tmp_path) == {"fp8-128x128-causal"}


@pytest.mark.parametrize(
    "gpus,words",
    [
        ("0,2", "--gpus: GPU 2 not present (this machine has 2: 0, 1)"),
        ("1,1", "--gpus: '1,1' names a GPU twice"),
        ("x", "--gpus: expected comma-separated integers"),
    ],
)
def test_gpus_are_checked_against_the_gpus_present(tmp_path, capsys, monkeypatch, gpus, words):
    monkeypatch.setattr(tune_cmd, "_gpu_count", lambda: 2)
    assert cli.main(argv(tmp_path, "--gpus", gpus)) == 2
    assert words in capsys.readouterr().out.replace("\n", " ")
    assert studies(tmp_path) == set()


def test_optuna_info_lines_stay_off_the_console_while_the_table_is_live(tmp_path, monkeypatch):
    """Per-trial INFO lines ("Trial 3 finished ...", "Skipping enqueue ...") would flood the terminal and
    tear the live table; warnings still show, and the level is restored afterwards."""
    levels = []
    run = tuner_mod.Tuner.run

    def spy(self):
        levels.append(logging.getLogger("optuna").getEffectiveLevel())
        return run(self)

    monkeypatch.setattr(tuner_mod.Tuner, "run", spy)
    optuna.logging.set_verbosity(optuna.logging.INFO)
    assert cli.main(argv(tmp_path, "--runner", "simulate")) == 0
    assert cli.main(argv(tmp_path, "--runner", "replay", "--resume")) == 0  # the older name still works
    assert levels == [logging.WARNING, logging.WARNING]
    assert optuna.logging.get_verbosity() == optuna.logging.INFO


def test_failures_are_counted_at_the_end_and_listed_by_trials(tmp_path, capsys):
    rc = cli.main(argv(tmp_path, "--runner", "fault:raise@backend=gluon", "--trials", "4"))
    assert rc == 0
    out = capsys.readouterr().out
    assert "most frequent failures of this run" in out
    assert "ValueError: injected fault: raise (backend=gluon)" in out
    journal = str(tmp_path / "s.journal")
    study = optuna.load_study(study_name="fp8-128x128-causal", storage=open_study_storage(journal))
    crashed = [t.number for t in study.trials if "crash" in t.user_attrs.get("statuses", [])]
    assert crashed
    assert cli.main(["trials", "--study-storage", journal, "--status", "crash"]) == 0
    listed = capsys.readouterr().out
    assert listed.count("injected fault: raise (backend=gluon)") == len(crashed)
    assert cli.main(["trials", "--study-storage", journal, "--status", "ok"]) == 0
    assert "injected fault" not in capsys.readouterr().out
    assert cli.main(["trials", "--study-storage", journal, "--status", "crashed"]) == 2
    assert "--status: crashed is not one of" in capsys.readouterr().out
    assert cli.main(["trials", "--study-storage", journal, "--study", "other"]) == 2
    assert "--study: other is not a study" in capsys.readouterr().out
    assert cli.main(["trials", "--study-storage", str(tmp_path / "none.journal")]) == 2
    assert "--study-storage: no journal file" in capsys.readouterr().out


def test_trials_without_a_study_lists_the_one_tuned_last(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("ZYFA_TUNE_DB", str(tmp_path / "cache" / "tuning.db"))
    assert cli.main(["trials"]) == 2
    assert "no study in the default place yet" in capsys.readouterr().out
    for dims in (["--head-dim", "64"], ["--head-dim", "128"]):
        rc = cli.main(
            [
                "tune",
                *dims,
                "--seqlens",
                "4096",
                "--trials",
                "2",
                "--runner",
                "simulate",
                "--storage",
                str(tmp_path / "t.db"),
                "--warm-start",
                "none",
            ]
        )
        assert rc == 0
    capsys.readouterr()
    assert cli.main(["trials"]) == 0
    out = capsys.readouterr().out
    assert "the study tuned last: fp8-128x128-causal" in out and "2 trial(s)" in out


def test_a_simulating_study_writes_beside_the_default_database(tmp_path, monkeypatch):
    from zyfa_tune.tuning.spec import TuneSpec

    monkeypatch.setenv("ZYFA_TUNE_DB", str(tmp_path / "cache" / "tuning.db"))
    spec = TuneSpec(dtype="fp8", head_dim_qk=128, head_dim_v=128, seqlens=(4096,), trials=1, runner="simulate")
    assert spec.storage == str(tmp_path / "cache" / "simulated.db")
    named = TuneSpec(
        dtype="fp8", head_dim_qk=128, head_dim_v=128, seqlens=(4096,), trials=1, runner="simulate", storage="x.db"
    )
    assert named.storage == "x.db"
    assert TuneSpec(dtype="fp8", head_dim_qk=128, head_dim_v=128, seqlens=(4096,), trials=1).storage is None
