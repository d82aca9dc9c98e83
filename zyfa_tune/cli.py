"""`zyfa-tune` command line.

    zyfa-tune tune    --head-dim 96 [--dtype fp8] --seqlens 2048,8192 [--trials N | --time 15m] [--gpus 0,1|all]
    zyfa-tune compile [--dtype fp8] [--head-dim 128] [--set key=val ...]   # no GPU needed
    zyfa-tune check   [--dtype fp8] [--head-dim 128] [--seqlen 4096]        # GPU: vs float64
    zyfa-tune timeline [--head-dim 128] [--set key=val ...] [--seqlen 8192]  # GPU: where a step's cycles go
    zyfa-tune show    [--storage DB]            # what a database holds
    zyfa-tune best    [--storage DB] [--gpu NAME] [--head-dim D]
    zyfa-tune export  OUT.db [--storage DB] [--gpu NAME] [--head-dim D] [--all-trials]
    zyfa-tune import  SRC.db [--storage DB]     # alias: merge; keeps the faster entry per key
    zyfa-tune verify  [--storage DB] [--margin 0.1] [--dtype D] [--head-dim N]   # GPU: re-check best kernels
    zyfa-tune bench   [--dtype fp8] [--head-dim 128] --seqlens 4096,8192 [--peers ...] [--json F] [--plot F.png]
    zyfa-tune bench   --from results.json --plot out.png      # redraw a saved run, no GPU needed
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from zyfa_tune.generator import ConfigError, KernelConfig, emit

console = Console()


def _config(args: argparse.Namespace) -> KernelConfig:
    from zyfa_tune.kernels.defaults import config_with, parse_changes

    changes = parse_changes(args.set or [], "--set")
    return config_with(args.dtype, args.head_dim, args.head_dim_v or args.head_dim, changes)


def cmd_compile(args: argparse.Namespace) -> int:
    """Compile a config for sm_90a without a GPU and report its resources."""
    from zyfa_tune.generator.build import compile_for_target

    cfg = _config(args)
    kernel = emit(cfg)
    art = compile_for_target(kernel, causal=not args.non_causal)
    table = Table(title=f"{kernel.kernel_name} {kernel.source_hash}")
    table.add_column("what")
    table.add_column("value", justify="right")
    for name, value in (("registers / thread", art.registers), ("spill bytes / thread", art.spill_bytes),
                        ("shared memory (bytes)", art.shared_bytes),
                        ("QGMMA / HGMMA", f"{art.count('QGMMA')} / {art.count('HGMMA')}"),
                        ("MUFU.EX2", art.count("MUFU.EX2")), ("USETMAXREG", art.count("USETMAXREG")),
                        ("wgmma serialised by ptxas", art.serialised_wgmma or "no")):
        table.add_row(name, escape(str(value)))
    console.print(table)
    console.print(json.dumps(cfg.to_dict(), sort_keys=True))
    if args.source:
        console.print(kernel.source, markup=False, highlight=False)
    return 1 if art.spill_bytes or art.serialised_wgmma else 0


def cmd_check(args: argparse.Namespace) -> int:
    """Run the kernel on fresh random inputs and compare with float64 attention."""
    import torch

    from zyfa_tune import flash_attn_func
    from zyfa_tune.kernels.reference import attention_reference, rel_l2
    from zyfa_tune.kernels.verify import make_inputs

    if not torch.cuda.is_available():
        console.print("[red]check needs a CUDA GPU[/red]")
        return 2
    cfg = _config(args)
    b, s, h = args.batch, args.seqlen, args.heads
    (q, k, v), kw = make_inputs(cfg.dtype, cfg.head_dim_qk, cfg.head_dim_v, batch=b, heads=h, kv_heads=h,
                                seqlen=s, seed=args.seed)
    out = flash_attn_func(q, k, v, causal=True, config=cfg, **kw)
    err = rel_l2(out, attention_reference(q, k, v, causal=True, **kw))
    console.print(f"rel. L2 error vs float64: {err:.4e}  ({cfg.dtype} {cfg.head_dim_qk}/{cfg.head_dim_v} "
                  f"B={b} S={s} H={h}, softmax={cfg.softmax})")
    return 0 if err < args.max_error else 1


def cmd_timeline(args: argparse.Namespace) -> int:
    """Clock stamps of one launch (CTA 0): median cycles of each phase of a consumer step."""
    import torch

    from zyfa_tune.kernels import timeline
    from zyfa_tune.kernels.verify import make_inputs

    if not torch.cuda.is_available():
        console.print("[red]timeline needs a CUDA GPU[/red]")
        return 2
    if not any(item.startswith("backend=") for item in args.set or []):
        args.set = ["backend=gluon", *(args.set or [])]  # the instrumented backend: Gluon's default config
    cfg = _config(args)
    (q, k, v), kw = make_inputs(cfg.dtype, cfg.head_dim_qk, cfg.head_dim_v, batch=args.batch, heads=args.heads,
                                kv_heads=args.heads, seqlen=args.seqlen, seed=args.seed)
    tl = timeline.record(cfg, q, k, v, causal=not args.non_causal, steps=args.steps, timed_reps=args.timed_reps,
                         **kw)
    console.print(f"{cfg.summary()}  B={args.batch} S={args.seqlen} H={args.heads}: CTA 0, cycles per step phase")
    if tl.stamp_cost() is not None:
        console.print(f"traced launch {tl.traced_ms:.4f} ms, the same kernel without stamps {tl.plain_ms:.4f} ms: "
                      f"the stamps cost {tl.stamp_cost():+.1%} (medians of {args.timed_reps}; compare variants' "
                      f"speed with `zyfa-tune bench`, not their periods here)")
    for w in range(tl.clocks.shape[0]):
        table = Table(title=f"consumer warpgroup {w}: step period median {tl.period(w):.0f} cycles")
        for col in ("from", "to", "median", "p10", "p90", "steps"):
            table.add_column(col, justify="right" if col not in ("from", "to") else "left")
        for ph in tl.phases(w):
            table.add_row(ph.start, ph.end, f"{ph.median:.0f}", f"{ph.p10:.0f}", f"{ph.p90:.0f}", str(ph.steps))
        console.print(table)
    for w in range(1, tl.clocks.shape[0]):
        il = tl.interleave(w)
        console.print(f"warpgroup {w}: a step starts {il.offset:.0f} cycles after warpgroup 0's ({il.offset_share:.0%} "
                      f"of its period; ping-pong's aim with two consumers: 50%), its softmax beside warpgroup 0's "
                      f"for {il.softmax_overlap:.0%} of that softmax ({il.steps} steps)")
    if args.sample is not None:
        for w, step, events in tl.sample(args.sample):
            console.print(f"warpgroup {w} step {step}: " + "  ".join(f"{e}={c}" for e, c in events.items()))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"config": cfg.to_dict(), "shape": [args.batch, args.seqlen, args.heads],
                       "events": list(timeline.EVENTS), "clocks": tl.clocks.tolist(),
                       "traced_ms": tl.traced_ms, "plain_ms": tl.plain_ms}, fh)
        console.print(f"stamps: {args.json}")
    return 0


def _store(args: argparse.Namespace, *, readonly: bool = False):
    from zyfa_tune.db import open_store

    return open_store(args.storage, readonly=readonly, create=not readonly)


def _head_dims(args: argparse.Namespace) -> tuple[int, int] | None:
    if args.head_dim is None:
        return None
    return args.head_dim, args.head_dim_v or args.head_dim


def _best_table(entries, title: str) -> Table:
    table = Table(title=title)
    for col in ("GPU", "dtype", "dqk/dv", "causal", "group", "seqlen<=", "B*H<=", "ms", "TFLOP/s", "rel.L2",
                "config", "provenance"):
        table.add_column(col, overflow="fold")
    for e in entries:
        k = e.key
        try:
            cfg = KernelConfig.from_json(e.config_json)
            summary = cfg.summary()
        except ConfigError as exc:
            summary = f"[red]invalid: {exc}[/red]"
        table.add_row(e.fingerprint.gpu_name, k.dtype, f"{k.head_dim_qk}/{k.head_dim_v}", str(k.causal),
                      str(k.gqa_group), str(k.seqlen_bucket), str(k.bh_bucket), f"{e.median_ms:.3f}",
                      f"{e.tflops:.0f}" if e.tflops else "-",
                      f"{e.error_rel_l2:.2e}" if e.error_rel_l2 is not None else "-", summary, e.provenance)
    return table


def cmd_show(args: argparse.Namespace) -> int:
    """Counts per status and the best entries of a database."""
    from zyfa_tune.db import TRIAL_STATUSES

    with _store(args, readonly=True) as store:
        console.print(f"[bold]{store.url}[/bold]")
        counts = Table(title="trials")
        counts.add_column("status")
        counts.add_column("count", justify="right")
        for status in TRIAL_STATUSES:
            counts.add_row(status, str(store.count_trials(status=status)))
        console.print(counts)
        console.print(_best_table(store.best_entries(), "best per (GPU, problem class)"))
    return 0


def cmd_best(args: argparse.Namespace) -> int:
    with _store(args, readonly=True) as store:
        entries = store.best_entries(gpu_name=args.gpu, head_dims=_head_dims(args), dtype=args.dtype)
        console.print(_best_table(entries, f"best entries in {store.url}"))
    return 0 if entries else 1


def cmd_export(args: argparse.Namespace) -> int:
    with _store(args, readonly=True) as store:
        n = store.export(args.out, gpu_name=args.gpu, head_dims=_head_dims(args), best_only=not args.all_trials)
    console.print(f"exported {n} rows to {args.out}")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    with _store(args) as store:
        report = store.import_from(args.source)
    console.print(f"accepted {report.accepted} rows; best entries replaced {report.replaced}, kept {report.kept}")
    if report.rejected:
        table = Table(title=f"rejected rows ({len(report.rejected)})")
        table.add_column("row", overflow="fold")
        table.add_column("reason", overflow="fold")
        for row, reason in report.rejected:
            table.add_row(row, reason)
        console.print(table)
    return 1 if report.rejected else 0


def _clocks(now: float | None, stored: float | None) -> str:
    """`zyfa-tune verify`'s clock cell: the SM clock of this timing and, in brackets, of the stored one."""
    cell = f"{now:.0f}" if now else "-"
    return f"{cell} ({stored:.0f})" if stored else cell


