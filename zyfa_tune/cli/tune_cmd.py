"""`zyfa-tune tune`: an Optuna study over a family's search space, live progress, the best per shape."""

from __future__ import annotations

import argparse
import contextlib
import os
import time

from rich.table import Table

from zyfa_tune.generator import KernelConfig
from zyfa_tune.generator.recipe import Recipe

from .common import config_changes, console, int_list


def _gpus(text: str | None) -> tuple[int | None, ...]:
    """--gpus -> worker GPU indices ('all': every GPU present); `_check_gpus` then checks them."""
    if text is None:
        return (None,)
    if text == "all":
        n = _gpu_count()
        if n == 0:
            raise ValueError("--gpus all: no CUDA device is visible")
        return tuple(range(n))
    gpus = int_list(text, "--gpus")
    if not gpus:
        raise ValueError(f"--gpus: expected GPU indices or 'all', got {text!r}")
    if len(set(gpus)) != len(gpus):
        raise ValueError(f"--gpus: {text!r} names a GPU twice")
    if min(gpus) < 0:
        raise ValueError(f"--gpus: {min(gpus)} is not a GPU index")
    return gpus


def _check_gpus(gpus: tuple[int | None, ...], runner: str) -> None:
    """For runner "gpu": a GPU must be there, and every --gpus index one of them (for another runner
    the indices only label the workers)."""
    from zyfa_tune.tuning.runners import parse_runner

    if parse_runner(runner).kind != "gpu":
        return
    present = _gpu_count()
    if present == 0:
        raise ValueError(
            "--runner gpu: no CUDA GPU is visible on this machine; --runner simulate runs the "
            "tuning loop on the CPU (simulated numbers: for trying the loop, not for choosing kernels)"
        )
    missing = [str(g) for g in gpus if g is not None and g >= present]
    if missing:
        raise ValueError(
            f"--gpus: GPU {', '.join(missing)} not present (this machine has {present}: "
            f"{', '.join(map(str, range(present)))})"
        )


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


@contextlib.contextmanager
def _quiet_optuna():
    """Optuna's per-trial INFO lines ("Trial 7 finished ...", "Skipping enqueue ...") would flood the
    terminal and tear the live table: only its warnings and errors reach the console meanwhile."""
    import optuna

    level = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        yield
    finally:
        optuna.logging.set_verbosity(level)


def _warm_start(given: list[str] | None) -> tuple[str, ...]:
    """--warm-start values -> databases: 'shipped' is the database shipped with zyfa-tune (also the
    default, where the package has it), 'none' turns the warm start off."""
    from pathlib import Path

    from zyfa_tune.tuning.runners import shipped_db

    if given is None:
        return (shipped_db(),) if Path(shipped_db()).is_file() else ()
    if "none" in given:
        if len(given) > 1:
            raise ValueError("--warm-start none: give it alone (it turns the warm start off)")
        return ()
    return tuple(shipped_db() if w == "shipped" else w for w in given)


