"""The whole tuning loop on the CPU: Optuna study -> isolated workers (simulation runner: stored GPU
measurements, real sm_90a compiles) -> tuning database -> dispatcher; injected faults; resume after
SIGKILL."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import optuna
import pytest

from zyfa_tune.db import ProblemKey, open_store
from zyfa_tune.kernels import dispatch
from zyfa_tune.search_spaces import get_space
from zyfa_tune.tuning.spec import TuneSpec, parse_duration
from zyfa_tune.tuning.tuner import Tuner, simulation_fingerprint
from zyfa_tune.tuning.warm_start import study_seeds

SHIPPED = str(Path(dispatch.TUNED_DIR) / "h200.db")


def spec(tmp_path, **kw) -> TuneSpec:
    base = dict(
        dtype="fp8",
        head_dim_qk=128,
        head_dim_v=128,
        seqlens=(8192,),
        trials=6,
        storage=str(tmp_path / "tune.db"),
        study_storage=str(tmp_path / "study.journal"),
        runner=f"simulate:{SHIPPED}",
        timeout_s=60.0,
    )
    base.update(kw)
    return TuneSpec(**base)


def test_spec_validation(tmp_path):
    with pytest.raises(ValueError, match="head_dim_qk"):
        spec(tmp_path, head_dim_qk=84)
    with pytest.raises(ValueError, match="seqlens"):
        spec(tmp_path, seqlens=())
    with pytest.raises(ValueError, match="kv_heads"):
        spec(tmp_path, heads=32, kv_heads=5)
    with pytest.raises(ValueError, match="trials"):
        spec(tmp_path, trials=None, time_budget_s=None)
    for gate in (0.9, float("nan"), True):
        with pytest.raises(ValueError, match="gate"):
            spec(tmp_path, gate=gate)
    assert spec(tmp_path, gate=1.5).gate == 1.5
    assert parse_duration("15m") == 900 and parse_duration("1h30m") == 5400 and parse_duration("90") == 90
    with pytest.raises(ValueError, match="--time"):
        parse_duration("soon")


def test_loop_ends_with_a_best_entry_the_dispatcher_returns(tmp_path):
    s = spec(tmp_path, seqlens=(4096, 16384), trials=8)
    study = Tuner(s).run()
    finished = [t for t in study.trials if t.state.is_finished()]
    assert len(finished) == 8
    assert any(t.state == optuna.trial.TrialState.COMPLETE for t in finished)
    with open_store(s.storage, readonly=True, create=False) as store:
        assert store.count_trials() >= 2 * sum(t.state != optuna.trial.TrialState.PRUNED for t in finished) - 2
        best = store.best_entries()
    assert {e.key.seqlen_bucket for e in best} == {4096, 16384}
    d = dispatch.Dispatcher([s.storage])
    key = ProblemKey.from_shape(
        dtype="fp8", head_dim_qk=128, head_dim_v=128, causal=True, batch=1, heads=32, kv_heads=32, seqlen=16384
    )
    choice = d.choose(key, simulation_fingerprint(s.runner).device_key())
    assert choice.source == "exact"
    fastest = min((e for e in best if e.key == key), key=lambda e: e.median_ms)
    assert choice.config.to_json() == fastest.config_json


def test_two_workers_share_one_study(tmp_path):
    """--gpus 0,1: one worker per GPU, both feeding one study; each trial says where it ran."""
    s = spec(tmp_path, gpus=(0, 1), trials=10)
    tuner = Tuner(s)
    study = tuner.run()
    finished = [t for t in study.trials if t.state.is_finished()]
    assert len(finished) == 10
    measured = [t for t in finished if "statuses" in t.user_attrs]
    by_gpu = {g: sum(t.user_attrs["gpu"] == g for t in measured) for g in (0, 1)}
    assert by_gpu[0] > 0 and by_gpu[1] > 0, by_gpu
    assert tuner.progress.by_gpu == {str(g): n for g, n in by_gpu.items()}
    assert len({t.user_attrs["pid"] for t in finished}) == 1  # one tuner process, two worker threads
    with open_store(s.storage, readonly=True, create=False) as store:
        provenance = {row["provenance"].split(" gpu=")[1].split()[0] for row in store.trials()}
    assert provenance == {"0", "1"}


def slow_compile(config_json, shapes, causal):
    """Stands in for a compile in the precompile pool (runs in a spawned process)."""
    time.sleep(0.05)
    return 0.05


def broken_compile(config_json, shapes, causal):
    raise RuntimeError("compiler crashed")


def test_next_trial_is_precompiled_while_this_one_measures(tmp_path):
    tuner = Tuner(spec(tmp_path, trials=10, precompile=True))
    tuner.precompile_fn = slow_compile
    study = tuner.run()
    measured = sorted((t for t in study.trials if "statuses" in t.user_attrs), key=lambda t: t.number)
    assert len(measured) >= 3
    # every measured trial was handed to the pool when asked, i.e. before the previous one measured
    assert tuner.precompiler.submitted == [t.user_attrs["config"] for t in measured]
    assert set(tuner.precompiler.compiled) <= set(tuner.precompiler.submitted)


def test_precompile_failures_never_reach_the_study(tmp_path):
    tuner = Tuner(spec(tmp_path, trials=6, precompile=True))
    tuner.precompile_fn = broken_compile
    study = tuner.run()
    assert len([t for t in study.trials if t.state.is_finished()]) == 6
    assert any(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials)
    assert "compiler crashed" not in " ".join(str(t.user_attrs.get("failure", "")) for t in study.trials)


def test_precompile_runs_the_simulation_compile(tmp_path):
    """Compile-ahead is opt-in; for the simulation runner it runs that runner's real sm_90a compile
    (what the worker then finds in Triton's cache)."""
    from zyfa_tune.generator.defaults import default_config
    from zyfa_tune.tuning.precompile import Precompiler, compile_fn_for, compile_for_simulation

    plain = Tuner(spec(tmp_path, trials=2))
    plain.run()
    assert plain.precompiler is None
    assert compile_fn_for(f"simulate:{SHIPPED}") is compile_for_simulation
    cfg = default_config("fp8", 128, 128).replace(num_stages=2)
    with Precompiler(f"simulate:{SHIPPED}", [(1, 8192, 32, 32)], True) as pc:
        pc.submit(cfg)
        deadline = time.time() + 180
        while not (pc.compiled or pc.failed) and time.time() < deadline:
            time.sleep(0.2)
        assert pc.compiled == [cfg.to_json()] and not pc.failed


def test_existing_study_needs_resume(tmp_path):
    Tuner(spec(tmp_path, trials=2)).run()
    with pytest.raises(ValueError, match="--resume"):
        Tuner(spec(tmp_path, trials=2)).run()
    study = Tuner(spec(tmp_path, trials=2, resume=True)).run()
    assert len([t for t in study.trials if t.state.is_finished()]) == 4


@pytest.mark.parametrize("mode,status", [("hang", "timeout"), ("exit", "crash"), ("raise", "crash")])
def test_injected_faults_are_recorded_and_the_study_goes_on(tmp_path, mode, status):
    # the fault hits only configs with q_order=forward (about half of them, both backends); everything
    # else is answered by the simulation runner
    s = spec(tmp_path, trials=10, sampler="random", runner=f"fault:{mode}@q_order=forward", timeout_s=8.0)
    study = Tuner(s).run()
    assert len([t for t in study.trials if t.state.is_finished()]) == 10
    with open_store(s.storage, readonly=True, create=False) as store:
        statuses = {t["status"] for t in store.trials()}
    assert status in statuses and "ok" in statuses


_KILL_SCRIPT = textwrap.dedent("""
    import sys
    from zyfa_tune.tuning.tuner import Tuner
    from zyfa_tune.tuning.spec import TuneSpec
    storage, journal, shipped, resume = sys.argv[1:5]
    Tuner(TuneSpec(dtype="fp8", head_dim_qk=128, head_dim_v=128, seqlens=(8192,), trials=24, storage=storage,
                   study_storage=journal, runner="simulate:" + shipped, timeout_s=60.0, sampler="random",
                   resume=resume == "1")).run()
""")


def test_sigkill_and_resume_lose_and_repeat_nothing(tmp_path):
    """24 trials: the hd128 seeds (enqueued: a resume must not enqueue them again) and a few random ones."""
    script = tmp_path / "run.py"
    script.write_text(_KILL_SCRIPT)
    storage, journal = str(tmp_path / "tune.db"), str(tmp_path / "study.journal")
    proc = subprocess.Popen([sys.executable, str(script), storage, journal, SHIPPED, "0"])
    storage_obj = None
    deadline = time.time() + 120
    done_before = 0
    while time.time() < deadline:  # wait until a few trials have finished, then kill -9
        time.sleep(1.0)
        if Path(journal).exists():
            from zyfa_tune.tuning.tuner import open_study_storage

            storage_obj = open_study_storage(journal)
            try:
                st = optuna.load_study(study_name="fp8-128x128-causal", storage=storage_obj)
            except KeyError:
                continue
            done_before = len([t for t in st.trials if t.state.is_finished()])
            if done_before >= 3:
                break
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    st = optuna.load_study(study_name="fp8-128x128-causal", storage=storage_obj)
    finished_before = {t.number: t.user_attrs.get("config") for t in st.trials if t.state.is_finished()}
    in_flight = {t.number: t.params for t in st.trials if t.state == optuna.trial.TrialState.RUNNING}
    assert in_flight
    assert len(finished_before) >= 3
    subprocess.run([sys.executable, str(script), storage, journal, SHIPPED, "1"], check=True, timeout=600)
    st = optuna.load_study(study_name="fp8-128x128-causal", storage=storage_obj)
    after = {t.number: t for t in st.trials}
    for number, cfg in finished_before.items():  # nothing finished was lost
        assert after[number].state.is_finished() and after[number].user_attrs.get("config") == cfg
    assert not any(t.state == optuna.trial.TrialState.RUNNING for t in st.trials)
    requeued = {
        t.user_attrs["requeued_from"]: t.system_attrs["fixed_params"]
        for t in st.trials
        if "requeued_from" in t.user_attrs
    }
    assert set(requeued) == set(in_flight), "a trial killed in flight was not queued again"
    assert all(params.items() <= requeued[n].items() for n, params in in_flight.items())
    measured = [
        t.user_attrs["config"]
        for t in st.trials
        if t.state.is_finished()
        and "config" in t.user_attrs
        and not t.user_attrs.get("duplicate")
        and not t.user_attrs.get("killed")
    ]
    assert len(measured) == len(set(measured)), "a configuration was measured twice"


@pytest.mark.parametrize("kw,lean", [({}, False), ({"gate": 1.5}, True), ({"multi_objective": True}, True)])
def test_lean_seed_only_where_the_gate_admits_it(tmp_path, kw, lean):
    """A study is seeded with lean P's configs (the lean Gluon default, the lean two-tile kernel with code
    sums, the same on f16 scores, synchronous and qk_async, and on the row maximum) only if its gate is at
    least tune.LOOSE_GATE or it keeps the Pareto front over (speed, error): under the default 1.25 they would
    be certain rejections."""
    from zyfa_tune.search_spaces.seeds import (
        gluon_lean_config,
        gluon_lean_f16_async_config,
        gluon_lean_f16_config,
        gluon_lean_max_config,
        gluon_lean_smem2_config,
    )

    tuner = Tuner(spec(tmp_path, **kw))
    study = tuner.open_study()
    queued = [t.system_attrs["fixed_params"] for t in study.get_trials(states=(optuna.trial.TrialState.WAITING,))]
    makers = (
        gluon_lean_config,
        gluon_lean_smem2_config,
        gluon_lean_f16_config,
        gluon_lean_f16_async_config,
        gluon_lean_max_config,
    )
    for make in makers:
        assert (tuner.space.as_optuna_params(make("fp8", 128, 128)) in queued) is lean
    assert len(queued) == len(study_seeds(tuner.space, 128, 128)) + len(makers) * lean


def test_enqueued_configs_run_first_and_bad_ones_are_named(tmp_path):
    """`--enqueue key=val,...`: the config runs before the seeds (also when a study is resumed), and a
    malformed, unknown, unsearched or statically infeasible one is refused before the study starts."""
    from zyfa_tune.generator.defaults import config_with

    text = "backend=gluon,p_carry=smem2,half_block=true,late_rescale=true"
    want = config_with(
        "fp8", 128, 128, {"backend": "gluon", "p_carry": "smem2", "half_block": True, "late_rescale": True}
    )
    tuner = Tuner(spec(tmp_path, enqueue=(text,)))
    assert tuner.spec.enqueued == (tuner.space.canonical(want),)
    study = tuner.open_study()
    queued = [t.system_attrs["fixed_params"] for t in study.get_trials(states=(optuna.trial.TrialState.WAITING,))]
    assert queued[0] == tuner.space.as_optuna_params(want)
    assert len(queued) == len(study_seeds(tuner.space, 128, 128)) + (want not in study_seeds(tuner.space, 128, 128))
    asked = tuner._ask(study, __import__("types").SimpleNamespace(gpu=None))
    assert asked is not None and asked.cfg == tuner.space.canonical(want)
    # resumed with another config: it is queued, the study's first one is not queued again
    again = Tuner(spec(tmp_path, resume=True, enqueue=(text, "backend=gluon,producer_regs=40")))
    st = again.open_study()
    waiting = [t.system_attrs["fixed_params"] for t in st.get_trials(states=(optuna.trial.TrialState.WAITING,))]
    assert again.space.as_optuna_params(again.spec.enqueued[1]) in waiting
    assert waiting.count(again.space.as_optuna_params(want)) == 0  # asked above: not WAITING any more
    for bad, match in (
        ("backend=gluon,half_block", "expected key=value"),
        ("backend=gluon,no_such_field=1", "no_such_field"),
        ("block_m=96", "block_m"),
        ("backend=gluon,block_n=256,num_stages=4,q_stages=2", "does not fit"),
    ):
        with pytest.raises(ValueError, match=match):
            spec(tmp_path, enqueue=(bad,))
    for not_a_list in ("backend=gluon", (1,)):
        with pytest.raises(ValueError, match="enqueue: expected a sequence"):
            spec(tmp_path, enqueue=not_a_list)


def test_cli_enqueue_is_the_first_trial(tmp_path, capsys):
    from zyfa_tune import cli
    from zyfa_tune.generator.defaults import config_with
    from zyfa_tune.search_spaces import get_space
    from zyfa_tune.tuning.tuner import _config_key

    journal = str(tmp_path / "s.journal")
    argv = [
        "tune",
        "--head-dim",
        "128",
        "--seqlens",
        "8192",
        "--trials",
        "1",
        "--runner",
        f"simulate:{SHIPPED}",
        "--storage",
        str(tmp_path / "t.db"),
        "--study-storage",
        journal,
        "--timeout",
        "60",
    ]
    assert cli.main(argv + ["--enqueue", "backend=gluon,producer_regs=40,ping_pong=false"]) == 0
    study = optuna.load_study(
        study_name="fp8-128x128-causal",
        storage=optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(journal)),
    )
    first = min((t for t in study.trials if t.state.is_finished()), key=lambda t: t.number)
    want = get_space("fp8").canonical(
        config_with("fp8", 128, 128, {"backend": "gluon", "producer_regs": 40, "ping_pong": False})
    )
    assert first.user_attrs["config"] == _config_key(want)
    capsys.readouterr()
    assert cli.main(argv + ["--study", "other", "--enqueue", "backend=gluon,num_stages=9"]) == 2
    assert "enqueue 'backend=gluon,num_stages=9'" in capsys.readouterr().out


