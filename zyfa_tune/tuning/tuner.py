"""The tuner: an Optuna study over a family's search space, trials run in isolated workers (one per
GPU), every per-shape result written to the tuning database that the dispatcher reads.

    search space --suggest--> KernelConfig --Task--> Worker (compile, verify, time) --> TrialResult
        --> Store.record_trial (per shape: best kept per (GPU, problem class)) and study.tell

The Optuna study lives in its own storage (a journal file by default, an RDB URL for many hosts;
optuna-dashboard opens either); the tuning database holds the results the runtime uses. A study is
resumable: finished trials stay in the study storage, a configuration already measured in the study
is never measured again, and trials left RUNNING by a killed tuner on this host are marked failed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import random
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import optuna

from zyfa_tune.db import Fingerprint, TrialResult, open_store
from zyfa_tune.generator import GENERATOR_VERSION, HOPPER, KernelConfig, emit
from zyfa_tune.generator.recipe import PLAIN, Recipe
from zyfa_tune.search_spaces import get_space, recipe_neighbours, recipe_options, seed_points, suggest_recipe
from zyfa_tune.tuning.runners import parse_runner
from zyfa_tune.tuning.spec import LOOSE_GATE, Progress, TuneSpec
from zyfa_tune.tuning.task import shape_key
from zyfa_tune.tuning.trials import requeue_killed
from zyfa_tune.tuning.warm_start import study_seeds
from zyfa_tune.tuning.worker import Task, Worker

_HOST = socket.gethostname()


def default_study_storage(study: str) -> str:
    from zyfa_tune.db import default_db_path

    folder = default_db_path().parent / "studies"
    folder.mkdir(parents=True, exist_ok=True)
    return str(folder / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', study)}.journal")


def open_study_storage(target: str):
    """An RDB URL (many hosts) or a journal file (one host, many processes)."""
    if "://" in target:
        return optuna.storages.RDBStorage(target)
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    return JournalStorage(JournalFileBackend(target))


def simulation_fingerprint(runner: str) -> Fingerprint:
    """The fingerprint results of a non-GPU runner are filed under (never a real GPU's): the dispatcher
    on a GPU never picks a simulated result."""
    return Fingerprint(
        gpu_name=f"{parse_runner(runner).kind} (no GPU)",
        compute_capability="9.0",
        sm_count=HOPPER.sm_count,
        memory_bytes=1,
        driver="none",
        cuda="none",
        torch="none",
        triton="none",
        generator_version=GENERATOR_VERSION,
    )


def _value(results: list[TrialResult]) -> float:
    """Geometric mean TFLOP/s over the shapes (every shape must be ok)."""
    return math.exp(sum(math.log(r.tflops) for r in results) / len(results))


def _config_key(cfg: KernelConfig, recipe: Recipe | None = None) -> str:
    """What a study measures once: the config, and in a bf16-API study its recipe too."""
    return cfg.to_json() if recipe is None else f"{cfg.to_json()} recipe={recipe.to_json()}"


@dataclass(frozen=True)
class _Asked:
    """A trial asked from the study that needs the GPU."""

    trial: optuna.Trial
    cfg: KernelConfig
    key: str
    recipe: Recipe | None = None  # bf16-API studies only


class Tuner:
    #: what the compile-ahead pool runs (None: by runner, see zyfa_tune.tuning.precompile); tests replace it
    precompile_fn = None

    def __init__(self, spec: TuneSpec, on_progress: Callable[[Progress], None] | None = None):
        self.spec = spec
        self.precompiler = None
        self.space = get_space(spec.dtype)
        self.progress = Progress()
        self.on_progress = on_progress
        self._lock = threading.Lock()
        self._seen: dict[str, tuple] = {}  # config json -> (state, values) of finished study trials
        self._rng = random.Random(spec.seed)  # local moves (see _local_move), reproducible per seed
        self._running: set[str] = set()  # config json of asked trials not finished yet
        self.study_storage = spec.study_storage or default_study_storage(spec.name)

    # ---- study ----------------------------------------------------------------------------
    def _sampler(self):
        if self.spec.sampler == "random":
            return optuna.samplers.RandomSampler(seed=self.spec.seed)
        if self.spec.multi_objective:
            return optuna.samplers.TPESampler(seed=self.spec.seed, constant_liar=True)
        return optuna.samplers.TPESampler(seed=self.spec.seed, multivariate=True, constant_liar=True)

    def open_study(self) -> optuna.Study:
        """Create the study, or load it to resume; a study that exists but never ran a trial (its
        first tuner failed before measuring) is taken over without --resume."""
        storage = open_study_storage(self.study_storage)
        exists = self._check_resumable(storage)
        directions = ["maximize", "minimize"] if self.spec.multi_objective else ["maximize"]
        study = optuna.create_study(
            study_name=self.spec.name,
            storage=storage,
            sampler=self._sampler(),
            directions=directions,
            load_if_exists=True,
        )
        study.set_user_attr("spec", {f.name: _plain(getattr(self.spec, f.name)) for f in dataclasses.fields(self.spec)})
        self._recover(study)
        # first: WAITING trials run in the order they were enqueued
        for cfg, recipe in self._seed_points(self.spec.enqueued + self.spec.warm_configs):
            study.enqueue_trial(self._params(cfg, recipe), skip_if_exists=True)
        if not exists:
            # a bf16-API study's gate is on the whole call, whose error the recipe can lower by more
            # than lean P raises it: its lean seeds are always measured (with balanced V first)
            loose = self._recipes or self.spec.multi_objective or self.spec.gate >= LOOSE_GATE
            seeds = study_seeds(self.space, self.spec.head_dim_qk, self.spec.head_dim_v, loose=loose)
            for cfg, recipe in self._seed_points(seeds):
                study.enqueue_trial(self._params(cfg, recipe), skip_if_exists=True)
        return study

    def _seed_points(self, configs: list[KernelConfig]) -> list[tuple[KernelConfig, Recipe | None]]:
        """The points to measure first for these configs: each with its seed recipes in a bf16-API
        study (`search_spaces.seed_points`), alone in an FP8-API one."""
        return seed_points(configs) if self._recipes else [(c, None) for c in configs]

    @property
    def _recipes(self) -> bool:
        """Whether the study searches the quantisation recipe (the bf16 API's studies)."""
        return self.spec.api == "bf16"

    def _params(self, cfg: KernelConfig, recipe: Recipe | None = None) -> dict:
        """The Optuna parameters of a point: the config's, and in a bf16-API study the recipe's
        (plain unless given)."""
        params = self.space.as_optuna_params(cfg)
        return {**params, **recipe_options(recipe or PLAIN)} if self._recipes else params

    def _check_resumable(self, storage) -> bool:
        """Whether the study exists with a trial beyond the queued ones; ValueError if so without --resume."""
        try:
            study = optuna.load_study(study_name=self.spec.name, storage=storage)
        except KeyError:
            return False
        waiting = optuna.trial.TrialState.WAITING
        started = any(t.state != waiting for t in study.get_trials(deepcopy=False))
        if started and not self.spec.resume:
            raise ValueError(
                f"study: {self.spec.name!r} already exists in {self.study_storage}; "
                f"pass --resume to continue it or --study NAME for a new one"
            )
        return started

    def _recover(self, study: optuna.Study) -> None:
        """Queue again the trials a killed tuner on this host left RUNNING; index finished configs."""
        requeue_killed(study, _HOST, _alive)
        for t in study.get_trials(deepcopy=False):
            if t.state.is_finished() and "config" in t.user_attrs and not t.user_attrs.get("killed"):
                recipe = t.user_attrs.get("recipe")
                key = t.user_attrs["config"] + ("" if recipe is None else f" recipe={recipe}")
                self._seen[key] = (t.state, t.values)

    # ---- trials ---------------------------------------------------------------------------
    def _fingerprint(self, gpu: int | None) -> Fingerprint:
        if self.spec.runner == "gpu":
            from zyfa_tune.db import current_fingerprint

            return current_fingerprint(gpu or 0)
        return simulation_fingerprint(self.spec.runner)

    def _ask(self, study: optuna.Study, worker: Worker) -> _Asked | None:
        """Ask for the next trial; settle it at once when it needs no GPU (infeasible, or a config
        measured before in this study) and return None, else return it for measuring."""
        trial = study.ask()
        trial.set_user_attr("host", _HOST)
        trial.set_user_attr("pid", os.getpid())
        trial.set_user_attr("gpu", worker.gpu)
        recipe = suggest_recipe(trial) if self._recipes else None
        cfg = self.space.suggest(trial, self.spec.head_dim_qk, self.spec.head_dim_v)
        if cfg is None:
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
            self._count("infeasible")
            return None
        key = _config_key(cfg, recipe)
        trial.set_user_attr("config", cfg.to_json())
        if recipe is not None:
            trial.set_user_attr("recipe", recipe.to_json())
        with self._lock:
            seen = self._seen.get(key)
            running = seen is None and key in self._running
            if seen is None and not running:
                self._running.add(key)
        if seen is not None or running:  # measured before, or being measured: never run twice
            trial.set_user_attr("duplicate", True)
            state, values = seen or (optuna.trial.TrialState.FAIL, None)  # FAIL: TPE ignores it
            if state == optuna.trial.TrialState.COMPLETE:
                study.tell(trial, values)
            else:
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
            self._count("duplicate")
            if self.spec.sampler == "tpe":
                self._local_move(study, cfg, recipe)
            return None
        return _Asked(trial, cfg, key, recipe)

    def _local_move(self, study: optuna.Study, cfg: KernelConfig, recipe: Recipe | None = None) -> None:
        """TPE proposed a config measured before (it concentrates on its best region and then
        repeats itself: most asks of a long study repeat a config). Enqueue one unmeasured
        neighbour of it (one searched option, or recipe field, changed) so the next ask measures
        something new near where TPE is looking; at most one such trial waits at a time."""
        if study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,)):
            return
        near = [(c, recipe) for c in self.space.neighbours(cfg)]
        near += [(cfg, r) for r in (recipe_neighbours(recipe) if recipe is not None else ())]
        with self._lock:
            fresh = [
                (c, r)
                for c, r in near
                if _config_key(c, r) not in self._seen and _config_key(c, r) not in self._running
            ]
            if not fresh:
                return
            pick, pick_recipe = fresh[self._rng.randrange(len(fresh))]
        study.enqueue_trial(self._params(pick, pick_recipe), user_attrs={"local_move": True})

    def _measure(self, study: optuna.Study, asked: _Asked, worker: Worker, store, fp: Fingerprint) -> None:
        """Run an asked trial in the worker, record every shape's result, tell the study."""
        try:
            self._measure_one(study, asked, worker, store, fp)
        finally:
            with self._lock:
                self._running.discard(asked.key)

    def _measure_one(self, study: optuna.Study, asked: _Asked, worker: Worker, store, fp: Fingerprint) -> None:
        trial, cfg, key = asked.trial, asked.cfg, asked.key
        task = Task(
            config_json=cfg.to_json(),
            shapes=self.spec.shapes,
            causal=self.spec.causal,
            seed=self.spec.seed,
            gate=self.spec.gate,
            reps=self.spec.reps,  # probes cached per study
            inputs=None if self.spec.inputs is None else os.path.abspath(self.spec.inputs),
            input_family=self.spec.input_family,
            api=self.spec.api,
            recipe=asked.recipe,
        )
        results = worker.run(task)
        keys = [
            shape_key(shape, cfg.dtype, cfg.head_dim_qk, cfg.head_dim_v, self.spec.causal, self.spec.api)
            for shape in self.spec.shapes
        ]
        store.record_trials(
            fp,
            cfg,
            list(zip(keys, results)),
            source_hash=emit(cfg).source_hash,  # all or none
            study=self.spec.name,
            provenance=f"study={self.spec.name} trial={trial.number} host={_HOST} "
            f"gpu={worker.gpu} inputs={self.spec.inputs_label}",
        )
        statuses = [r.status for r in results]
        trial.set_user_attr("statuses", statuses)
        if all(s == "ok" for s in statuses):
            value = _value(results)
            errors = [r.error_rel_l2 or 0.0 for r in results]
            values = (value, max(errors)) if self.spec.multi_objective else (value,)
            trial.set_user_attr("tflops", [r.tflops for r in results])
            study.tell(trial, list(values))
            state = optuna.trial.TrialState.COMPLETE
        else:
            trial.set_user_attr("failure", next(r.message for r in results if r.status != "ok")[-500:])
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            state, values = optuna.trial.TrialState.FAIL, None
        with self._lock:
            self._seen[key] = (state, values)
            p = self.progress
            p.done += 1
            gpu = "-" if worker.gpu is None else str(worker.gpu)
            p.by_gpu[gpu] = p.by_gpu.get(gpu, 0) + 1
            for s in set(statuses):
                p.by_status[s] = p.by_status.get(s, 0) + 1
            clocks = [r.sm_clock_mhz for r in results if r.sm_clock_mhz]
            p.last_clock_mhz = clocks[-1] if clocks else p.last_clock_mhz
            if state == optuna.trial.TrialState.COMPLETE and (p.best_value is None or values[0] > p.best_value):
                p.best_value, p.best_config = values[0], cfg
        if self.on_progress:
            self.on_progress(self.progress)

    def _count(self, what: str) -> None:
        """A trial finished without being measured (infeasible, or measured before)."""
        with self._lock:
            self.progress.done += 1
            self.progress.by_status[what] = self.progress.by_status.get(what, 0) + 1
        if self.on_progress:
            self.on_progress(self.progress)

    def _budget_left(self, deadline: float | None, launched: list[int]) -> bool:
        with self._lock:
            if self.spec.trials is not None and launched[0] >= self.spec.trials:
                return False
            if deadline is not None and time.time() >= deadline:
                return False
            launched[0] += 1
            return True

    def run(self) -> optuna.Study:
        """Run the study until the trial count or the time budget is spent; returns the study.
        Every worker has started its runner before the study is opened: a machine that cannot run
        the runner (no GPU for "gpu") raises WorkerError and leaves no study behind."""
        self._check_resumable(open_study_storage(self.study_storage))  # before any worker starts
        with contextlib.ExitStack() as stack:
            workers = [
                stack.enter_context(Worker(gpu=g, runner=self.spec.runner, timeout_s=self.spec.timeout_s))
                for g in self.spec.gpus
            ]
            for worker in workers:
                worker.wait_ready()
            fingerprints = [self._fingerprint(g) for g in self.spec.gpus]
            study = self.open_study()
            self._run_workers(workers, fingerprints)
        return study

    def _run_workers(self, workers: list[Worker], fingerprints: list[Fingerprint]) -> None:
        """One thread per worker, each asking, measuring and recording trials until the budget is spent."""
        deadline = None if self.spec.time_budget_s is None else time.time() + self.spec.time_budget_s
        launched = [0]
        errors: list[BaseException] = []

        def loop(worker: Worker, fp: Fingerprint) -> None:
            try:
                with open_store(self.spec.storage) as store:
                    local = optuna.load_study(
                        study_name=self.spec.name,
                        storage=open_study_storage(self.study_storage),
                        sampler=self._sampler(),
                    )
                    pending: _Asked | None = None
                    while True:  # one trial asked ahead: its kernel compiles while this one measures
                        current, pending = pending, None
                        while pending is None and self._budget_left(deadline, launched):
                            pending = self._ask(local, worker)
                        if pending is not None and precompiler is not None:
                            precompiler.submit(pending.cfg)
                        if current is None and pending is None:
                            break
                        if current is not None:
                            self._measure(local, current, worker, store, fp)
            except BaseException as exc:  # surfaced after the other GPUs finish
                errors.append(exc)

        precompiler = None
        if self.spec.precompile:
            from zyfa_tune.tuning.precompile import Precompiler

            precompiler = Precompiler(
                self.spec.runner,
                [(sh.batch, sh.seqlen, sh.heads, sh.kv_heads) for sh in self.spec.shapes],
                self.spec.causal,
                processes=len(self.spec.gpus),
                gpu=self.spec.gpus[0],
                compile_fn=self.precompile_fn,
            )
        self.precompiler = precompiler
        threads = [
            threading.Thread(target=loop, args=(w, fp), name=f"zyfa-tune-gpu{w.gpu}")
            for w, fp in zip(workers, fingerprints)
        ]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            if precompiler is not None:
                precompiler.close()
        if errors:
            raise errors[0]