def cmd_tune(args: argparse.Namespace) -> int:
    """Optuna study over the family's search space; results go to the tuning database."""
    from rich.live import Live

    from zyfa_tune.kernels import dispatch
    from zyfa_tune.tuning.lengths import parse_lengths
    from zyfa_tune.tuning.runners import parse_runner
    from zyfa_tune.tuning.spec import Progress, TuneSpec, parse_duration
    from zyfa_tune.tuning.tuner import Tuner, best_per_shape

    runner, gpus = args.runner, _gpus(args.gpus)
    _check_gpus(gpus, runner)  # a bad runner is named here too, before anything else is checked
    spec = TuneSpec(
        dtype=args.dtype,
        head_dim_qk=args.head_dim,
        head_dim_v=args.head_dim_v or args.head_dim,
        seqlens=() if args.inputs or args.lengths else int_list(args.seqlens, "--seqlens"),
        lengths=parse_lengths(args.lengths) if args.lengths else None,
        heads=args.heads,
        kv_heads=args.kv_heads,
        batches=int_list(args.batches, "--batches") if args.batches else None,
        causal=not args.non_causal,
        trials=args.trials,
        time_budget_s=parse_duration(args.time) if args.time else None,
        gpus=gpus,
        storage=args.storage,
        study_storage=args.study_storage,
        study_name=args.study,
        resume=args.resume,
        sampler=args.sampler,
        multi_objective=args.multi_objective,
        runner=runner,
        timeout_s=args.timeout,
        seed=args.seed,
        inputs=args.inputs,
        input_family=args.input_family,
        precompile=args.precompile,
        api=args.api,
        gate=args.gate if args.gate is not None else dispatch.FA3_PARITY if args.api == "bf16" else 1.25,
        enqueue=tuple(args.enqueue or ()),
        warm_start=_warm_start(args.warm_start),
    )

    def render(p: Progress) -> Table:
        t = Table(title=f"zyfa-tune {spec.name}: {len(spec.gpus)} worker(s), runner={spec.runner}")
        t.add_column("what")
        t.add_column("value", overflow="fold")
        t.add_row("trials done", f"{p.done}" + (f" / {spec.trials}" if spec.trials else ""))
        t.add_row("elapsed", f"{time.time() - p.started:.0f} s")
        t.add_row("best (geo-mean TFLOP/s)", f"{p.best_value:.1f}" if p.best_value else "-")
        if p.best_config is not None:
            t.add_row("best config", config_changes(p.best_config))
        t.add_row("by status", ", ".join(f"{k}={v}" for k, v in sorted(p.by_status.items())) or "-")
        t.add_row("SM clock", f"{p.last_clock_mhz:.0f} MHz" if p.last_clock_mhz else "-")
        if len(spec.gpus) > 1:
            t.add_row("measured per GPU", ", ".join(f"gpu {g}: {n}" for g, n in sorted(p.by_gpu.items())) or "-")
        return t

    if parse_runner(spec.runner).kind != "gpu":
        console.print(f"runner {spec.runner} simulates its measurements: results go to {spec.storage}", markup=False)
    if spec.warm_start:
        console.print(
            f"warm start: {len(spec.warm_configs)} stored best config(s) of {spec.head_dim_qk}/"
            f"{spec.head_dim_v} {spec.dtype} from {', '.join(spec.warm_start)} measured first"
        )
    tuner = Tuner(spec)
    with _quiet_optuna(), Live(render(tuner.progress), console=console, refresh_per_second=2, transient=False) as live:
        tuner.on_progress = lambda p: live.update(render(p))
        study = tuner.run()
    _print_failures(study)
    console.print(
        f"study storage: {tuner.study_storage}  (optuna-dashboard {tuner.study_storage}; "
        f"zyfa-tune trials --study {spec.name} --study-storage {tuner.study_storage})"
    )
    table = Table(title="best kernel per shape (tuning database) vs the untuned kernel")
    for col in ("shape", "best TFLOP/s", "untuned TFLOP/s", "speed-up", "best config"):
        table.add_column(col, overflow="fold")
    for row in best_per_shape(spec):
        sh, best, dflt = row["shape"], row["best"], row["untuned_tflops"]
        best_tf = best.tflops if best else None
        table.add_row(
            str(sh) if sh.lengths else f"B={sh.batch} S={sh.seqlen} H={sh.heads}/{sh.kv_heads}",
            f"{best_tf:.1f}" if best_tf else "-",
            f"{dflt:.1f}" if dflt else "-",
            f"{best_tf / dflt:.2f}x" if best_tf and dflt else "-",
            _described(best),
        )
    console.print(table)
    return 0


def _described(best) -> str:
    """A best entry's config as changes from the default, and its recipe where it has one."""
    if best is None:
        return "-"
    text = config_changes(KernelConfig.from_json(best.config_json))
    return text if best.recipe is None else f"{text}; recipe {Recipe.from_json(best.recipe).summary()}"


def _print_failures(study) -> None:
    """The most frequent reasons this run's measurements failed, counted (the whole messages:
    `zyfa-tune trials --status ...`)."""
    from zyfa_tune.tuning.trials import failure_summary, trial_row

    mine = [trial_row(t) for t in study.get_trials(deepcopy=False) if t.user_attrs.get("pid") == os.getpid()]
    top = failure_summary(mine)
    if not top:
        return
    table = Table(title="most frequent failures of this run")
    for col in ("count", "status", "reason"):
        table.add_column(col, overflow="fold")
    for outcome, reason, n in top:
        table.add_row(str(n), outcome, reason)
    console.print(table)


