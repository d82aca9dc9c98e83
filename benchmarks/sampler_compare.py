"""TPE against random sampling at equal trial counts: does the tuner's sampler earn its keep.

Runs the same tuning spec twice through the tuner (`zyfa_tune.tuning.tuner.Tuner`), once with
`--sampler tpe` and once with `--sampler random`, each with its own study name, study journal and
tuning database (so neither sees the other's trials), then prints the best TFLOP/s so far per
shape after each trial for both, and the trial at which each came within 2% of its own final best.

    python benchmarks/sampler_compare.py --head-dim 128 --trials 40 --json out.json           # GPU
    python benchmarks/sampler_compare.py --trials 12 --runner replay                          # CPU

Per-shape numbers come from trials whose every shape passed (the tuner's objective is their
geometric mean, also shown as "geo"); failed, infeasible and repeated trials count as trials but
move no curve. By default neither study gets the tuner's seed configs (the default config and the
shipped database's winners, ~8 for fp8 hd128): they would be the first trials of both studies
alike, so the samplers would only differ after them; --seeds enqueues them as `zyfa-tune tune` does.
With the same --seed, TPE's first 10 trials (Optuna's n_startup_trials, drawn by its internal
random sampler) are the random study's first 10 as well: a paired comparison, the curves part where
TPE starts modelling. Run several --seed values before concluding anything.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass

import optuna
from rich.console import Console
from rich.table import Table

from zyfa_tune.cli.common import int_list as _int_list
from zyfa_tune.search_spaces import SearchSpace
from zyfa_tune.tuning.runners import shipped_db
from zyfa_tune.tuning.spec import SAMPLERS, TuneSpec
from zyfa_tune.tuning.tuner import Tuner

WITHIN = 0.02


class _Unseeded(SearchSpace):
    """The same space with no seed configs: the sampler alone picks every trial."""

    def seeds(self, head_dim_qk: int, head_dim_v: int, **_: object) -> list:
        return []


@dataclass(frozen=True)
class Curve:
    """Best TFLOP/s so far after each finished trial (None until a trial of that shape passed)."""

    sampler: str
    study: str
    shapes: tuple[str, ...]  # "geo" last: the tuner's objective
    best_so_far: tuple[tuple[float | None, ...], ...]  # [shape][trial]
    states: tuple[str, ...]  # per trial: COMPLETE / FAIL / PRUNED
    elapsed_s: float

    @property
    def final(self) -> tuple[float | None, ...]:
        return tuple(c[-1] if c else None for c in self.best_so_far)

    def reached(self, within: float = WITHIN) -> tuple[int | None, ...]:
        """Per shape, the first trial (1-based) whose best so far is within `within` of the final."""
        out = []
        for c, final in zip(self.best_so_far, self.final):
            out.append(
                None
                if final is None
                else next(i + 1 for i, v in enumerate(c) if v is not None and v >= (1 - within) * final)
            )
        return tuple(out)


def curve(study: optuna.Study, spec: TuneSpec, elapsed_s: float) -> Curve:
    """Read the study's finished trials in order; per-shape TFLOP/s are the `tflops` user attr."""
    labels = tuple(f"B={s.batch} S={s.seqlen}" for s in spec.shapes) + ("geo",)
    trials = sorted((t for t in study.get_trials(deepcopy=False) if t.state.is_finished()), key=lambda t: t.number)
    best: list[float | None] = [None] * len(labels)
    columns: list[list[float | None]] = [[] for _ in labels]
    for t in trials:
        tflops = t.user_attrs.get("tflops")
        if t.state == optuna.trial.TrialState.COMPLETE and tflops and len(tflops) == len(labels) - 1:
            values = [*tflops, math.exp(sum(math.log(v) for v in tflops) / len(tflops))]
            best = [v if b is None else max(b, v) for b, v in zip(best, values)]
        for col, b in zip(columns, best):
            col.append(b)
    return Curve(
        spec.sampler, spec.name, labels, tuple(map(tuple, columns)), tuple(t.state.name for t in trials), elapsed_s
    )


def run_sampler(base: TuneSpec, sampler: str, workdir: str, *, seeds: bool = True) -> Curve:
    """One study with this sampler in its own folder of `workdir`."""
    folder = os.path.join(workdir, sampler)
    os.makedirs(folder, exist_ok=True)
    spec = dataclasses.replace(
        base,
        sampler=sampler,
        study_name=f"{base.name}-{sampler}",
        storage=os.path.join(folder, "tuning.db"),
        study_storage=os.path.join(folder, "study.journal"),
    )
    tuner = Tuner(spec)
    if not seeds:
        tuner.space = _Unseeded(tuner.space.family, tuner.space.dtype, tuner.space.params)
    started = time.time()
    study = tuner.run()
    return curve(study, spec, time.time() - started)


