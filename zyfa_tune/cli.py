"""`zyfa-tune` command line.

    zyfa-tune compile [--dtype fp8] [--head-dim 128] [--set key=val ...]   # no GPU needed
    zyfa-tune check   [--dtype fp8] [--head-dim 128] [--seqlen 4096]        # GPU: vs float64
    zyfa-tune show    [--storage DB]            # what a database holds
    zyfa-tune best    [--storage DB] [--gpu NAME] [--head-dim D]
    zyfa-tune export  OUT.db [--storage DB] [--gpu NAME] [--head-dim D] [--all-trials]
    zyfa-tune import  SRC.db [--storage DB]     # alias: merge; keeps the faster entry per key
    zyfa-tune verify  [--storage DB] [--margin 0.1]   # GPU: re-check this GPU's best kernels
"""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.table import Table

from zyfa_tune.generator import ConfigError, KernelConfig, emit

console = Console()


def _config(args: argparse.Namespace) -> KernelConfig:
    from zyfa_tune.kernels.defaults import default_config

    dv = args.head_dim_v or args.head_dim
    cfg = default_config(args.dtype, args.head_dim, dv)
    changes = {}
    for item in args.set or []:
        key, sep, val = item.partition("=")
        if not sep:
            raise ConfigError(f"--set: expected key=value, got {item!r}")
        changes[key] = int(val) if val.lstrip("-").isdigit() else val
    return KernelConfig.from_dict({**cfg.to_dict(), **changes})


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
                        ("MUFU.EX2", art.count("MUFU.EX2"))):
        table.add_row(name, str(value))
    console.print(table)
    console.print(json.dumps(cfg.to_dict(), sort_keys=True))
    if args.source:
        console.print(kernel.source, markup=False, highlight=False)
    return 1 if art.spill_bytes else 0


def cmd_check(args: argparse.Namespace) -> int:
    """Run the kernel on fresh random inputs and compare with float64 attention."""
    import torch

    from zyfa_tune import flash_attn_func, quantize_fp8
    from zyfa_tune.kernels.reference import attention_reference, rel_l2

    if not torch.cuda.is_available():
        console.print("[red]check needs a CUDA GPU[/red]")
        return 2
    cfg = _config(args)
    b, s, h = args.batch, args.seqlen, args.heads
    g = torch.Generator(device="cuda").manual_seed(args.seed)
    q = torch.randn(b, s, h, cfg.head_dim_qk, device="cuda", generator=g)
    k = torch.randn(b, s, h, cfg.head_dim_qk, device="cuda", generator=g)
    v = torch.randn(b, s, h, cfg.head_dim_v, device="cuda", generator=g)
    if cfg.dtype == "fp8":
        q, k, v, qd, kd, vd = quantize_fp8(q, k, v)
        kw = dict(q_descale=qd, k_descale=kd, v_descale=vd)
    else:
        q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
        kw = {}
    out = flash_attn_func(q, k, v, causal=True, config=cfg, **kw)
    err = rel_l2(out, attention_reference(q, k, v, causal=True, **kw))
    console.print(f"rel. L2 error vs float64: {err:.4e}  ({cfg.dtype} {cfg.head_dim_qk}/{cfg.head_dim_v} "
                  f"B={b} S={s} H={h}, softmax={cfg.softmax})")
    return 0 if err < args.max_error else 1


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
            summary = (f"{cfg.softmax} {cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages} "
                       f"{cfg.loads}/{cfg.v_layout} rowsum={cfg.rowsum}")
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
        entries = [e for e in store.best_entries() if e.fingerprint.device_key() == here]
    table = Table(title=f"verify on {here[0]}: {len(entries)} entries")
    for col in ("problem", "stored ms", "now ms", "slowdown", "rel.L2", "verdict"):
        table.add_column(col)
    failed = 0
    for e in entries:
        r = verify_entry(e, max_slowdown=args.margin)
        failed += not r.ok
        table.add_row(str(e.key), f"{e.median_ms:.3f}", f"{r.median_ms:.3f}" if r.median_ms else "-",
                      f"{r.slowdown:+.1%}" if r.slowdown is not None else "-",
                      f"{r.error_rel_l2:.2e}" if r.error_rel_l2 is not None else "-",
                      "[green]ok[/green]" if r.ok else f"[red]{r.reason}[/red]")
    console.print(table)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="zyfa-tune", description="Autotuned FP8/BF16 attention for Hopper")
    sub = ap.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--dtype", choices=["fp8", "bf16"], default="fp8")
        p.add_argument("--head-dim", type=int, default=128)
        p.add_argument("--head-dim-v", type=int, default=None)
        p.add_argument("--set", action="append", metavar="KEY=VAL", help="override a config field")

    p = sub.add_parser("compile", help="compile a kernel config for sm_90a (no GPU needed)")
    common(p)
    p.add_argument("--non-causal", action="store_true")
    p.add_argument("--source", action="store_true", help="print the emitted source")
    p.set_defaults(fn=cmd_compile)
    p = sub.add_parser("check", help="check a kernel config against float64 attention on the GPU")
    common(p)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-error", type=float, default=0.05)
    p.set_defaults(fn=cmd_check)

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
    p.set_defaults(fn=cmd_verify)
    args = ap.parse_args(argv)
    try:
        return args.fn(args)
    except (ConfigError, ValueError, TypeError, RuntimeError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
