"""The one timing function (device events, medians, rotated inputs), host time per call, energy under
sustained load, and GPU state from NVML."""

from __future__ import annotations

import functools
import os
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch


@dataclass(frozen=True)
class Timing:
    median_ms: float
    p20_ms: float
    p80_ms: float
    min_ms: float
    reps: int
    sm_clock_mhz: float | None = None  # mean of NVML reads during timing
    power_w: float | None = None
    energy_j_per_call: float | None = None  # only from a window of >= MIN_ENERGY_WINDOW_S
    samples_ms: tuple[float, ...] = ()  # every timed call, sorted (what `pooled` merges)


#: Shortest window whose NVML energy reading is reported. On the A100 / H100 the power sensor behind
#: NVML's energy counter is sampled about 25 ms of every 100 ms (Yang et al. 2024, "Part-time Power
#: Measurements", arXiv 2312.02741): a timing block of 40 ms reads a slice of idle time or nothing
#: (an H200 read 130-230 W for full-load attention rows timed that briefly). Over a second
#: or more of back-to-back calls the sampling averages out.
MIN_ENERGY_WINDOW_S = 1.0


@dataclass(frozen=True)
class Energy:
    """Energy of `calls` back-to-back calls over a `seconds`-long window (NVML's energy counter)."""

    calls: int
    seconds: float
    joules: float
    sm_clock_mhz: float | None = None

    @property
    def joules_per_call(self) -> float:
        return self.joules / self.calls

    @property
    def power_w(self) -> float:
        return self.joules / self.seconds


def pooled(timings: Sequence[Timing]) -> Timing:
    """One Timing from several blocks of the same call (the rounds of `zyfa-tune bench`, which
    interleaves systems so that clock drift under sustained load hits them alike): quantiles over all
    samples, clock / power / energy averaged by calls. Blocks without samples: median of medians."""
    if not timings:
        raise ValueError("timings: need at least one")
    samples = sorted(x for t in timings for x in t.samples_ms)
    if not samples:
        samples = sorted(t.median_ms for t in timings)
    q = statistics.quantiles(samples, n=5) if len(samples) >= 5 else [samples[0]] * 4

    def mean(attr: str) -> float | None:
        pairs = [(getattr(t, attr), t.reps) for t in timings if getattr(t, attr) is not None]
        return sum(v * n for v, n in pairs) / sum(n for _, n in pairs) if pairs else None

    return Timing(
        median_ms=statistics.median(samples),
        p20_ms=q[0],
        p80_ms=q[3],
        min_ms=samples[0],
        reps=sum(t.reps for t in timings),
        sm_clock_mhz=mean("sm_clock_mhz"),
        power_w=mean("power_w"),
        energy_j_per_call=mean("energy_j_per_call"),
        samples_ms=tuple(samples) if timings[0].samples_ms else (),
    )