def _shipped_best_configs(path: str, dqk: int, dv: int) -> list[str]:
    """The best entries' config text of fp8 causal (dqk, dv) in a database, fastest first (raw SQL)."""
    with sqlite3.connect(path) as db:
        return [
            r[0]
            for r in db.execute(
                "select v.config_json from best b join problems p on b.problem_id = p.id join variants v on "
                "b.variant_id = v.id where p.dtype = 'fp8' and p.head_dim_qk = ? and p.head_dim_v = ? and p.causal = 1 "
                "order by b.tflops desc",
                (dqk, dv),
            )
        ]


def test_warm_start_queues_the_stored_bests_once_fastest_first(tmp_path):
    """`--warm-start DB`: the best configs the database holds for the head dims, on any shape, are queued
    after `--enqueue` and before the seeds, each once; a stored config that does not parse (here one
    crafted to carry code) or lies outside the space is skipped; a missing database is named."""
    from zyfa_tune.generator import KernelConfig

    stored = _shipped_best_configs(SHIPPED, 192, 128)
    assert len(stored) >= 2
    space = get_space("fp8")
    want = list(dict.fromkeys(space.canonical(KernelConfig.from_json(c)).to_json() for c in stored))
    first = "backend=gluon,p_carry=smem2,half_block=true,late_rescale=true"
    tuner = Tuner(spec(tmp_path, head_dim_qk=192, head_dim_v=128, warm_start=(SHIPPED,), enqueue=(first,)))
    assert [c.to_json() for c in tuner.spec.warm_configs] == [c for c in want if c != tuner.spec.enqueued[0].to_json()]
    study = tuner.open_study()
    queued = [t.system_attrs["fixed_params"] for t in study.get_trials(states=(optuna.trial.TrialState.WAITING,))]
    assert queued[0] == space.as_optuna_params(tuner.spec.enqueued[0])
    assert queued[1 : 1 + len(tuner.spec.warm_configs)] == [space.as_optuna_params(c) for c in tuner.spec.warm_configs]
    assert len(queued) == len({json.dumps(q, sort_keys=True) for q in queued})  # each once
    # a damaged copy: the fastest entry's config carries code, another names a block size outside the space
    bad = tmp_path / "bad.db"
    shutil.copy(SHIPPED, bad)
    with sqlite3.connect(bad) as db:
        rows = db.execute(
            "select v.id, v.config_json from best b join problems p on b.problem_id = p.id join variants v on "
            "b.variant_id = v.id where p.dtype = 'fp8' and p.head_dim_qk = 192 and p.head_dim_v = 128 and "
            "p.causal = 1 order by b.tflops desc"
        ).fetchall()
        db.execute(
            "update variants set config_json = ? where id = ?",
            (json.dumps({**json.loads(stored[0]), "block_m": "__import__('os').system('true')"}), rows[0][0]),
        )
    left = Tuner(spec(tmp_path, study_name="b", head_dim_qk=192, head_dim_v=128, warm_start=(str(bad),)))
    # every entry with that config is that variant (one or more shapes), so the config is gone from the
    # warm list, not kept by another variant
    assert all(vid == rows[0][0] for vid, text in rows if text == stored[0])
    assert space.canonical(KernelConfig.from_json(stored[0])).to_json() not in [
        c.to_json() for c in left.spec.warm_configs
    ]
    assert len(left.spec.warm_configs) == len(want) - 1
    with pytest.raises(ValueError, match="warm_start .*nowhere.db"):
        spec(tmp_path, warm_start=(str(tmp_path / "nowhere.db"),))
    with pytest.raises(ValueError, match="warm_start: expected a sequence"):
        spec(tmp_path, warm_start=SHIPPED)


