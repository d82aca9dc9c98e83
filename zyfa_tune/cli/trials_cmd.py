"""`zyfa-tune trials`: a study's trials with their outcome, value and message (why a config failed)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from rich.markup import escape
from rich.table import Table

from .common import console


def _study_storage(args: argparse.Namespace) -> str:
    from zyfa_tune.tuning.tuner import default_study_storage

    if args.study_storage:
        if "://" not in args.study_storage and not os.path.isfile(args.study_storage):
            raise ValueError(f"--study-storage: no journal file {args.study_storage!r}")
        return args.study_storage
    if args.study is None:  # the study tuned last in the default place
        journals = sorted(Path(default_study_storage("_")).parent.glob("*.journal"), key=os.path.getmtime)
        journals = [j for j in journals if j.stat().st_size]
        if not journals:
            raise ValueError("--study: no study in the default place yet; give its name or --study-storage")
        console.print(f"the study tuned last: {journals[-1].stem} (--study NAME for another)", markup=False)
        return str(journals[-1])
    target = default_study_storage(args.study)
    if not os.path.isfile(target):
        raise ValueError(
            f"--study: no study {args.study!r} in the default place ({target}); give --study-storage where it was tuned"
        )
    return target


def cmd_trials(args: argparse.Namespace) -> int:
    """List the trials of a study, optionally only some outcomes."""
    import optuna

    from zyfa_tune.tuning.trials import OUTCOMES, failure_reason, parse_outcomes, trial_rows
    from zyfa_tune.tuning.tuner import open_study_storage

    outcomes = parse_outcomes(args.status) if args.status else [o for o in OUTCOMES if o != "waiting"]
    target = _study_storage(args)
    storage = open_study_storage(target)
    names = [s.study_name for s in optuna.get_all_study_summaries(storage)]
    name = args.study if args.study is not None else (names[0] if len(names) == 1 else None)
    if name is None or name not in names:
        raise ValueError(
            f"--study: {args.study or '(not given)'} is not a study in {target}; it holds "
            f"{', '.join(names) or 'no study'}"
        )
    rows = trial_rows(optuna.load_study(study_name=name, storage=storage), outcomes)
    table = Table(title=f"{name}: {len(rows)} trial(s)" + (f" ({args.status})" if args.status else ""))
    for col in ("#", "status", "TFLOP/s", "message"):
        table.add_column(col, overflow="fold")
    for r in rows:
        message = r.message if args.full or not r.message else failure_reason(r.message)
        table.add_row(str(r.number), r.outcome, f"{r.value:.1f}" if r.value is not None else "-", escape(message))
    console.print(table)
    return 0


def register(sub) -> None:
    p = sub.add_parser("trials", help="list a study's trials: status, value and why each failed")
    p.add_argument(
        "--study", default=None, help="study name, as `zyfa-tune tune` printed it (default: the one tuned last)"
    )
    p.add_argument(
        "--study-storage",
        default=None,
        help="Optuna storage: RDB URL or journal file (default: the study's journal in the user cache)",
    )
    p.add_argument(
        "--status",
        default=None,
        metavar="S,...",
        help="only these outcomes, as the status column shows them (e.g. crash,timeout,compile_error; "
        "default: all but the queued ones, 'waiting')",
    )
    p.add_argument("--full", action="store_true", help="whole messages (default: the line that says what failed)")
    p.set_defaults(fn=cmd_trials)