@functools.lru_cache(maxsize=16)
def _nvml_handle(device: int):
    """(pynvml, handle) of CUDA device `device`, or (None, None) where NVML is unavailable.

    NVML ignores CUDA_VISIBLE_DEVICES, so the CUDA device is matched by PCI address; failing that,
    by the physical index CUDA_VISIBLE_DEVICES names, else by the same index."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # NVML missing or unsupported: timings stay valid, energy is unknown
        return None, None
    return pynvml, _nvml_device(pynvml, device)


def _nvml_device(nv, device: int):
    try:
        import torch

        p = torch.cuda.get_device_properties(device)
        bus = f"{p.pci_domain_id:08X}:{p.pci_bus_id:02X}:{p.pci_device_id:02X}.0"
        return nv.nvmlDeviceGetHandleByPciBusId(bus.encode())  # nvidia-ml-py takes bytes here
    except Exception:
        pass
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
    try:
        return nv.nvmlDeviceGetHandleByIndex(int(visible[device]))
    except (ValueError, IndexError):
        return nv.nvmlDeviceGetHandleByIndex(device)


def gpu_state(device: int = 0) -> dict[str, Any]:
    """Clocks, power, temperature and name from NVML (empty where NVML is unavailable)."""
    nv, h = _nvml_handle(device)
    if h is None:
        return {}
    state: dict[str, Any] = {"name": nv.nvmlDeviceGetName(h)}
    for key, fn in (
        ("sm_clock_mhz", lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)),
        ("mem_clock_mhz", lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM)),
        ("max_sm_clock_mhz", lambda: nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_SM)),
        ("power_w", lambda: nv.nvmlDeviceGetPowerUsage(h) / 1000.0),
        ("power_limit_w", lambda: nv.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0),
        ("temp_c", lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)),
    ):
        try:
            state[key] = fn()
        except Exception:
            pass
    return state


def warm_gpu(seconds: float = 2.0, device: int = 0) -> None:
    """Run dense matrix products until the clocks settle at their sustained level."""
    a = torch.randn(8192, 8192, device=f"cuda:{device}", dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize(device)


def time_cuda(calls: Sequence[Callable[[], Any]], *, warmup: int = 5, reps: int = 30, device: int = 0) -> Timing:
    """Median device time of one call, round-robin over `calls` (one per input set, so that
    inputs rotate and the L2 cache does not flatter small shapes). Each call is timed by its own
    pair of CUDA events; launches queue back to back."""
    if not calls:
        raise ValueError("calls: need at least one callable")
    for i in range(warmup):
        calls[i % len(calls)]()
    torch.cuda.synchronize(device)
    nv, h = _nvml_handle(device)
    e0, t0 = _energy_mj(nv, h), time.perf_counter()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    clocks, powers = [], []
    for i in range(reps):
        starts[i].record()
        calls[i % len(calls)]()
        ends[i].record()
        if h is not None and i % max(1, reps // 8) == 0:
            clocks.append(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM))
            powers.append(nv.nvmlDeviceGetPowerUsage(h) / 1000.0)
    torch.cuda.synchronize(device)
    energy = _window(e0, _energy_mj(nv, h), time.perf_counter() - t0, reps)
    ms = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    q = statistics.quantiles(ms, n=5) if len(ms) >= 5 else [ms[0]] * 4
    return Timing(
        median_ms=statistics.median(ms),
        p20_ms=q[0],
        p80_ms=q[3],
        min_ms=ms[0],
        reps=reps,
        sm_clock_mhz=statistics.mean(clocks) if clocks else None,
        power_w=statistics.mean(powers) if powers else None,
        energy_j_per_call=energy.joules_per_call if energy else None,
        samples_ms=tuple(ms),
    )


def host_us(fns: dict, calls: int = 200, rounds: int = 21) -> dict:
    """Median over rounds of the host time per call of `calls` back-to-back calls, for each of
    `fns`; the functions take turns round by round so that drift of the host affects all alike."""
    for fn in fns.values():
        for _ in range(20):
            fn()
    torch.cuda.synchronize()
    per_call: dict = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            per_call[name].append((time.perf_counter() - t0) / calls * 1e6)
            torch.cuda.synchronize()
    return {name: statistics.median(v) for name, v in per_call.items()}


def _window(e0_mj: float | None, e1_mj: float | None, seconds: float, calls: int) -> Energy | None:
    """The energy of a window from two counter reads, or None where NVML gave none, the counter did
    not move, or the window is too short to trust (MIN_ENERGY_WINDOW_S)."""
    if e0_mj is None or e1_mj is None or e1_mj <= e0_mj or calls < 1 or seconds < MIN_ENERGY_WINDOW_S:
        return None
    return Energy(calls=calls, seconds=seconds, joules=(e1_mj - e0_mj) / 1000.0)


def sustain(
    launch: Callable[[], Any], seconds: float, *, now: Callable[[], float] = time.perf_counter, depth: int = 2
) -> tuple[int, float]:
    """Call `launch` (one batch of asynchronous calls; it returns something with `.synchronize()`,
    a recorded CUDA event) until `seconds` have passed, with up to `depth` batches queued so the GPU
    never waits for the host; return (batches, seconds elapsed) once all are done."""
    if seconds <= 0:
        raise ValueError(f"seconds: expected > 0, got {seconds}")
    pending: deque = deque()
    start, batches = now(), 0
    while True:
        pending.append(launch())
        batches += 1
        if len(pending) > depth:
            pending.popleft().synchronize()
        if now() - start >= seconds:
            break
    while pending:
        pending.popleft().synchronize()
    return batches, now() - start


def sustained_energy(
    calls: Sequence[Callable[[], Any]], *, seconds: float = 2.0, call_ms: float = 1.0, device: int = 0
) -> Energy | None:
    """Energy per call under sustained load: `calls` round-robin back to back for `seconds`
    (>= MIN_ENERGY_WINDOW_S), the NVML energy counter read before and after. The GPU runs at the clock
    its power limit allows for this work, so the joules are what a long job would pay per call.
    `call_ms` (a timing's median) sizes the batches between host checks (~50 ms each). None without
    NVML's counter."""
    if not calls:
        raise ValueError("calls: need at least one callable")
    if seconds < MIN_ENERGY_WINDOW_S:
        raise ValueError(f"seconds: NVML's energy counter needs windows of >= {MIN_ENERGY_WINDOW_S} s, got {seconds}")
    nv, h = _nvml_handle(device)
    if _energy_mj(nv, h) is None:
        return None
    per_batch = max(1, round(50.0 / max(call_ms, 1e-3)))
    clocks: list[float] = []
    done = [0]

    def launch():
        for _ in range(per_batch):
            calls[done[0] % len(calls)]()
            done[0] += 1
        event = torch.cuda.Event()
        event.record()
        clocks.append(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM))
        return event

    for c in calls:  # warm: the window measures calls, not first-use work
        c()
    torch.cuda.synchronize(device)
    e0 = _energy_mj(nv, h)
    _, elapsed = sustain(launch, seconds)
    energy = _window(e0, _energy_mj(nv, h), elapsed, done[0])
    return (
        replace(energy, sm_clock_mhz=statistics.mean(clocks[len(clocks) // 2 :])) if energy else None
    )  # the clock of the window's settled half


def _energy_mj(nv, h) -> float | None:
    if h is None:
        return None
    try:
        return float(nv.nvmlDeviceGetTotalEnergyConsumption(h))
    except Exception:
        return None


def attention_flops(
    batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim_qk: int, head_dim_v: int, causal: bool
) -> float:
    """FLOPs of the two matrix products; causal counts half (FlashAttention's convention)."""
    flops = 2.0 * batch * heads * seqlen_q * seqlen_k * (head_dim_qk + head_dim_v)
    return flops / 2 if causal else flops