@pytest.mark.parametrize("flag", [[], ["--warm-start", "shipped"], ["--warm-start", "none"]])
def test_cli_warm_start_is_the_shipped_database_unless_none(tmp_path, capsys, flag):
    """By default (and with 'shipped') a CLI study measures the shipped database's fastest config of its
    head dims first; with 'none' the space's first seed."""
    from zyfa_tune import cli
    from zyfa_tune.generator import KernelConfig
    from zyfa_tune.tuning.tuner import _config_key

    journal = str(tmp_path / "s.journal")
    argv = [
        "tune",
        "--head-dim",
        "192",
        "--head-dim-v",
        "128",
        "--seqlens",
        "8192",
        "--trials",
        "1",
        "--runner",
        f"simulate:{SHIPPED}",
        "--storage",
        str(tmp_path / "t.db"),
        "--study-storage",
        journal,
        "--timeout",
        "60",
    ]
    assert cli.main(argv + flag) == 0
    warm = flag != ["--warm-start", "none"]
    assert ("stored best config(s) of 192/128 fp8" in capsys.readouterr().out) is warm
    study = optuna.load_study(
        study_name="fp8-192x128-causal",
        storage=optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(journal)),
    )
    first = min((t for t in study.trials if t.state.is_finished()), key=lambda t: t.number)
    space = get_space("fp8")
    want = (
        space.canonical(KernelConfig.from_json(_shipped_best_configs(SHIPPED, 192, 128)[0]))
        if warm
        else space.seeds(192, 128)[0]
    )
    assert first.user_attrs["config"] == _config_key(want)
    if not warm:
        assert cli.main(argv + ["--study", "x", "--warm-start", "none", "--warm-start", "shipped"]) == 2
        assert "--warm-start none: give it alone" in capsys.readouterr().out


