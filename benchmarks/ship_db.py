"""Regenerate the shipped tuning database (kernels/tuned/h200.db) with the tuner itself.

For each family (fp8 and bf16 x head dims 64, 96, 128, 192/128, 256; causal) one `Tuner` study of
--trials trials over the shapes (B, S) = (4, 4K), (2, 8K), (1, 16K) at H = 32 (16 for 192/128),
all into one working tuning database; then only the best entry per problem class (with its trial)
is exported to the output file, as `zyfa-tune export --best` does. Replaces the hand-written grid
of benchmarks/grid_tune.py: the shipped kernels now come from the same search, verification and
timing as `zyfa-tune tune`, and the studies start from the seeds (the default config of each head
dim and the winners of the database being replaced).

    python benchmarks/ship_db.py --out kernels/tuned/h200.db --force --trials 12          # GPU
    python benchmarks/ship_db.py --out test.db --runner replay --dtypes fp8 --head-dims 128 --trials 3

The output is never overwritten without --force (it is replaced atomically at the end, after every
study finished). --workdir keeps the studies and the working database, and a second run with the
same --workdir continues each study by --trials more trials.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from zyfa_tune.cli.db_cmds import _best_table
from zyfa_tune.cli.tune_cmd import _gpus
from zyfa_tune.db import Fingerprint, open_store
from zyfa_tune.tuning.runners import shipped_db
from zyfa_tune.tuning.spec import TuneSpec
from zyfa_tune.tuning.tuner import Tuner, simulation_fingerprint

DTYPES = ("fp8", "bf16")
HEAD_DIMS = ((64, 64), (96, 96), (128, 128), (192, 128), (256, 256))
SHAPES = ((4, 4096), (2, 8192), (1, 16384))  # (batch, seqlen)


@dataclass(frozen=True)
class Family:
    dtype: str
    head_dim_qk: int
    head_dim_v: int

    @property
    def heads(self) -> int:
        """16 heads for 192/128, else 32 (as benchmarks/peers.py's shapes)."""
        return 16 if (self.head_dim_qk, self.head_dim_v) == (192, 128) else 32

    def spec(
        self,
        *,
        trials: int,
        storage: str,
        study_storage: str,
        runner: str,
        gpus: tuple[int | None, ...],
        timeout_s: float,
        seed: int,
    ) -> TuneSpec:
        return TuneSpec(
            dtype=self.dtype,
            head_dim_qk=self.head_dim_qk,
            head_dim_v=self.head_dim_v,
            seqlens=tuple(s for _, s in SHAPES),
            batches=tuple(b for b, _ in SHAPES),
            heads=self.heads,
            trials=trials,
            storage=storage,
            study_storage=study_storage,
            study_name=f"ship-{self.dtype}-{self.head_dim_qk}x{self.head_dim_v}",
            resume=True,
            runner=runner,
            gpus=gpus,
            timeout_s=timeout_s,
            seed=seed,
        )


def parse_head_dims(text: str) -> tuple[tuple[int, int], ...]:
    """'64,128,192/128' -> ((64, 64), (128, 128), (192, 128)); only the shipped pairs."""
    out = []
    for item in filter(None, (i.strip() for i in text.split(","))):
        qk, _, v = item.partition("/")
        try:
            pair = (int(qk), int(v or qk))
        except ValueError:
            raise ValueError(f"--head-dims: {item!r} is not D or DQK/DV") from None
        if pair not in HEAD_DIMS:
            raise ValueError(
                f"--head-dims: {item!r} is not one of the shipped pairs {['/'.join(map(str, p)) for p in HEAD_DIMS]}"
            )
        out.append(pair)
    if not out:
        raise ValueError("--head-dims: give at least one")
    return tuple(out)


def families(dtypes: tuple[str, ...], head_dims: tuple[tuple[int, int], ...]) -> list[Family]:
    bad = [d for d in dtypes if d not in DTYPES]
    if bad or not dtypes:
        raise ValueError(f"--dtypes: {list(bad) or 'none given'}; choose from {list(DTYPES)}")
    return [Family(dt, qk, v) for dt in dtypes for qk, v in head_dims]


def fingerprint(runner: str) -> Fingerprint:
    """The fingerprint the tuner files this runner's results under."""
    if runner == "gpu":
        from zyfa_tune.db import current_fingerprint

        return current_fingerprint(0)
    return simulation_fingerprint(runner)


def check_output(out: Path, force: bool, runner: str = "gpu") -> None:
    """Before any tuning: the output must be new (or --force) and its folder must exist; the
    shipped file only ever gets GPU measurements."""
    if runner != "gpu" and os.path.exists(out) and os.path.samefile(out, shipped_db()):
        raise ValueError(f"--out: {out} is the shipped database; runner {runner!r} does not measure a GPU")
    if os.path.lexists(out) and not force:
        raise ValueError(f"--out: {out} exists; pass --force to replace it")
    if not out.parent.is_dir():
        raise ValueError(f"--out: folder {out.parent} does not exist")


def export_best(storage: str, out: Path, gpu_name: str) -> int:
    """Export the best entries of `gpu_name` to a temporary file beside `out`, then move it into
    place (so a failed export leaves the old file as it was). Returns the number of entries."""
    tmp = out.with_name(f".{out.name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        with open_store(storage, readonly=True, create=False) as store:
            n = store.export(tmp, gpu_name=gpu_name, best_only=True)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return n


def ship(
    out: Path,
    fams: list[Family],
    *,
    trials: int,
    runner: str,
    workdir: str,
    force: bool = False,
    gpus: tuple[int | None, ...] = (None,),
    timeout_s: float = 180.0,
    seed: int = 0,
    console: Console | None = None,
) -> int:
    """Tune every family into `workdir`'s database and export its best entries to `out`.
    Returns the number of entries exported."""
    console = console or Console()
    check_output(out, force, runner)
    storage = os.path.join(workdir, "tuning.db")
    journal = os.path.join(workdir, "studies.journal")
    for fam in fams:
        spec = fam.spec(
            trials=trials,
            storage=storage,
            study_storage=journal,
            runner=runner,
            gpus=gpus,
            timeout_s=timeout_s,
            seed=seed,
        )
        tuner = Tuner(spec)
        tuner.run()
        p = tuner.progress
        console.print(
            f"{spec.name}: {p.done} trials ({', '.join(f'{k}={v}' for k, v in sorted(p.by_status.items()))})"
            f", best geo-mean {p.best_value or 0:.1f} TFLOP/s"
        )
    check_output(out, force, runner)  # again: something may have created it meanwhile
    n = export_best(storage, out, fingerprint(runner).gpu_name)
    expected = len(fams) * len(SHAPES)
    if n < expected:
        console.print(
            f"[yellow]warning: {n} best entries, expected {expected}: some shape had no correct "
            f"trial; raise --trials[/yellow]"
        )
    with open_store(out, readonly=True, create=False) as store:
        console.print(_best_table(store.best_entries(), f"best entries in {out}"))
    return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the database to write (e.g. kernels/tuned/h200.db)")
    ap.add_argument("--force", action="store_true", help="replace --out if it exists")
    ap.add_argument("--trials", type=int, default=12, help="trials per family (seeds included)")
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--head-dims", default="64,96,128,192/128,256")
    ap.add_argument("--runner", default="gpu", help="gpu | replay (the shipped H200 measurements) | replay:<db>")
    ap.add_argument("--gpus", default=None, help="comma list of GPU indices or 'all' (one worker each)")
    ap.add_argument(
        "--workdir",
        default=None,
        help="keep studies and the working database here (default: a temporary folder, removed at the end)",
    )
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds per trial")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    console = Console()
    console = console if console.is_terminal else Console(width=200)  # logs: a line per entry
    runner = f"replay:{shipped_db()}" if a.runner == "replay" else a.runner
    workdir = a.workdir or tempfile.mkdtemp(prefix="ship-db-")
    try:
        gpus = _gpus(a.gpus)
        fams = families(tuple(d.strip() for d in a.dtypes.split(",") if d.strip()), parse_head_dims(a.head_dims))
        os.makedirs(workdir, exist_ok=True)
        ship(
            Path(os.path.abspath(a.out)),
            fams,
            trials=a.trials,
            runner=runner,
            workdir=workdir,
            force=a.force,
            gpus=gpus,
            timeout_s=a.timeout,
            seed=a.seed,
            console=console,
        )
    except ValueError as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 2
    finally:
        if a.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
