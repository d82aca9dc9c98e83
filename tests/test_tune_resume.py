"""A tuner killed or failing at the worst moment: a trial's per-shape rows are written all or none,
trials killed in flight are queued again on resume, and a tuner that cannot start its workers leaves
no study behind (nor does an empty study block the next run)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import optuna
import pytest

from zyfa_tune.db import open_store
from zyfa_tune.kernels import dispatch
from zyfa_tune.tuning.spec import TuneSpec
from zyfa_tune.tuning.tuner import Tuner, open_study_storage
from zyfa_tune.tuning.worker import WorkerError

SHIPPED = str(Path(dispatch.TUNED_DIR) / "h200.db")
STUDY = "fp8-128x128-causal"
Waiting = optuna.trial.TrialState.WAITING


def spec(tmp_path, **kw) -> TuneSpec:
    base = dict(
        dtype="fp8",
        head_dim_qk=128,
        head_dim_v=128,
        seqlens=(4096, 16384),
        trials=2,
        storage=str(tmp_path / "tune.db"),
        study_storage=str(tmp_path / "study.journal"),
        runner=f"simulate:{SHIPPED}",
        timeout_s=60.0,
        sampler="random",
    )
    base.update(kw)
    return TuneSpec(**base)


# The tuner process dies (os._exit, as SIGKILL would) in the middle of writing the second shape's row
# of its first measured trial.
_DIE_MID_TRIAL = textwrap.dedent("""
    import os, sys
    from zyfa_tune.db import rows
    from zyfa_tune.tuning.tuner import Tuner
    from zyfa_tune.tuning.spec import TuneSpec

    real, calls = rows.problem_id, []

    def dying(session, key):
        calls.append(key)
        if len(calls) == 2:
            os._exit(9)
        return real(session, key)

    rows.problem_id = dying
    storage, journal, shipped = sys.argv[1:4]
    Tuner(TuneSpec(dtype="fp8", head_dim_qk=128, head_dim_v=128, seqlens=(4096, 16384), trials=4, storage=storage,
                   study_storage=journal, runner="simulate:" + shipped, timeout_s=60.0, sampler="random")).run()
""")


def test_a_kill_mid_trial_leaves_no_partial_rows_and_resume_measures_it_again(tmp_path):
    script = tmp_path / "die.py"
    script.write_text(_DIE_MID_TRIAL)
    s = spec(tmp_path, resume=True)
    proc = subprocess.run([sys.executable, str(script), s.storage, s.study_storage, SHIPPED], timeout=300)
    assert proc.returncode == 9
    with open_store(s.storage, readonly=True, create=False) as store:
        assert store.trials() == []  # both shapes' rows or neither
    storage = open_study_storage(s.study_storage)
    killed = {
        t.number: t.system_attrs["fixed_params"]
        for t in optuna.load_study(study_name=STUDY, storage=storage).trials
        if t.state == optuna.trial.TrialState.RUNNING
    }
    assert len(killed) == 2  # the trial being written and the one asked ahead (both queued seeds)

    tuner = Tuner(s)
    study = tuner.open_study()  # the resume: killed trials failed and queued again
    by_number = {t.number: t for t in study.trials}
    assert all(by_number[n].user_attrs.get("killed") and by_number[n].state.is_finished() for n in killed)
    again = [t for t in study.get_trials(states=(Waiting,)) if "requeued_from" in t.user_attrs]
    assert {t.user_attrs["requeued_from"]: t.system_attrs["fixed_params"] for t in again} == killed
    for params in killed.values():  # not taken for a configuration measured before
        assert not any(
            t.params == params for t in study.trials if t.state.is_finished() and not t.user_attrs.get("killed")
        )

    Tuner(spec(tmp_path, resume=True, trials=2)).run()
    with open_store(s.storage, readonly=True, create=False) as store:
        rows = store.trials()
    per_config: dict[str, set[int]] = {}
    for row in rows:
        per_config.setdefault(row["config_json"], set()).add(row["seqlen"])
    assert per_config and all(seqlens == {4096, 16384} for seqlens in per_config.values())


def test_a_tuner_that_cannot_start_its_workers_leaves_no_study(tmp_path):
    """No GPU for runner "gpu": the error comes before the study exists, so the next run needs no
    --resume (and says how to run without a GPU)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(WorkerError, match="--runner simulate"):
        Tuner(spec(tmp_path, runner="gpu")).run()
    storage = open_study_storage(str(tmp_path / "study.journal"))
    assert STUDY not in {st.study_name for st in optuna.get_all_study_summaries(storage)}
    study = Tuner(spec(tmp_path)).run()
    assert len([t for t in study.trials if t.state.is_finished()]) == 2


def test_an_empty_study_is_taken_over_without_resume(tmp_path):
    """A study with nothing but queued trials (its first tuner failed before measuring) is continued
    without --resume; a study that ran a trial still needs it."""
    s = spec(tmp_path, seqlens=(4096,))
    Tuner(s).open_study()  # created and seeded, nothing measured
    study = Tuner(s).run()
    finished = [t for t in study.trials if t.state.is_finished()]
    assert len(finished) == 2
    params = [json_key(t) for t in study.trials]
    assert len(params) == len(set(params)), "a seed was queued twice"
    with pytest.raises(ValueError, match="--resume"):
        Tuner(s).run()


def json_key(t) -> str:
    import json

    return json.dumps(t.system_attrs.get("fixed_params", t.params), sort_keys=True)
