"""The bench's timing on the CPU: rounds interleaving the systems, pooled timing blocks, energy
windows (TFLOP/J and power) and the FP8 GEMM ceiling, with fake timers, clocks and NVML."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from bench_cases import System, fake_timer, sample_result, write_first_format

from zyfa_tune import cli
from zyfa_tune.bench import report as bench_report
from zyfa_tune.bench import run as bench_run
from zyfa_tune.bench.inputs import Inputs
from zyfa_tune.bench.measure import measure_shape
from zyfa_tune.bench.peers.base import Bound
from zyfa_tune.bench.peers.sdpa import TorchSDPA
from zyfa_tune.bench.results import BenchResult
from zyfa_tune.bench.run import BenchPlan
from zyfa_tune.bench.shape import BenchShape, shapes_from
from zyfa_tune.tuning.timing import Timing

#: a bf16 peer that runs on the CPU
MATH = TorchSDPA("sdpa-math-bf16", "MATH")


def test_rounds_interleave_systems_in_rotated_order_and_pool_their_samples():
    """Timing rounds: every system is timed once per round, each round starting one system later,
    and a row's median is over all its rounds' calls (a drifting clock hits every system alike)."""
    shape = BenchShape(head_dim_qk=64, head_dim_v=64, batch=1, seqlen=64, heads=2, kv_heads=2)
    order: list[str] = []

    def system(name: str, ms: float) -> System:
        def bind(x: Inputs) -> Bound:
            bound = MATH.prepare(x)
            return Bound(lambda: (order.append(name), bound.call()), bound.output)

        return System(name, "peer", "bf16", bind)

    def timer(calls, warmup, reps):
        order.clear()
        calls[0]()
        name = order[0]
        timer.seen.append(name)
        base = {"a": 1.0, "b": 2.0, "c": 3.0}[name] + len(timer.seen) * 0.01  # slower each block
        return Timing(median_ms=base, p20_ms=base, p80_ms=base, min_ms=base, reps=reps, samples_ms=(base,) * reps)

    timer.seen = []

    rows = measure_shape(shape, [system(n, 0) for n in "abc"], seed=0, reps=30, rounds=3, device="cpu", timer=timer)
    assert timer.seen == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert [r.reps for r in rows] == [30, 30, 30]
    assert rows[0].median_ms == pytest.approx(
        1.0 + 0.06
    )  # its blocks are the 1st, 6th and 8th: the median is the 6th's
    assert rows[0].min_ms == pytest.approx(1.01) and rows[2].median_ms == pytest.approx(3.05)


def test_pooled_timing():
    from zyfa_tune.tuning.timing import pooled

    a = Timing(
        median_ms=1.0,
        p20_ms=1.0,
        p80_ms=1.0,
        min_ms=1.0,
        reps=2,
        sm_clock_mhz=1800.0,
        power_w=None,
        energy_j_per_call=2.0,
        samples_ms=(1.0, 1.0),
    )
    b = Timing(
        median_ms=3.0,
        p20_ms=3.0,
        p80_ms=3.0,
        min_ms=3.0,
        reps=6,
        sm_clock_mhz=1600.0,
        power_w=500.0,
        energy_j_per_call=None,
        samples_ms=(2.0, 3.0, 3.0, 3.0, 3.0, 4.0),
    )
    t = pooled([a, b])
    assert t.reps == 8 and t.median_ms == 3.0 and t.min_ms == 1.0 and len(t.samples_ms) == 8
    assert t.sm_clock_mhz == pytest.approx((1800 * 2 + 1600 * 6) / 8)
    assert t.power_w == 500.0 and t.energy_j_per_call == 2.0
    assert pooled([dataclasses.replace(a, samples_ms=()), dataclasses.replace(b, samples_ms=())]).median_ms == 2.0
    with pytest.raises(ValueError):
        pooled([])


# ---- energy windows and the FP8 GEMM ceiling ---------------------------------------------------


class FakeEvent:
    def __init__(self, log):
        self.log, self.done = log, False

    def synchronize(self):
        self.done = True
        self.log.append("sync")


def test_sustain_keeps_batches_queued_until_the_window_ends():
    """`sustain` launches until its window has passed, never waits on the batch just queued (the GPU
    always has the next one) and returns only when every batch is done."""
    clock, log, events = [0.0], [], []

    def now():
        return clock[0]

    def launch():
        clock[0] += 0.25  # each batch's launch + the waits take a quarter second of host time here
        log.append("launch")
        events.append(FakeEvent(log))
        return events[-1]

    from zyfa_tune.tuning.timing import sustain

    batches, elapsed = sustain(launch, 1.0, now=now, depth=2)
    assert batches == 4 and elapsed == pytest.approx(1.0) and all(e.done for e in events)
    assert log[:4] == ["launch"] * 3 + ["sync"]  # the first wait comes once 3 batches are queued
    with pytest.raises(ValueError):
        sustain(launch, 0.0)


def test_energy_window_is_reported_only_when_long_enough():
    from zyfa_tune.tuning import timing

    e = timing._window(1000.0, 3000.0, 2.0, 400)  # 2 J over 2 s, 400 calls
    assert (
        e.joules == pytest.approx(2.0) and e.power_w == pytest.approx(1.0) and e.joules_per_call == pytest.approx(5e-3)
    )
    assert timing._window(1000.0, 1600.0, 0.04, 20) is None  # a 40 ms timing block: noise
    assert timing._window(1000.0, 1000.0, 2.0, 20) is None  # the counter did not move
    assert timing._window(None, 1000.0, 2.0, 20) is None  # no NVML
    with pytest.raises(ValueError, match="1.0 s"):
        timing.sustained_energy([lambda: None], seconds=0.5)


def test_sustained_energy_without_nvml_is_none(monkeypatch):
    from zyfa_tune.tuning import timing

    monkeypatch.setattr(timing, "_nvml_handle", lambda device: (None, None))
    assert timing.sustained_energy([lambda: None], seconds=1.0) is None


def test_energy_windows_give_tflop_per_j_and_power():
    """With energy_s, each system gets one window after its timing; its joules per call make TFLOP/J
    and its mean power the W column; a failing window is that system's error, not the run's."""
    from zyfa_tune.tuning.timing import Energy

    shape = BenchShape(head_dim_qk=64, head_dim_v=64, batch=1, seqlen=128, heads=2, kv_heads=2)
    seen = []

    def energy(calls, seconds, call_ms):
        seen.append((len(calls), seconds, call_ms))
        if len(seen) == 2:
            raise RuntimeError("NVML went away")
        return Energy(calls=1000, seconds=seconds, joules=500.0, sm_clock_mhz=1700.0)

    systems = [System(n, "peer", "bf16", MATH.prepare) for n in ("a", "b")]
    a, b = measure_shape(shape, systems, seed=0, reps=5, device="cpu", timer=fake_timer, energy_s=2.0, energy=energy)
    assert seen == [(1, 2.0, 2.0), (1, 2.0, 2.0)]  # the window is told the timed median
    assert a.energy_j_per_call == pytest.approx(0.5) and a.power_w == pytest.approx(250.0)
    assert a.tflop_per_j == pytest.approx(shape.flops / 0.5 / 1e12)
    assert a.sustained_tflops == pytest.approx(shape.flops * 500 / 1e12) and a.sustained_clock_mhz == 1700.0
    assert "sustained" in bench_report.row_line(a) and "sustained" not in bench_report.row_line(b)
    assert b.error == "RuntimeError: NVML went away" and b.tflops is None
    plain = measure_shape(shape, systems[:1], seed=0, reps=5, device="cpu", timer=fake_timer, energy=energy)
    assert len(seen) == 2 and plain[0].power_w == 500.0  # energy_s=0: no window


def test_energy_window_length_is_validated():
    shapes = shapes_from(128, None, "1024")
    for bad in (0.5, -1.0, 61.0):
        with pytest.raises(ValueError, match="energy_s"):
            BenchPlan(shapes=shapes, ours=(), peers=(), energy_s=bad)
    assert BenchPlan(shapes=shapes, ours=(), peers=(), energy_s=2.0).energy_s == 2.0


def test_gemm_ceiling_record_and_table_share():
    """The ceiling is pooled over its blocks (start and end of the run); FP8 rows show their share of
    it, bf16 rows none; it survives the JSON round trip, and a run without one has no such column."""
    from rich.console import Console

    blocks = [
        Timing(median_ms=1.0, p20_ms=1.0, p80_ms=1.0, min_ms=1.0, reps=5, samples_ms=(1.0,) * 5),
        Timing(median_ms=1.2, p20_ms=1.2, p80_ms=1.2, min_ms=1.2, reps=5, samples_ms=(1.2,) * 5),
    ]
    c = bench_run.gemm_ceiling(blocks, n=1000)
    assert c["tflops"] == pytest.approx(2e9 / 1.1e-3 / 1e12) and c["m"] == 1000 and c["reps"] == 10
    res = dataclasses.replace(sample_result(), ceiling=dict(c, tflops=1000.0))

    def text(r):
        console = Console(width=300, record=True)
        console.print(bench_report.results_table(r))
        return console.export_text()

    out = text(res)
    assert "of FP8 GEMM" in out and "FP8 GEMM ceiling: 1000.0 TFLOP/s" in out
    assert "50%" in out and "91%" in out  # ours 500 at 4K; FA3 700 x 1.3 at 16K
    assert "of FP8 GEMM" not in text(sample_result())
    assert "per clock" not in out  # the ceiling's clock unknown
    # with both clocks: the share per MHz (GEMM 1000 at 1600 MHz; ours 500 at 4K read at 2000 MHz: 40%)
    clocked = [dataclasses.replace(r, sm_clock_mhz=2000.0) for r in sample_result().rows]
    out = text(dataclasses.replace(sample_result(clocked), ceiling=dict(c, tflops=1000.0, sm_clock_mhz=1600.0)))
    assert "per clock" in out and "40%" in out and "50%" in out


def test_ceiling_json_round_trip_and_first_format_runs(tmp_path):
    res = dataclasses.replace(sample_result(), ceiling={"tflops": 1270.0, "m": 8192})
    res.save(tmp_path / "r.json")
    assert BenchResult.load(tmp_path / "r.json") == res
    assert BenchResult.load(write_first_format(tmp_path / "first.json")).ceiling == {}


def test_cli_energy_and_ceiling_reach_the_plan(monkeypatch):
    plans = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench_run, "run", lambda plan, on_row=None: plans.append(plan) or sample_result())
    cli.main(["bench", "--seqlens", "4096", "--peers", "none", "--energy-s", "2", "--ceiling"])
    cli.main(["bench", "--seqlens", "4096", "--peers", "none"])
    assert [(p.energy_s, p.ceiling) for p in plans] == [(2.0, True), (0.0, False)]