def cmd_verify(args: argparse.Namespace) -> int:
    """Re-run this GPU's stored best kernels against float64 and time them again."""
    import torch

    from zyfa_tune.db import current_fingerprint
    from zyfa_tune.kernels.verify import verify_entry

    if not torch.cuda.is_available():
        console.print("[red]verify needs a CUDA GPU[/red]")
        return 2
    here = current_fingerprint().device_key()
    with _store(args, readonly=True) as store:
        entries = [e for e in store.best_entries(head_dims=_head_dims(args), dtype=args.dtype)
                   if e.fingerprint.device_key() == here]
    table = Table(title=f"verify on {here[0]}: {len(entries)} entries")
    for col in ("problem", "stored ms", "now ms", "slowdown", "SM MHz now (stored)", "rel.L2", "verdict"):
        table.add_column(col)
    failed = 0
    for e in entries:
        r = verify_entry(e, max_slowdown=args.margin, fresh_ms=_fresh_process_ms)
        failed += not r.ok
        table.add_row(str(e.key), f"{e.median_ms:.3f}", f"{r.median_ms:.3f}" if r.median_ms else "-",
                      f"{r.slowdown:+.1%}" if r.slowdown is not None else "-",
                      # (mean NVML clocks while timed: a slow reading at a sagging clock is the card's)
                      _clocks(r.timing.sm_clock_mhz if r.timing else None, e.sm_clock_mhz),
                      f"{r.error_rel_l2:.2e}" if r.error_rel_l2 is not None else "-",
                      (f"[green]ok[/green] ({r.reason})" if r.reason else "[green]ok[/green]") if r.ok
                      else f"[red]{r.reason}[/red]")
    console.print(table)
    return 1 if failed else 0