def register(sub) -> None:
    p = sub.add_parser("tune", help="search kernel configs with Optuna; store the fastest correct per shape")
    p.add_argument("--dtype", choices=["fp8", "bf16"], default="fp8", help="kernel dtype: FP8 e4m3 in, or BF16")
    p.add_argument("--head-dim", type=int, required=True, help="head dim of Q and K (and V unless --head-dim-v)")
    p.add_argument("--head-dim-v", type=int, default=None, help="head dim of V where it differs (e.g. 192/128)")
    p.add_argument("--seqlens", default="4096,8192,16384", help="comma list of sequence lengths")
    p.add_argument(
        "--lengths",
        default=None,
        metavar="SPEC",
        help="tune packed sequences (flash_attn_varlen_func: Gluon and Triton kernels) of one length mix instead of "
        "--seqlens: a comma list (128,512,8192), a file of lengths (one per line, or a .json list), or a "
        "named mix: chat (64 sequences of 128 to 8K, ~128K tokens) or long-doc (8 of 8K to 32K)",
    )
    p.add_argument(
        "--inputs",
        default=None,
        metavar="FILE",
        help="tune on captured activations: a .pt or .safetensors file of q, k, v (batch, seqlen, heads, dim)",
    )
    from zyfa_tune.tuning.inputs import FAMILY_NAMES

    p.add_argument(
        "--input-family",
        default="gaussian",
        metavar="NAME",
        help=f"activation-like random inputs for the accuracy gate: {', '.join(FAMILY_NAMES)} "
        "(docs/design.md; default gaussian)",
    )
    p.add_argument("--heads", type=int, default=32, help="query heads of the tuned shapes")
    p.add_argument("--kv-heads", type=int, default=None, help="KV heads (GQA; default: = heads)")
    p.add_argument("--batches", default=None, help="one batch size per seqlen (default: 16384 tokens / seqlen)")
    p.add_argument("--non-causal", action="store_true", help="attention without the causal mask")
    p.add_argument("--trials", type=int, default=None, help="trials to run (40 if neither --trials nor --time)")
    p.add_argument("--time", default=None, help="time budget, e.g. 15m (default: --trials only; 40 trials if neither)")
    p.add_argument("--gpus", default=None, help="comma list of GPU indices, or 'all' (one worker per GPU)")
    p.add_argument("--storage", default=None, help="tuning database path or SQLAlchemy URL")
    p.add_argument("--study-storage", default=None, help="Optuna storage: RDB URL or journal file")
    p.add_argument("--study", default=None, help="study name (default: <dtype>-<dqk>x<dv>-causal)")
    p.add_argument("--resume", action="store_true", help="continue an existing study")
    p.add_argument("--sampler", choices=["tpe", "random"], default="tpe", help="Optuna sampler")
    p.add_argument("--multi-objective", action="store_true", help="Pareto front over (TFLOP/s, error)")
    p.add_argument(
        "--api",
        choices=["fp8", "bf16"],
        default="fp8",
        help="what is timed: fp8 (default; flash_attn_func, the kernel alone on plainly quantised FP8 "
        "codes) or bf16 (attention(): bf16 inputs, the quantiser's recipe searched beside the "
        "kernel, quantiser and kernel timed together; FP8 kernels)",
    )
    p.add_argument(
        "--gate",
        type=float,
        default=None,
        help="accuracy gate: a kernel passes with rel. L2 error <= GATE x the reference's on the same "
        "inputs (FA3-fp8's where fa3_fwd_interface imports, else the exact default kernel's on "
        "plain codes; default 1.25 for --api fp8, where lean P measures ~1.35 and a gate >= 1.4 "
        "also seeds the lean kernel; 1.01 for --api bf16, attention()'s default error budget: FA3's "
        "error within 1%%)",
    )
    p.add_argument(
        "--runner",
        default="gpu",
        help="gpu (default) | simulate[:<db>]: the loop without a GPU, for trying it out and for tests "
        "(real sm_90a compiles; stored measurements of the database, by default the shipped one, "
        "else a synthetic model: never a basis for choosing kernels); 'replay' is an older name "
        "for simulate",
    )
    p.add_argument("--timeout", type=float, default=180.0, help="seconds per trial before the worker is killed")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (and sampler)")
    p.add_argument(
        "--precompile",
        action="store_true",
        help="compile the next trial's kernel in a separate process while the GPU measures",
    )
    p.add_argument(
        "--enqueue",
        action="append",
        metavar="KEY=VAL,...",
        help="measure this config first (fields changed from the head dims' default, as in "
        "bench --ours; repeatable; also with --resume)",
    )
    p.add_argument(
        "--warm-start",
        action="append",
        metavar="DB",
        help="measure first (after --enqueue) the best configs this tuning database (path or URL; "
        "'shipped': the one shipped with zyfa-tune, the default) holds for these head dims on "
        "any shape; repeatable; 'none' for no warm start",
    )
    p.set_defaults(fn=cmd_tune)