def report(curves: list[Curve], within: float = WITHIN) -> dict:
    """The JSON written by --json: every curve with its final bests and 2% trials."""
    return {
        "within": within,
        "samplers": {
            c.sampler: {**dataclasses.asdict(c), "final": c.final, "reached": c.reached(within)} for c in curves
        },
    }


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def print_report(curves: list[Curve], within: float, console: Console) -> None:
    shapes = curves[0].shapes
    per_trial = Table(title="best TFLOP/s so far after each trial")
    per_trial.add_column("trial", justify="right")
    for c in curves:
        for s in shapes:
            per_trial.add_column(f"{c.sampler} {s}", justify="right")
    for i in range(max(len(c.states) for c in curves)):
        cells = [str(i + 1)]
        for c in curves:
            cells += [_fmt(col[i]) if i < len(col) else "" for col in c.best_so_far]
        per_trial.add_row(*cells)
    console.print(per_trial)
    summary = Table(title=f"final best and the trial that came within {within:.0%} of it")
    summary.add_column("shape")
    for c in curves:
        summary.add_column(f"{c.sampler} best", justify="right")
        summary.add_column(f"{c.sampler} trial", justify="right")
    for j, s in enumerate(shapes):
        cells = [s]
        for c in curves:
            reached = c.reached(within)[j]
            cells += [_fmt(c.final[j]), "-" if reached is None else f"{reached} / {len(c.states)}"]
        summary.add_row(*cells)
    console.print(summary)
    for c in curves:
        console.print(
            f"{c.sampler}: study {c.study}, {len(c.states)} trials in {c.elapsed_s:.0f} s "
            f"({', '.join(f'{s}={c.states.count(s)}' for s in sorted(set(c.states)))})"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", choices=["fp8", "bf16"], default="fp8")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--head-dim-v", type=int, default=None)
    ap.add_argument("--seqlens", default="4096,8192,16384")
    ap.add_argument("--batches", default=None, help="one batch per seqlen (default: 16384 tokens / seqlen)")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--trials", type=int, default=40, help="trials per sampler (the same for both)")
    ap.add_argument("--runner", default="gpu", help="gpu | replay (the shipped H200 measurements) | replay:<db>")
    ap.add_argument(
        "--seeds",
        action="store_true",
        help="enqueue the tuner's seed configs first in both studies (default: the samplers alone)",
    )
    ap.add_argument("--workdir", default=None, help="folder for the two studies (default: a new temporary one)")
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds per trial")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--within", type=float, default=WITHIN, help="closeness to the final best (0.02 = 2%%)")
    ap.add_argument("--json", default=None, help="write both curves here")
    a = ap.parse_args(argv)
    runner = f"replay:{shipped_db()}" if a.runner == "replay" else a.runner
    workdir = a.workdir or tempfile.mkdtemp(prefix="sampler-compare-")
    console = Console()
    console = console if console.is_terminal else Console(width=200)  # logs: a line per trial
    try:
        base = TuneSpec(
            dtype=a.dtype,
            head_dim_qk=a.head_dim,
            head_dim_v=a.head_dim_v or a.head_dim,
            seqlens=_int_list(a.seqlens, "--seqlens"),
            heads=a.heads,
            batches=_int_list(a.batches, "--batches") if a.batches else None,
            trials=a.trials,
            runner=runner,
            timeout_s=a.timeout,
            seed=a.seed,
            study_name=f"compare-{a.dtype}-{a.head_dim}x{a.head_dim_v or a.head_dim}",
        )
        console.print(f"studies in {workdir}")
        curves = [run_sampler(base, s, workdir, seeds=a.seeds) for s in SAMPLERS]
    except ValueError as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 2
    print_report(curves, a.within, console)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(
                {
                    "spec": {
                        "dtype": base.dtype,
                        "head_dims": [base.head_dim_qk, base.head_dim_v],
                        "shapes": [dataclasses.asdict(s) for s in base.shapes],
                        "trials": base.trials,
                        "runner": runner,
                        "seeds": a.seeds,
                        "seed": base.seed,
                    },
                    **report(curves, a.within),
                },
                fh,
                indent=1,
            )
        console.print(f"results: {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
