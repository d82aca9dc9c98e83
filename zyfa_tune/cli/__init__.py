"""`zyfa-tune` command line: one module per group of commands, each registering its own parsers.

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
import functools

from rich.text import Text

from zyfa_tune.generator import ConfigError

from . import bench_cmd, db_cmds, kernel_cmds, trials_cmd, tune_cmd
from .common import console

#: command groups, in the order `zyfa-tune --help` lists them
GROUPS = (tune_cmd, trials_cmd, kernel_cmds, db_cmds, bench_cmd)
#: What a command may raise on bad input or an unusable database/storage: one line, no traceback.
KNOWN_ERRORS = (ConfigError, ValueError, TypeError, RuntimeError, OSError, ImportError)


def version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("zyfa-tune")
    except PackageNotFoundError:
        return "unknown (not installed)"


def parser() -> argparse.ArgumentParser:
    """The whole command line: every group's commands under one parser."""
    ap = argparse.ArgumentParser(prog="zyfa-tune", description="Autotuned FP8/BF16 attention for Hopper")
    ap.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    # every command's --help shows each option's default
    sub = ap.add_subparsers(
        dest="command",
        required=True,
        parser_class=functools.partial(argparse.ArgumentParser, formatter_class=argparse.ArgumentDefaultsHelpFormatter),
    )
    for group in GROUPS:
        group.register(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "tune" and args.trials is None and args.time is None:
        args.trials = 40
    try:
        return args.fn(args)
    except Exception as exc:
        from sqlalchemy.exc import SQLAlchemyError  # a study storage URL optuna could not use

        from zyfa_tune.db.checks import clean_text
        from zyfa_tune.db.session import driver_hint

        if not isinstance(exc, KNOWN_ERRORS + (SQLAlchemyError,)):
            raise
        line = " ".join(clean_text(f"{exc}{driver_hint(exc)}").split()) or type(exc).__name__
        console.print(Text.assemble(("error:", "red"), " ", line))  # printed as is: may hold [brackets]
        return 2
