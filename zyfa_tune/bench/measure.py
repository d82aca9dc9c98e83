"""Measuring one shape: every system on the same fresh inputs, its error against one float64
reference, then timed by one timer in interleaved rounds, and optionally an energy window each.

Why one process and one timer: numbers from different scripts differ by clocks, warm-up and timing
method more than the kernels differ. So every system is timed by `tuning.timing.time_cuda` (CUDA
events, median after warm-up) in rounds interleaved with the others on the same tensors (a GPU at
its power limit drifts by 20% in clock within a run), and its error is rel. L2 against
`tuning.reference.attention_reference` (float64) on exactly the inputs it was given.

Energy (`energy_s`): NVML's counter is only trustworthy over a second or more (tuning.timing), so
TFLOP/J comes from a separate window per system after its timing rounds, the calls back to back for
`energy_s` seconds at whatever clock the power limit then allows; the W column is that window's mean
power.

Memory-traffic systems (a `Bound` with `bytes_moved`: the quantisers and the copy of `--quant-floor`)
take part in the same rounds; their rows carry GB/s and, from the copy row's rate, time / floor
(`bench.traffic`) instead of TFLOP/s, error and energy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from zyfa_tune.bench.inputs import Inputs
from zyfa_tune.bench.peers.base import Bound, Peer
from zyfa_tune.bench.results import BenchRow
from zyfa_tune.bench.shape import BenchShape
from zyfa_tune.bench.traffic import gbps, with_floor


def _error_text(exc: BaseException) -> str:
    first = str(exc).splitlines()[0][:160] if str(exc) else ""
    return f"{type(exc).__name__}: {first}"


def measure_shape(
    shape: BenchShape,
    systems: Sequence[Peer],
    *,
    seed: int,
    reps: int,
    rotate: int = 1,
    rounds: int = 3,
    device: str = "cuda",
    timer: Callable[..., Any] | None = None,
    input_family: str = "gaussian",
    quant: str = "per-tensor",
    energy_s: float = 0.0,
    energy: Callable[..., Any] | None = None,
    on_row: Callable[[BenchRow], None] | None = None,
) -> list[BenchRow]:
    """All systems on `rotate` fresh input sets of one shape (seeds seed, seed+1, ...). Each system
    runs once on the first set for its error against the float64 reference (computed once per
    dtype); then they are timed in `rounds` rounds of about reps / rounds calls each, every round in
    a rotated order, so that the clock drift of a GPU at its power limit (1980 -> 1500 MHz within a
    run) falls on every system alike instead of on whichever runs last. A failing
    system gives a row with `error`. With `energy_s` > 0 each system then runs for that long back to
    back (`energy`, default tuning.timing.sustained_energy) for its joules per call."""
    from zyfa_tune.tuning.reference import max_abs_err, rel_l2
    from zyfa_tune.tuning.timing import pooled, sustained_energy, time_cuda

    timer = timer or time_cuda
    energy = energy or sustained_energy
    inputs = [Inputs.random(shape, seed + i, device, input_family, quant) for i in range(rotate)]
    refs: dict[str, torch.Tensor] = {}
    base = dict(
        shape=shape.label,
        dqk=shape.head_dim_qk,
        dv=shape.head_dim_v,
        b=shape.batch,
        s=shape.seqlen,
        h=shape.heads,
        hk=shape.kv_heads,
        family=input_family,
    )
    rows: dict[int, BenchRow] = {}
    ready: dict[int, tuple[list[Bound], dict[str, float]]] = {}

    def failed(system: Peer, bound: list[Bound], exc: BaseException) -> BenchRow:
        info = _bound_info(bound[0]) if bound else {}
        return BenchRow(
            **base, system=system.name, kind=system.kind, dtype=system.dtype, **info, error=_error_text(exc)
        )

    for i, system in enumerate(systems):
        bound: list[Bound] = []
        try:
            bound = [system.prepare(x) for x in inputs]
            bound[0].call()
            if inputs[0].q16.is_cuda:
                torch.cuda.synchronize()
            if bound[0].output is None:  # a memory-traffic system: no attention output
                ready[i] = bound, {}
                continue
            if system.dtype not in refs:
                refs[system.dtype] = inputs[0].reference(system.dtype)
            out, ref = bound[0].output(), refs[system.dtype]
            ready[i] = bound, dict(rel_l2=rel_l2(out, ref), max_err=max_abs_err(out, ref))
            del out
        except Exception as exc:  # a missing or failing peer is reported, not fatal
            rows[i] = failed(system, bound, exc)
    blocks: dict[int, list] = {i: [] for i in ready}
    order = list(ready)
    per_round = max(5, -(-reps // max(1, rounds)))
    for r in range(max(1, rounds) if order else 0):
        for i in order[r % len(order) :] + order[: r % len(order)]:
            if i in rows:
                continue
            try:
                blocks[i].append(timer([b.call for b in ready[i][0]], warmup=3, reps=per_round))
            except Exception as exc:
                rows[i] = failed(systems[i], ready[i][0], exc)
    timings = {i: pooled(blocks[i]) for i in order if i not in rows}
    windows: dict[int, Any] = {}
    if energy_s > 0:
        for i in timings:
            if ready[i][0][0].bytes_moved:  # GB/s rows: no FLOPs per joule
                continue
            try:
                windows[i] = energy([b.call for b in ready[i][0]], seconds=energy_s, call_ms=timings[i].median_ms)
            except Exception as exc:
                rows[i] = failed(systems[i], ready[i][0], exc)
    for i, system in enumerate(systems):
        if i not in rows:
            bound, errors = ready[i]
            rows[i] = _measured(shape, base, system, bound[0], errors, timings[i], windows.get(i))
    out_rows = with_floor([rows[i] for i in range(len(systems))])
    for row in out_rows if on_row else ():
        on_row(row)
    return out_rows


def _bound_info(bound: Bound) -> dict[str, Any]:
    """What a row says of the system as bound: our kernel and recipe, a traffic system's bytes."""
    return dict(
        config=bound.config, source=bound.source, entry=bound.entry, recipe=bound.recipe, bytes_moved=bound.bytes_moved
    )


def _measured(shape: BenchShape, base: dict, system: Peer, bound: Bound, errors: dict, t: Any, window: Any) -> BenchRow:
    """A measured row: TFLOP/s (or a traffic system's GB/s), quantiles, clock, power and energy."""
    joules = window.joules_per_call if window else t.energy_j_per_call
    flops = None if bound.bytes_moved else shape.flops
    return BenchRow(
        **base,
        system=system.name,
        kind=system.kind,
        dtype=system.dtype,
        **errors,
        tflops=flops / (t.median_ms * 1e-3) / 1e12 if flops else None,
        median_ms=t.median_ms,
        p20_ms=t.p20_ms,
        p80_ms=t.p80_ms,
        min_ms=t.min_ms,
        reps=t.reps,
        sm_clock_mhz=t.sm_clock_mhz,
        power_w=window.power_w if window else t.power_w,
        energy_j_per_call=joules if flops else None,
        tflop_per_j=flops / joules / 1e12 if flops and joules else None,
        sustained_tflops=flops * window.calls / window.seconds / 1e12 if window else None,
        sustained_clock_mhz=window.sm_clock_mhz if window else None,
        gbps=gbps(bound.bytes_moved, t.median_ms) if bound.bytes_moved else None,
        **_bound_info(bound),
    )
