"""What the bench tests share: a system made of a bind function alone, a fake timer, a sample
result, and a run saved in the first JSON format (rows without kind, dtype or hk; no environment
or settings), which `BenchResult.load` still reads."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from zyfa_tune.bench.inputs import QUANT_MODES, Inputs
from zyfa_tune.bench.peers.base import Bound
from zyfa_tune.bench.results import BenchResult, BenchRow
from zyfa_tune.bench.shape import BenchShape
from zyfa_tune.tuning.timing import Timing

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@dataclass(frozen=True)
class System:
    """A benched system given by its bind function alone (a `bench.peers.base.Peer`)."""

    name: str
    kind: str
    dtype: str
    bind: Callable[[Inputs], Bound]
    quant_modes: ClassVar[tuple[str, ...]] = QUANT_MODES

    def supports(self, shape: BenchShape) -> bool:
        return True

    def prepare(self, x: Inputs) -> Bound:
        return self.bind(x)


def fake_timer(calls, warmup, reps):
    """Runs every call once (round-robin is the real timer's job) and reports 2 ms."""
    fake_timer.calls = len(calls)
    fake_timer.blocks = getattr(fake_timer, "blocks", 0) + 1
    for c in calls:
        c()
    return Timing(
        median_ms=2.0,
        p20_ms=1.9,
        p80_ms=2.1,
        min_ms=1.8,
        reps=reps,
        sm_clock_mhz=1755.0,
        power_w=500.0,
        energy_j_per_call=1.0,
    )


def sample_result(rows=None) -> BenchResult:
    def row(system, kind, s, tflops, dtype="fp8", **kw):
        return BenchRow(
            shape=f"128/128 B=1 S={s} H=32",
            system=system,
            kind=kind,
            dtype=dtype,
            dqk=128,
            dv=128,
            b=1,
            s=s,
            h=32,
            hk=32,
            tflops=tflops,
            median_ms=1.0,
            rel_l2=0.02,
            **kw,
        )

    rows = rows or [
        r
        for s, f in ((4096, 1.0), (8192, 1.2), (16384, 1.3))
        for r in (
            row("ours-fp8", "ours", s, 500 * f, config=None, source="exact"),
            row("lean", "forced", s, 480 * f),
            row("fa3-fp8", "peer", s, 700 * f),
            row("cudnn-fp8", "peer", s, 0, error="ImportError: no cudnn"),
        )
    ]
    return BenchResult(
        date="2026-12-01T10:00:00+00:00",
        gpu={"name": "NVIDIA H200"},
        gpu_after={},
        environment={},
        settings={},
        rows=tuple(rows),
    )


def write_first_format(path: Path) -> Path:
    """A run of two head dims (two plot panels) saved in the first JSON format."""
    gpu = {"name": "NVIDIA H200", "sm_clock_mhz": 1980, "max_sm_clock_mhz": 1980, "power_limit_w": 700.0}
    rows = [
        dict(
            shape=f"{d}/{d} B={16384 // s} S={s} H=32",
            system=system,
            dqk=d,
            dv=d,
            b=16384 // s,
            s=s,
            h=32,
            rel_l2=0.02,
            max_err=0.06,
            median_ms=ms,
            p20_ms=ms,
            p80_ms=ms,
            min_ms=ms,
            reps=30,
            sm_clock_mhz=1980,
            power_w=500.0,
            energy_j_per_call=None,
            tflops=tflops,
        )
        for d in (128, 64)
        for s in (4096, 8192)
        for system, ms, tflops in (
            ("ours-fp8", 1.2, 470.0),
            ("fa3-fp8", 0.9, 610.0),
            ("sdpa-flash-bf16", 1.6, 340.0),
            ("ours-bf16", 1.5, 360.0),
        )
    ]
    path.write_text(json.dumps(dict(date="2026-11-30T05:10:48+00:00", gpu=gpu, gpu_after=gpu, rows=rows)))
    return path
