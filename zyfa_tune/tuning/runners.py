"""What a tuning worker's child process runs for one `Task`: the runners behind `Worker(runner=...)`.

A runner gets a validated `KernelConfig`, the `Task` and a `Reporter` (task.py); it calls
`reporter.setup_done()` once the config-independent preparation is over (inputs, references) and
`reporter.result(i, fields)` once per shape, in order, with the `TrialResult` fields of that shape
(batch/heads/seqlen are added by the parent). An exception escaping a runner is reported as "crash"
and the child process exits, so the next task starts in a clean process (and, on the GPU, a clean
CUDA context). Runner strings:

"gpu"                          the real measurement on the one GPU the child sees (gpu_runner.py).
"simulate" / "simulate:<db>"   the loop without a GPU: stored measurements of a tuning database (by
                               default the shipped one), else a real sm_90a compile and a synthetic
                               model (simulation.py). For testing the loop, not for choosing kernels.
                               "replay" / "replay:<db>" is the same runner under its older name.
"fault:<mode>[@<field>=<value>]"  injected failures for tests (fault_runner.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path

from zyfa_tune.generator import CHOICES, KernelConfig

from .fault_runner import FAULT_MODES, SHAPE_FIELDS

#: runner names that take an optional database: the simulation and its older name
SIMULATE_NAMES = ("simulate", "replay")


def shipped_db() -> str:
    """The tuning database shipped with zyfa-tune (the simulation's default)."""
    from zyfa_tune.kernels import dispatch

    return str(Path(dispatch.TUNED_DIR) / "h200.db")


@dataclass(frozen=True)
class RunnerSpec:
    kind: str  # "gpu" | "simulate" | "fault"
    db: str | None = None  # the simulation's database (fault: its fallback's)
    fault: str | None = None
    field: str | None = None  # fault only where this KernelConfig / Shape field == value (None: always)
    value: str | None = None


def parse_runner(text: object) -> RunnerSpec:
    """Parse and check a runner string (ValueError naming what is wrong)."""
    if not isinstance(text, str):
        raise ValueError(f"runner: expected str, got {type(text).__name__}")
    if text == "gpu":
        return RunnerSpec("gpu")
    name, colon, path = text.partition(":")
    if name in SIMULATE_NAMES:
        if colon and not path:
            raise ValueError(
                f"runner: '{name}:' needs a database path, e.g. {name}:kernels/tuned/h200.db "
                f"(or '{name}' alone for the shipped one)"
            )
        path = path or shipped_db()
        if not os.path.isfile(path):
            raise ValueError(f"runner: {name} database {path!r} does not exist")
        return RunnerSpec("simulate", db=os.path.abspath(path))
    if name == "fault" and colon:
        return _parse_fault(path)
    raise ValueError(f"runner: {text!r} is not 'gpu', 'simulate[:<db path>]' or 'fault:<mode>[@<field>=<value>]'")


def _parse_fault(body: str) -> RunnerSpec:
    mode, _, cond = body.partition("@")
    if mode not in FAULT_MODES:
        raise ValueError(f"runner: fault mode {mode!r} is not one of {list(FAULT_MODES)}")
    if not cond:
        return RunnerSpec("fault", fault=mode)
    field, eq, value = cond.partition("=")
    if field in SHAPE_FIELDS:
        if not eq or not value.isdigit():
            raise ValueError(f"runner: fault condition {cond!r}: {field} needs a positive integer")
        value = str(int(value))
    elif not eq or field not in {f.name for f in fields(KernelConfig)}:
        raise ValueError(f"runner: fault condition {cond!r} must be <KernelConfig or Shape field>=<value>")
    elif value not in {str(v) for v in CHOICES[field]}:
        raise ValueError(f"runner: {field}={value!r} never occurs (allowed: {list(CHOICES[field])})")
    return RunnerSpec("fault", db=shipped_db(), fault=mode, field=field, value=value)


def make_runner(spec: RunnerSpec):
    """The runner object a child process serves tasks with."""
    if spec.kind == "gpu":
        from .gpu_runner import GpuRunner

        return GpuRunner()
    if spec.kind == "simulate":
        from .simulation import SimulationRunner

        return SimulationRunner(spec.db)
    from .fault_runner import FaultRunner

    return FaultRunner(spec.fault, spec.field, spec.value, spec.db)
