"""Database commands: `show`, `best`, `export`, `import` / `merge` and `verify` (GPU)."""

from __future__ import annotations

import argparse
import warnings

from rich.table import Table
from rich.text import Text

from zyfa_tune.generator import ConfigError, KernelConfig

from .common import add_storage_option, console, head_dims, plain


def _store(args: argparse.Namespace, *, readonly: bool = False):
    from zyfa_tune.db import open_store

    return open_store(args.storage, readonly=readonly, create=not readonly)


def _read_store(args: argparse.Namespace):
    """The database to show: --storage, else the default one, else (none tuned yet) the shipped one,
    saying so."""
    from zyfa_tune.db import default_db_path, open_store
    from zyfa_tune.kernels.dispatch import TUNED_DIR

    storage = args.storage
    if storage is None and not default_db_path().exists():
        storage = TUNED_DIR / "h200.db"
        console.print(plain(f"no tuning database at {default_db_path()} yet: showing the shipped database {storage}"))
    return open_store(storage, readonly=True, create=False)


def _recipe(text: str | None) -> Text | str:
    """A stored recipe as its summary ("plain" where none is stored), or why it does not parse."""
    from zyfa_tune.generator.recipe import PLAIN, Recipe

    try:
        return (PLAIN if text is None else Recipe.from_json(text)).summary()
    except ConfigError as exc:
        return Text.assemble(("invalid: ", "red"), plain(exc))


def _best_table(entries, title: str) -> Table:
    table = Table(title=plain(title))
    for col in (
        "GPU",
        "api",
        "dtype",
        "dqk/dv",
        "causal",
        "group",
        "seqlen<=",
        "B*H<=",
        "ms",
        "TFLOP/s",
        "rel.L2",
        "x ref",
        "recipe",
        "config",
        "provenance",
    ):
        table.add_column(col, overflow="fold")
    for e in entries:
        k = e.key
        try:
            summary = plain(KernelConfig.from_json(e.config_json).summary())
        except ConfigError as exc:
            summary = Text.assemble(("invalid: ", "red"), plain(exc))
        table.add_row(
            plain(e.fingerprint.gpu_name),
            k.api + (f" varlen T<={k.tokens_bucket}" if k.packed else ""),  # packed sequences' class
            k.dtype,
            f"{k.head_dim_qk}/{k.head_dim_v}",
            str(k.causal),
            str(k.gqa_group),
            str(k.seqlen_bucket),
            str(k.bh_bucket),
            f"{e.median_ms:.3f}",
            f"{e.tflops:.0f}" if e.tflops else "-",
            f"{e.error_rel_l2:.2e}" if e.error_rel_l2 is not None else "-",
            f"{e.error_ratio:.3f}" if e.error_ratio is not None else "-",
            _recipe(e.recipe),
            summary,
            plain(e.provenance),
        )
    return table


def cmd_show(args: argparse.Namespace) -> int:
    """Counts per status and the best entries of a database."""
    from zyfa_tune.db import TRIAL_STATUSES

    with _read_store(args) as store:
        console.print(Text(store.url, style="bold"))
        counts = Table(title="trials")
        counts.add_column("status")
        counts.add_column("count", justify="right")
        for status in TRIAL_STATUSES:
            counts.add_row(status, str(store.count_trials(status=status)))
        console.print(counts)
        console.print(_best_table(store.best_entries(), "best per (GPU, problem class)"))
    return 0


def cmd_best(args: argparse.Namespace) -> int:
    with _read_store(args) as store:
        entries = store.best_entries(gpu_name=args.gpu, head_dims=head_dims(args), dtype=args.dtype)
        console.print(_best_table(entries, f"best entries in {store.url}"))
    return 0 if entries else 1