def _alive(pid: object) -> bool:
    """Whether a process with this pid exists (on this host)."""
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        pass
    return True


def _plain(value: object) -> object:
    """A spec field as the study storage's JSON holds it (a LengthMix as its fields)."""
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value


def best_per_shape(spec: TuneSpec) -> list[dict]:
    """For the end-of-run table: per shape, the best stored entry and this study's result for the
    untuned kernel (`kernels.defaults.fallback_config`: what `flash_attn_func` runs with no tuned
    entry; a seed of every study, so measured first)."""
    from zyfa_tune.generator.defaults import fallback_config

    untuned_json = fallback_config(spec.dtype, spec.head_dim_qk, spec.head_dim_v).to_json()
    rows = []
    with open_store(spec.storage, readonly=True, create=False) as store:
        for shape in spec.shapes:
            pkey = shape_key(shape, spec.dtype, spec.head_dim_qk, spec.head_dim_v, spec.causal, spec.api)
            best = store.best_for(pkey)
            trials = store.trials(key=pkey, status="ok")
            untuned = [
                t
                for t in trials
                if t["config_json"] == untuned_json and t.get("study") == spec.name and t.get("recipe") is None
            ]
            rows.append(
                dict(
                    shape=shape,
                    key=pkey,
                    best=best[0] if best else None,
                    untuned_tflops=max((t["tflops"] for t in untuned if t.get("tflops")), default=None),
                )
            )
    return rows
