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
import functools
import math
import os
import random
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import optuna

from zyfa_tune.db import APIS, DatabaseError, Fingerprint, ProblemKey, TrialResult, open_store
from zyfa_tune.db.trial_batch import record_trials
from zyfa_tune.generator import GENERATOR_VERSION, HEAD_DIMS, HOPPER, KernelConfig, emit
from zyfa_tune.generator.recipe import PLAIN, Recipe
from zyfa_tune.search_spaces import SEED_RECIPES, get_space, recipe_neighbours, recipe_options, suggest_recipe
from zyfa_tune.tuning.inputs import check_input_family
from zyfa_tune.tuning.runners import parse_runner
from zyfa_tune.tuning.trials import requeue_killed
from zyfa_tune.tuning.warm_start import stored_bests, study_seeds
from zyfa_tune.tuning.worker import Shape, Task, Worker

SAMPLERS = ("tpe", "random")
#: An accuracy gate at least this loose (allowed error / the exact reference's) admits lean P's linear
#: fold (measured 1.33-1.40x): such a study, or a multi-objective one, is also seeded with the space's
#: `loose_seeds`. The default gate (1.25) is not, so its studies spend no trial on a certain rejection.
LOOSE_GATE = 1.4
_HOST = socket.gethostname()


@dataclass(frozen=True)
class TuneSpec:
    dtype: str
    head_dim_qk: int
    head_dim_v: int
    seqlens: tuple[int, ...] = ()
    heads: int = 32
    kv_heads: int | None = None          # default: heads (no GQA)
    tokens: int = 16384                  # batch = max(1, tokens // seqlen) unless batches is given
    batches: tuple[int, ...] | None = None
    causal: bool = True
    trials: int | None = None
    time_budget_s: float | None = None
    gpus: tuple[int | None, ...] = (None,)
    storage: str | None = None           # tuning database (path or SQLAlchemy URL); None = default
    study_storage: str | None = None     # Optuna storage URL or journal file; None = journal in cache
    study_name: str | None = None
    resume: bool = False
    sampler: str = "tpe"
    multi_objective: bool = False
    runner: str = "gpu"
    timeout_s: float = 180.0
    seed: int = 0
    gate: float = 1.25
    reps: int = 20
    inputs: str | None = None            # captured q, k, v (.pt / .safetensors): the one shape tuned
    input_family: str = "gaussian"       # random inputs' family for the accuracy gate (kernels.inputs)
    precompile: bool = False             # compile the next trial's kernel in a CPU process while the GPU
                                         # measures (zyfa_tune.tuning.precompile); opt-in until it measures faster
    enqueue: tuple[str, ...] = ()        # configs to measure first, as 'key=val,...' changes to the
                                         # head dims' default (what `--ours` / `--set` take)
    warm_start: tuple[str, ...] = ()     # tuning databases (path or URL) whose best configs of these
                                         # head dims, on any shape, are measured next (see warm_configs)
    api: str = "fp8"                     # "fp8": the kernel alone on plain codes; "bf16": the whole call
                                         # from bf16 inputs, the quantiser's recipe searched beside the kernel

    def __post_init__(self) -> None:
        if self.dtype not in ("fp8", "bf16"):
            raise ValueError(f"dtype: {self.dtype!r} is not 'fp8' or 'bf16'")
        if self.api not in APIS:
            raise ValueError(f"api: {self.api!r} is not one of {list(APIS)}")
        if self.api == "bf16" and self.dtype != "fp8":
            raise ValueError("api: 'bf16' quantises bf16 inputs to FP8 codes: its kernels are dtype 'fp8'")
        for name in ("head_dim_qk", "head_dim_v"):
            if getattr(self, name) not in HEAD_DIMS:
                raise ValueError(f"{name}: {getattr(self, name)} is not one of {list(HEAD_DIMS)}")
        check_input_family(self.input_family, self.inputs, what="input_family")
        if self.inputs is not None:
            if self.seqlens:
                raise ValueError("seqlens: the shape comes from --inputs; give one or the other")
            _ = self.shapes  # load and check the file now, not in the middle of a study
        elif not self.seqlens or any(not isinstance(s, int) or s < 1 for s in self.seqlens):
            raise ValueError(f"seqlens: expected positive integers, got {self.seqlens!r}")
        if self.batches is not None and len(self.batches) != len(self.seqlens):
            raise ValueError("batches: give one batch size per seqlen")
        kv = self.kv_heads or self.heads
        if self.heads < 1 or kv < 1 or self.heads % kv:
            raise ValueError(f"kv_heads: {kv} must divide heads={self.heads}")
        if self.trials is None and self.time_budget_s is None:
            raise ValueError("trials / time_budget_s: give at least one")
        if self.trials is not None and self.trials < 1:
            raise ValueError(f"trials: expected >= 1, got {self.trials}")
        if self.sampler not in SAMPLERS:
            raise ValueError(f"sampler: {self.sampler!r} is not one of {list(SAMPLERS)}")
        if not self.gpus:
            raise ValueError("gpus: need at least one")
        parse_runner(self.runner)  # ValueError naming the runner
        if isinstance(self.gate, bool) or not isinstance(self.gate, (int, float)) \
                or not math.isfinite(self.gate) or self.gate < 1.0:
            raise ValueError(f"gate: expected a finite number >= 1 (allowed error / the exact reference's), "
                             f"got {self.gate!r}")
        _ = self.enqueued, self.warm_configs  # parse and check the configs now, not after the study has started

    @functools.cached_property
    def enqueued(self) -> tuple[KernelConfig, ...]:
        """The `enqueue` configs, each a point of the family's space that fits statically."""
        from zyfa_tune.generator.defaults import config_with, parse_changes

        _check_texts("enqueue", self.enqueue, "'key=val,...' strings")
        space, out = get_space(self.dtype), []
        for text in self.enqueue:
            try:
                cfg = config_with(self.dtype, self.head_dim_qk, self.head_dim_v, parse_changes([text], "enqueue"))
                space.as_optuna_params(cfg)
            except ValueError as exc:  # ConfigError is one
                raise ValueError(f"enqueue {text!r}: {exc}") from exc
            reason = space.feasible(cfg)
            if reason is not None:
                raise ValueError(f"enqueue {text!r}: does not fit: {reason}")
            out.append(cfg)
        return tuple(out)

    @functools.cached_property
    def warm_configs(self) -> tuple[KernelConfig, ...]:
        """The best configs that `warm_start` databases hold for this dtype, head-dim pair and
        causality, fastest first, each once and not already in `enqueued`. A kernel tuned at one
        sequence length or batch is often the best at its neighbours too, or a better start than the
        seeds: a study measures these before the sampler's own asks, and a shape tuned long ago
        gets the newer kernels its neighbours found (a 192/128 entry tuned without the two-P-tile
        kernel ran 0.95x FA3 at 32K; re-tuned from its neighbours' kernels, 1.07x). Entries outside
        the current search space or not fitting statically are skipped; a stored config is validated
        (`KernelConfig.from_json`) before anything reads it."""
        _check_texts("warm_start", self.warm_start, "database paths or URLs")
        space, out = get_space(self.dtype), []
        seen = {space.canonical(c).to_json() for c in self.enqueued}
        for target in self.warm_start:
            try:
                stored = stored_bests(space, target, self.head_dim_qk, self.head_dim_v, causal=self.causal,
                                      required=True)
            except DatabaseError as exc:
                raise ValueError(f"warm_start {target!r}: {exc}") from exc
            for cfg, _ in sorted(stored, key=lambda pair: -(pair[1] or 0.0)):
                try:
                    space.as_optuna_params(cfg)
                except ValueError:  # a point outside this space
                    continue
                if cfg.to_json() not in seen and space.feasible(cfg) is None:
                    seen.add(cfg.to_json())
                    out.append(cfg)
        return tuple(out)

    @functools.cached_property
    def shapes(self) -> tuple[Shape, ...]:
        if self.inputs is not None:
            from zyfa_tune.tuning.verify import load_activations

            q, k, v = load_activations(self.inputs)
            if (q.shape[3], v.shape[3]) != (self.head_dim_qk, self.head_dim_v):
                raise ValueError(f"inputs: head dims {q.shape[3]}/{v.shape[3]} in {self.inputs}, "
                                 f"but the study tunes {self.head_dim_qk}/{self.head_dim_v}")
            return (Shape(batch=q.shape[0], heads=q.shape[2], kv_heads=k.shape[2], seqlen=q.shape[1]),)
        kv = self.kv_heads or self.heads
        batches = self.batches or tuple(max(1, self.tokens // s) for s in self.seqlens)
        return tuple(Shape(batch=b, heads=self.heads, kv_heads=kv, seqlen=s) for b, s in zip(batches, self.seqlens))

    @property
    def name(self) -> str:
        """The study name; by default one study per input family (gaussian keeps the plain name)."""
        family = "" if self.input_family == "gaussian" else f"-{self.input_family}"
        api = "" if self.api == "fp8" else f"{self.api}api-"
        return self.study_name or \
            f"{api}{self.dtype}-{self.head_dim_qk}x{self.head_dim_v}-{'causal' if self.causal else 'full'}{family}"

    @property
    def inputs_label(self) -> str:
        """What the accuracy gate's inputs were, for the trial's provenance (no schema column)."""
        return f"file:{os.path.basename(self.inputs)}" if self.inputs is not None else self.input_family


def _check_texts(name: str, value: object, what: str) -> None:
    """A TuneSpec field that takes a sequence of strings (a bare string would be read per character)."""
    if isinstance(value, str) or not all(isinstance(t, str) for t in value):
        raise ValueError(f"{name}: expected a sequence of {what}, got {value!r}")


@dataclass
class Progress:
    """What the CLI shows while tuning (updated under a lock by the worker threads)."""

    done: int = 0
    by_status: dict[str, int] = field(default_factory=dict)
    best_value: float | None = None
    best_config: KernelConfig | None = None
    last_clock_mhz: float | None = None
    started: float = field(default_factory=time.time)
    by_gpu: dict[str, int] = field(default_factory=dict)  # measured trials per worker GPU


def parse_duration(text: str) -> float:
    """'90s', '15m', '2h', '1h30m' or plain seconds -> seconds."""
    text = text.strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    parts = re.findall(r"(\d+(?:\.\d+)?)([hms])", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"--time: cannot read {text!r}; use e.g. 90s, 15m, 1h30m")
    return sum(float(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in parts)


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
    return Fingerprint(gpu_name=f"{parse_runner(runner).kind} (no GPU)", compute_capability="9.0",
                       sm_count=HOPPER.sm_count, memory_bytes=1, driver="none", cuda="none", torch="none",
                       triton="none", generator_version=GENERATOR_VERSION)




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
    recipe: Recipe | None = None   # bf16-API studies only


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
        self._running: set[str] = set()    # config json of asked trials not finished yet
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
        study = optuna.create_study(study_name=self.spec.name, storage=storage, sampler=self._sampler(),
                                    directions=directions, load_if_exists=True)
        study.set_user_attr("spec", {f.name: getattr(self.spec, f.name) for f in dataclasses.fields(self.spec)})
        self._recover(study)
        for cfg in self.spec.enqueued + self.spec.warm_configs:  # first: WAITING trials run in the order
            study.enqueue_trial(self._params(cfg), skip_if_exists=True)  # they were enqueued
        if not exists:
            loose = self.spec.multi_objective or self.spec.gate >= LOOSE_GATE
            for cfg in study_seeds(self.space, self.spec.head_dim_qk, self.spec.head_dim_v, loose=loose):
                for recipe in SEED_RECIPES if self._recipes else (None,):
                    study.enqueue_trial(self._params(cfg, recipe), skip_if_exists=True)
        return study

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
            raise ValueError(f"study: {self.spec.name!r} already exists in {self.study_storage}; "
                             f"pass --resume to continue it or --study NAME for a new one")
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
            fresh = [(c, r) for c, r in near
                     if _config_key(c, r) not in self._seen and _config_key(c, r) not in self._running]
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
        task = Task(config_json=cfg.to_json(), shapes=self.spec.shapes, causal=self.spec.causal, seed=self.spec.seed,
                    gate=self.spec.gate, reps=self.spec.reps,  # probes cached per study
                    inputs=None if self.spec.inputs is None else os.path.abspath(self.spec.inputs),
                    input_family=self.spec.input_family, api=self.spec.api, recipe=asked.recipe)
        results = worker.run(task)
        keys = [ProblemKey.from_shape(dtype=cfg.dtype, head_dim_qk=cfg.head_dim_qk, head_dim_v=cfg.head_dim_v,
                                      causal=self.spec.causal, batch=shape.batch, heads=shape.heads,
                                      kv_heads=shape.kv_heads, seqlen=shape.seqlen, api=self.spec.api)
                for shape in self.spec.shapes]
        record_trials(store, fp, cfg, list(zip(keys, results)), source_hash=emit(cfg).source_hash,  # all or none
                      study=self.spec.name, provenance=f"study={self.spec.name} trial={trial.number} host={_HOST} "
                                                       f"gpu={worker.gpu} inputs={self.spec.inputs_label}")
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
            workers = [stack.enter_context(Worker(gpu=g, runner=self.spec.runner, timeout_s=self.spec.timeout_s))
                       for g in self.spec.gpus]
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
                    local = optuna.load_study(study_name=self.spec.name, storage=open_study_storage(self.study_storage),
                                              sampler=self._sampler())
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

            precompiler = Precompiler(self.spec.runner, [(sh.batch, sh.seqlen, sh.heads, sh.kv_heads)
                                                         for sh in self.spec.shapes], self.spec.causal,
                                      processes=len(self.spec.gpus), gpu=self.spec.gpus[0],
                                      compile_fn=self.precompile_fn)
        self.precompiler = precompiler
        threads = [threading.Thread(target=loop, args=(w, fp), name=f"zyfa-tune-gpu{w.gpu}")
                   for w, fp in zip(workers, fingerprints)]
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


def best_per_shape(spec: TuneSpec) -> list[dict]:
    """For the end-of-run table: per shape, the best stored entry and this study's result for the
    untuned kernel (`kernels.defaults.fallback_config`: what `flash_attn_func` runs with no tuned
    entry; a seed of every study, so measured first)."""
    from zyfa_tune.generator.defaults import fallback_config

    untuned_json = fallback_config(spec.dtype, spec.head_dim_qk, spec.head_dim_v).to_json()
    rows = []
    with open_store(spec.storage, readonly=True, create=False) as store:
        for shape in spec.shapes:
            pkey = ProblemKey.from_shape(dtype=spec.dtype, head_dim_qk=spec.head_dim_qk, head_dim_v=spec.head_dim_v,
                                         causal=spec.causal, batch=shape.batch, heads=shape.heads,
                                         kv_heads=shape.kv_heads, seqlen=shape.seqlen, api=spec.api)
            best = store.best_for(pkey)
            trials = store.trials(key=pkey, status="ok")
            untuned = [t for t in trials if t["config_json"] == untuned_json and t.get("study") == spec.name
                       and t.get("recipe") is None]
            rows.append(dict(shape=shape, key=pkey, best=best[0] if best else None,
                             untuned_tflops=max((t["tflops"] for t in untuned if t.get("tflops")), default=None)))
    return rows