def cmd_export(args: argparse.Namespace) -> int:
    """Write the file, then count what it holds: the numbers printed are the file's."""
    from zyfa_tune.db import open_store

    with _store(args, readonly=True) as store, warnings.catch_warnings(record=True) as skipped:
        warnings.simplefilter("always", RuntimeWarning)
        store.export(args.out, gpu_name=args.gpu, head_dims=head_dims(args), best_only=not args.all_trials)
    with open_store(args.out, readonly=True, create=False) as out:
        best, trials = len(out.best_entries()), out.count_trials()
    console.print(plain(f"exported {best} best entries ({trials} trials) to {args.out}"))
    for w in skipped:
        console.print(plain(f"skipped: {w.message}"))
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    with _store(args) as store:
        report = store.import_from(args.source)
    console.print(
        plain(
            f"trials: {report.added} added, {report.present} already present; best entries: "
            f"{report.new} new, {report.replaced} replaced, {report.kept} kept (ours as fast "
            f"or faster); rejected {len(report.rejected)} rows"
        )
    )
    if report.rejected:
        table = Table(title=f"rejected rows ({len(report.rejected)})")
        table.add_column("row", overflow="fold")
        table.add_column("reason", overflow="fold")
        for row, reason in report.rejected:
            table.add_row(plain(row), plain(reason))
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
    from zyfa_tune.tuning.verify import verify_entry

    if not torch.cuda.is_available():
        console.print("[red]verify needs a CUDA GPU[/red]")
        return 2
    here = current_fingerprint().device_key()
    with _store(args, readonly=True) as store:
        entries = [
            e
            for e in store.best_entries(head_dims=head_dims(args), dtype=args.dtype)
            if e.fingerprint.device_key() == here
        ]
    table = Table(title=plain(f"verify on {here[0]}: {len(entries)} entries"))
    for col in ("problem", "stored ms", "now ms", "slowdown", "SM MHz now (stored)", "rel.L2", "verdict"):
        table.add_column(col)
    failed = 0
    for e in entries:
        r = verify_entry(e, max_slowdown=args.margin, fresh_ms=_fresh_process_ms)
        failed += not r.ok
        table.add_row(
            str(e.key),
            f"{e.median_ms:.3f}",
            f"{r.median_ms:.3f}" if r.median_ms else "-",
            f"{r.slowdown:+.1%}" if r.slowdown is not None else "-",
            # (mean NVML clocks while timed: a slow reading at a sagging clock is the card's)
            _clocks(r.timing.sm_clock_mhz if r.timing else None, e.sm_clock_mhz),
            f"{r.error_rel_l2:.2e}" if r.error_rel_l2 is not None else "-",
            _verdict(r),
        )
    console.print(table)
    return 1 if failed else 0


def _verdict(r) -> str:
    """verify's verdict cell: ok (with why, where it needed a second look), skipped (why), or the failure."""
    if r.skipped:
        return f"[yellow]{r.reason}[/yellow]"
    if r.ok:
        return f"[green]ok[/green] ({r.reason})" if r.reason else "[green]ok[/green]"
    return f"[red]{r.reason}[/red]"


def _fresh_process_ms(entry) -> float | None:
    """The median of a stored entry's kernel timed by a new worker process (None if it failed there)."""
    from zyfa_tune.tuning.verify import entry_shape
    from zyfa_tune.tuning.worker import Shape, time_in_fresh_process

    shape, key = Shape(*entry_shape(entry)), entry.key
    r = time_in_fresh_process(entry.config_json, shape, causal=key.causal, api=key.api, recipe=entry.recipe)
    return r.median_ms if r.status == "ok" else None


def register(sub) -> None:
    p = sub.add_parser("show", help="what a tuning database holds")
    add_storage_option(p)
    p.set_defaults(fn=cmd_show)
    p = sub.add_parser("best", help="the best kernel per (GPU, problem class)")
    add_storage_option(p)
    _add_filters(p)
    p.add_argument("--dtype", choices=["fp8", "bf16"], help="only this dtype's entries (None: all)")
    p.set_defaults(fn=cmd_best)
    p = sub.add_parser("export", help="write a filtered, self-contained SQLite database")
    add_storage_option(p)
    p.add_argument("out", help="the new file (never overwritten)")
    _add_filters(p)
    p.add_argument("--all-trials", action="store_true", help="all trials, not only the best entries")
    p.set_defaults(fn=cmd_export)
    for name in ("import", "merge"):
        p = sub.add_parser(name, help="merge another database in (faster entry per key wins; rows validated)")
        add_storage_option(p)
        p.add_argument("source", help="database file or SQLAlchemy URL to read (never written)")
        p.set_defaults(fn=cmd_import)
    p = sub.add_parser("verify", help="re-check this GPU's best kernels against float64 and their timings")
    add_storage_option(p)
    p.add_argument("--margin", type=float, default=0.10, help="largest accepted slowdown (0.10 = 10%%)")
    p.add_argument("--dtype", choices=["fp8", "bf16"], help="only this dtype's entries (None: all)")
    p.add_argument("--head-dim", type=int, help="only these head dims' entries (e.g. the ones just merged)")
    p.add_argument("--head-dim-v", type=int, help="head dim of V of those entries (None: --head-dim)")
    p.set_defaults(fn=cmd_verify)


def _add_filters(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpu", help="only entries tuned on this GPU model, e.g. 'NVIDIA H200' (None: all)")
    p.add_argument("--head-dim", type=int, help="only entries of this head dim (None: all)")
    p.add_argument("--head-dim-v", type=int, help="head dim of V of those entries (None: --head-dim)")