def test_a_repeated_proposal_enqueues_an_unmeasured_neighbour(tmp_path):
    """When TPE proposes a config measured before, the tuner tells it the stored value and enqueues
    one unmeasured neighbour of it (a local move), so the next ask measures something new."""
    from types import SimpleNamespace

    from zyfa_tune.tuning.tuner import _config_key

    tuner = Tuner(spec(tmp_path, sampler="tpe"))
    study = tuner.open_study()
    seeds = study_seeds(tuner.space, 128, 128)
    for c in seeds:  # as if every seed had been measured: each ask is a repeat
        tuner._seen[_config_key(c)] = (optuna.trial.TrialState.COMPLETE, (100.0,))
    worker = SimpleNamespace(gpu=None)
    for _ in seeds:
        assert tuner._ask(study, worker) is None
    waiting = study.get_trials(states=(optuna.trial.TrialState.WAITING,))
    assert len(waiting) == 1 and waiting[0].user_attrs.get("local_move") is True
    asked = tuner._ask(study, worker)
    assert asked is not None and asked.cfg in tuner.space.neighbours(seeds[-1])
    assert _config_key(asked.cfg) not in tuner._seen
    assert tuner.progress.by_status == {"duplicate": len(seeds)}
    # the random sampler stays random: no local moves
    rnd = Tuner(spec(tmp_path, sampler="random", study_name="r", study_storage=str(tmp_path / "r.journal")))
    rstudy = rnd.open_study()
    for c in study_seeds(rnd.space, 128, 128):
        rnd._seen[_config_key(c)] = (optuna.trial.TrialState.COMPLETE, (100.0,))
    for _ in seeds:
        rnd._ask(rstudy, worker)
    assert not rstudy.get_trials(states=(optuna.trial.TrialState.WAITING,))
