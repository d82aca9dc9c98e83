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

from rich.markup import escape

from zyfa_tune.generator import ConfigError

from . import bench_cmd, db_cmds, kernel_cmds, trials_cmd, tune_cmd
from .common import console

#: command groups, in the order `zyfa-tune --help` lists them
GROUPS = (tune_cmd, trials_cmd, kernel_cmds, db_cmds, bench_cmd)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="zyfa-tune", description="Autotuned FP8/BF16 attention for Hopper")
    sub = ap.add_subparsers(dest="command", required=True)
    for group in GROUPS:
        group.register(sub)
    args = ap.parse_args(argv)
    if args.command == "tune" and args.trials is None and args.time is None:
        args.trials = 40
    try:
        return args.fn(args)
    except (ConfigError, ValueError, TypeError, RuntimeError) as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}")  # messages may hold [brackets]
        return 2