def _fresh_process_ms(entry) -> float | None:
    """The median of a stored entry's kernel timed by a new worker process (None if it failed there)."""
    from zyfa_tune.kernels.verify import entry_shape
    from zyfa_tune.worker import Shape, time_in_fresh_process

    r = time_in_fresh_process(entry.config_json, Shape(*entry_shape(entry)), causal=entry.key.causal)
    return r.median_ms if r.status == "ok" else None


def _int_list(text: str, what: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{what}: expected comma-separated integers, got {text!r}") from None


def _gpus(text: str | None) -> tuple[int | None, ...]:
    if text is None:
        return (None,)
    if text == "all":
        import torch

        n = torch.cuda.device_count()
        if n == 0:
            raise ValueError("--gpus all: no CUDA device is visible")
        return tuple(range(n))
    return _int_list(text, "--gpus")


def config_changes(config: KernelConfig) -> str:
    """The fields where `config` differs from the default config of its dtype, head dims and backend
    (a Gluon config is named as such: "backend=gluon" first)."""
    from zyfa_tune.kernels.defaults import default_config

    base = default_config(config.dtype, config.head_dim_qk, config.head_dim_v, config.backend).all_fields()
    changed = [f"{k}={v}" for k, v in config.to_dict().items() if base[k] != v]
    if config.backend != "triton":
        return " ".join([f"backend={config.backend}", *changed])
    return " ".join(changed) or "(the default config)"


def _warm_start(given: list[str] | None) -> tuple[str, ...]:
    """--warm-start values -> databases: 'shipped' is the database shipped with zyfa-tune (also the
    default, where the package has it), 'none' turns the warm start off."""
    from pathlib import Path

    from zyfa_tune.runners import shipped_db

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

    from zyfa_tune.tune import Progress, Tuner, TuneSpec, best_per_shape, parse_duration

    runner = args.runner
    if runner == "replay":  # the shipped H200 measurements
        from zyfa_tune.runners import shipped_db

        runner = f"replay:{shipped_db()}"
    spec = TuneSpec(dtype=args.dtype, head_dim_qk=args.head_dim, head_dim_v=args.head_dim_v or args.head_dim,
                    seqlens=() if args.inputs else _int_list(args.seqlens, "--seqlens"), heads=args.heads, kv_heads=args.kv_heads,
                    batches=_int_list(args.batches, "--batches") if args.batches else None,
                    causal=not args.non_causal, trials=args.trials,
                    time_budget_s=parse_duration(args.time) if args.time else None, gpus=_gpus(args.gpus),
                    storage=args.storage, study_storage=args.study_storage, study_name=args.study,
                    resume=args.resume, sampler=args.sampler, multi_objective=args.multi_objective,
                    runner=runner, timeout_s=args.timeout, seed=args.seed, inputs=args.inputs,
                    input_family=args.input_family, precompile=args.precompile, gate=args.gate,
                    enqueue=tuple(args.enqueue or ()),
                    warm_start=_warm_start(args.warm_start))

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

    if spec.warm_start:
        console.print(f"warm start: {len(spec.warm_configs)} stored best config(s) of {spec.head_dim_qk}/"
                      f"{spec.head_dim_v} {spec.dtype} from {', '.join(spec.warm_start)} measured first")
    tuner = Tuner(spec)
    with Live(render(tuner.progress), console=console, refresh_per_second=2, transient=False) as live:
        tuner.on_progress = lambda p: live.update(render(p))
        tuner.run()
    console.print(f"study storage: {tuner.study_storage}  (optuna-dashboard {tuner.study_storage})")
    table = Table(title="best kernel per shape (tuning database) vs the untuned kernel")
    for col in ("shape", "best TFLOP/s", "untuned TFLOP/s", "speed-up", "best config"):
        table.add_column(col, overflow="fold")
    for row in best_per_shape(spec):
        sh, best, dflt = row["shape"], row["best"], row["untuned_tflops"]
        best_tf = best.tflops if best else None
        table.add_row(f"B={sh.batch} S={sh.seqlen} H={sh.heads}/{sh.kv_heads}",
                      f"{best_tf:.1f}" if best_tf else "-", f"{dflt:.1f}" if dflt else "-",
                      f"{best_tf / dflt:.2f}x" if best_tf and dflt else "-",
                      config_changes(KernelConfig.from_json(best.config_json)) if best else "-")
    console.print(table)
    return 0


def _bench_plan(args: argparse.Namespace):
    """`zyfa-tune bench`'s BenchPlan: the dispatcher's pick per dtype (unless --no-dispatch), the
    --ours configs and the peers, on the shapes asked for."""
    from zyfa_tune import bench
    from zyfa_tune.kernels.inputs import FAMILY_NAMES

    dtypes = bench.DTYPES if args.dtype == "both" else (args.dtype,)
    shapes = (tuple(bench.parse_shape(s) for s in args.shape) if args.shape else
              bench.shapes_from(args.head_dim, args.head_dim_v, args.seqlens, args.batch_heads, args.kv_heads))
    ours = [] if args.no_dispatch else [bench.OursSpec(f"ours-{dt}", dt) for dt in dtypes]
    for text in args.ours or []:
        ours += bench.parse_ours(text, dtypes)
    return bench.BenchPlan(shapes=shapes, ours=tuple(ours), peers=bench.parse_peers(args.peers, dtypes),
                           reps=args.reps, seed=args.seed, rotate=args.rotate, rounds=args.rounds, warm_s=args.warm,
                           input_family=",".join(FAMILY_NAMES) if args.input_family == "all" else args.input_family,
                           quant=args.quant, energy_s=args.energy_s, ceiling=args.ceiling)


def cmd_bench(args: argparse.Namespace) -> int:
    """Ours (dispatcher + forced configs) against the peers on the same inputs; table, JSON, plot."""
    from zyfa_tune import bench, bench_report

    if args.plot:
        bench_report.require_matplotlib()
    if args.from_json:
        result = bench.BenchResult.load(args.from_json)
    else:
        import torch

        if not torch.cuda.is_available():
            console.print("[red]bench: no CUDA device is visible; measuring needs the GPU.[/red] "
                          "A saved run is redrawn without one: zyfa-tune bench --from results.json --plot out.png")
            return 2
        result = bench.run(_bench_plan(args), on_row=lambda r: console.print(bench_report.row_line(r), markup=False,
                                                                             highlight=False))
    wide = console if console.is_terminal else Console(width=200)  # logs: one line per row
    wide.print(bench_report.results_table(result))
    if args.json:
        result.save(args.json)
        console.print(f"results: {args.json}")
    if args.plot:
        console.print(f"plot: {bench_report.plot(result, args.plot)}")
    return 1 if any(r.error for r in result.rows if r.kind != "peer") else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="zyfa-tune", description="Autotuned FP8/BF16 attention for Hopper")
    sub = ap.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--dtype", choices=["fp8", "bf16"], default="fp8")
        p.add_argument("--head-dim", type=int, default=128)
        p.add_argument("--head-dim-v", type=int, default=None)
        p.add_argument("--set", action="append", metavar="KEY=VAL", help="override a config field")

    p = sub.add_parser("tune", help="search kernel configs with Optuna; store the fastest correct per shape")
    p.add_argument("--dtype", choices=["fp8", "bf16"], default="fp8")
    p.add_argument("--head-dim", type=int, required=True)
    p.add_argument("--head-dim-v", type=int, default=None)
    p.add_argument("--seqlens", default="4096,8192,16384")
    p.add_argument("--inputs", default=None, metavar="FILE",
                   help="tune on captured activations: a .pt or .safetensors file of q, k, v (batch, seqlen, heads, dim)")
    from zyfa_tune.kernels.inputs import FAMILY_NAMES

    p.add_argument("--input-family", default="gaussian", metavar="NAME",
                   help=f"activation-like random inputs for the accuracy gate: {', '.join(FAMILY_NAMES)} "
                        "(docs/ACCURACY.md; default gaussian)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--batches", default=None, help="one batch size per seqlen (default: 16384 tokens / seqlen)")
    p.add_argument("--non-causal", action="store_true")
    p.add_argument("--trials", type=int, default=None)
    p.add_argument("--time", default=None, help="time budget, e.g. 15m (default: --trials only; 40 trials if neither)")
    p.add_argument("--gpus", default=None, help="comma list of GPU indices, or 'all' (one worker per GPU)")
    p.add_argument("--storage", default=None, help="tuning database path or SQLAlchemy URL")
    p.add_argument("--study-storage", default=None, help="Optuna storage: RDB URL or journal file")
    p.add_argument("--study", default=None, help="study name (default: <dtype>-<dqk>x<dv>-causal)")
    p.add_argument("--resume", action="store_true", help="continue an existing study")
    p.add_argument("--sampler", choices=["tpe", "random"], default="tpe")
    p.add_argument("--multi-objective", action="store_true", help="Pareto front over (TFLOP/s, error)")
    p.add_argument("--gate", type=float, default=1.25,
                   help="accuracy gate: a kernel passes with rel. L2 error <= GATE x that of the exact reference "
                        "variant on the same inputs (default 1.25; lean P measures ~1.35, and a gate >= 1.4 "
                        "also seeds the lean kernel; the runtime's ZYFA_TUNE_ERROR_BUDGET then picks among "
                        "what passed)")
    p.add_argument("--runner", default="gpu", help="gpu | replay[:<db>] (no GPU: stored measurements, real sm_90a compiles)")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds per trial before the worker is killed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--precompile", action="store_true",
                   help="compile the next trial's kernel in a separate process while the GPU measures")
    p.add_argument("--enqueue", action="append", metavar="KEY=VAL,...",
                   help="measure this config first (fields changed from the head dims' default, as in "
                        "bench --ours; repeatable; also with --resume)")
    p.add_argument("--warm-start", action="append", metavar="DB",
                   help="measure first (after --enqueue) the best configs this tuning database (path or URL; "
                        "'shipped': the one shipped with zyfa-tune, the default) holds for these head dims on "
                        "any shape; repeatable; 'none' for no warm start")
    p.set_defaults(fn=cmd_tune)
    p = sub.add_parser("compile", help="compile a kernel config for sm_90a (no GPU needed)")
    common(p)
    p.add_argument("--non-causal", action="store_true")
    p.add_argument("--source", action="store_true", help="print the emitted source")
    p.set_defaults(fn=cmd_compile)
    def inputs(p: argparse.ArgumentParser, batch: int, seqlen: int, heads: int) -> None:
        """The random inputs a GPU command runs its kernel on."""
        p.add_argument("--batch", type=int, default=batch)
        p.add_argument("--seqlen", type=int, default=seqlen)
        p.add_argument("--heads", type=int, default=heads)
        p.add_argument("--seed", type=int, default=0)

    p = sub.add_parser("check", help="check a kernel config against float64 attention on the GPU")
    common(p)
    inputs(p, 1, 4096, 8)
    p.add_argument("--max-error", type=float, default=0.05)
    p.set_defaults(fn=cmd_check)
    p = sub.add_parser("timeline", help="GPU: clock stamps of each consumer step of one launch (Gluon kernels)")
    common(p)
    inputs(p, 2, 8192, 32)
    p.add_argument("--non-causal", action="store_true")
    p.add_argument("--steps", type=int, default=4096, help="steps per warpgroup with room in the buffer")
    p.add_argument("--sample", type=int, default=None, metavar="STEP",
                   help="also print both warpgroups' events for 4 steps from STEP on one clock")
    p.add_argument("--timed-reps", type=int, default=20, metavar="N",
                   help="time the traced launch and the kernel without stamps, N launches each (0: skip)")
    p.add_argument("--json", default=None, metavar="OUT.json", help="save the raw stamps")
    p.set_defaults(fn=cmd_timeline)

    def storage(p: argparse.ArgumentParser) -> None:
        p.add_argument("--storage", default=None,
                       help="database path or SQLAlchemy URL (default: $ZYFA_TUNE_DB or the user cache file)")

    p = sub.add_parser("show", help="what a tuning database holds")
    storage(p)
    p.set_defaults(fn=cmd_show)
    p = sub.add_parser("best", help="the best kernel per (GPU, problem class)")
    storage(p)
    p.add_argument("--gpu")
    p.add_argument("--dtype", choices=["fp8", "bf16"])
    p.add_argument("--head-dim", type=int)
    p.add_argument("--head-dim-v", type=int)
    p.set_defaults(fn=cmd_best)
    p = sub.add_parser("export", help="write a filtered, self-contained SQLite database")
    storage(p)
    p.add_argument("out")
    p.add_argument("--gpu")
    p.add_argument("--head-dim", type=int)
    p.add_argument("--head-dim-v", type=int)
    p.add_argument("--all-trials", action="store_true", help="all trials, not only the best entries")
    p.set_defaults(fn=cmd_export)
    for name in ("import", "merge"):
        p = sub.add_parser(name, help="merge another database in (faster entry per key wins; rows validated)")
        storage(p)
        p.add_argument("source")
        p.set_defaults(fn=cmd_import)
    p = sub.add_parser("verify", help="re-check this GPU's best kernels against float64 and their timings")
    storage(p)
    p.add_argument("--margin", type=float, default=0.10, help="largest accepted slowdown (0.10 = 10%%)")
    p.add_argument("--dtype", choices=["fp8", "bf16"], help="only this dtype's entries")
    p.add_argument("--head-dim", type=int, help="only these head dims' entries (e.g. the ones just merged)")
    p.add_argument("--head-dim-v", type=int)
    p.set_defaults(fn=cmd_verify)
    p = sub.add_parser("bench", help="ours vs FA3 / cuDNN / torch SDPA on the same inputs: table, JSON, plot")
    p.add_argument("--dtype", choices=["fp8", "bf16", "both"], default="fp8")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--head-dim-v", type=int, default=None)
    p.add_argument("--seqlens", default="4096,8192,16384")
    p.add_argument("--batch-heads", default=None, metavar="BxH,...",
                   help="one batch x heads per seqlen, or one for all (default: 16384 tokens / seqlen x 32)")
    p.add_argument("--kv-heads", type=int, default=None, help="GQA: fewer KV heads (default: = heads)")
    p.add_argument("--shape", action="append", metavar="DQK,DV,B,S,H[,HK]",
                   help="an explicit shape (repeatable; replaces --head-dim/--seqlens/--batch-heads)")
    p.add_argument("--peers", default=None,
                   help="comma list from fa3-fp8,cudnn-fp8,fa3-bf16,sdpa-cudnn-bf16,sdpa-flash-bf16, or 'none' "
                        "(default: all of the benched dtypes)")
    p.add_argument("--ours", action="append", metavar="[LABEL:]KEY=VAL,...",
                   help="also time a forced config: the default config with these fields changed (repeatable)")
    p.add_argument("--no-dispatch", action="store_true",
                   help="leave out flash_attn_func's own pick: only --ours configs and peers (e.g. one system "
                        "under ncu: zyfa-tune bench --no-dispatch --peers fa3-fp8 --rounds 1 --reps 5)")
    p.add_argument("--reps", type=int, default=30, help="timed calls per system (median reported)")
    p.add_argument("--rotate", type=int, default=1, help="input sets timed round-robin (for shapes that fit in L2)")
    p.add_argument("--rounds", type=int, default=3,
                   help="timing rounds per shape, systems interleaved in a rotated order (clock drift hits all alike)")
    p.add_argument("--input-family", default="gaussian", metavar="NAME[,NAME...]",
                   help="inputs of these kernels.inputs families, every shape on each (gaussian, outliers, sink, "
                        "rope, peaky, flat, llm; 'all' for every one): issue 5's variant x family table in one run")
    p.add_argument("--quant", choices=["per-tensor", "native", "end-to-end"], default="per-tensor",
                   help="FP8 inputs: one shared per-tensor quantisation (kernel error only), or each system's "
                        "own with errors against the unquantised inputs (then --ours NAME:smooth_k=true, hadamard=true, "
                        "k_major_v=true: V quantised keys-fastest, read without the V^T copy, or balanced_v=true: V's "
                        "rounding errors cancelling along the keys, with v_weight=K its kappa, work); end-to-end: as "
                        "native, but FA3 and ours quantise the bf16 inputs inside each timed call (quantiser + "
                        "attention)")
    p.add_argument("--warm", type=float, default=3.0, help="seconds of GEMMs to reach sustained clocks first")
    p.add_argument("--energy-s", type=float, default=0.0, metavar="SECONDS",
                   help="TFLOP/J: after its timing, run each system back to back this long (>= 1 s; NVML's energy "
                        "counter is noise over shorter windows) and read the energy counter around it (default 0: none)")
    p.add_argument("--ceiling", action="store_true",
                   help="also time the FP8 GEMM ceiling (torch._scaled_mm, 8192^3) at the start and end of the run; "
                        "FP8 rows then show their share of it")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="OUT.json", help="save every row and the GPU state")
    p.add_argument("--plot", default=None, metavar="OUT.png", help="TFLOP/s vs seqlen (needs zyfa-tune[plot])")
    p.add_argument("--from", dest="from_json", default=None, metavar="RESULTS.json",
                   help="no measuring: redraw the table / --plot of a saved run (no GPU needed)")
    p.set_defaults(fn=cmd_bench)
    args = ap.parse_args(argv)
    if args.command == "tune" and args.trials is None and args.time is None:
        args.trials = 40
    try:
        return args.fn(args)
    except (ConfigError, ValueError, TypeError, RuntimeError) as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}")  # messages may hold [brackets]
        return 2


if __name__ == "__main__":
    sys.exit(main())
