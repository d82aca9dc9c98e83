"""Where a consumer step's time goes: a clock timeline of one launch of a Gluon kernel.

`record` launches the traced twin of a config (generator/gluon_sm90/trace.py: the same kernel with the SM
clock stored at each step's EVENTS, for CTA 0) on the caller's inputs and returns the stamps;
`phases` reduces them to the median cycles between consecutive events of a step, per consumer
warpgroup, `interleave` says how far apart the warpgroups' steps run (ping-pong or lockstep), and
`sample` lines both warpgroups up on one clock. What the stamps cost depends on the schedule
(generator/gluon_sm90/trace.py), so `record` also times the traced launch against the same kernel without
stamps (`Timeline.stamp_cost`): a timeline says which phase dominates and how the warpgroups
interleave, the benchmark says how fast the kernel is.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from zyfa_tune.generator.build import jit_function
from zyfa_tune.generator.config import KernelConfig
from zyfa_tune.generator.gluon_sm90.emit import emit
from zyfa_tune.generator.gluon_sm90.trace import EVENT_INDEX, EVENTS, TraceBuffer
from zyfa_tune.kernels import fastlaunch
from zyfa_tune.kernels.launch import prepare, run_prepared
from zyfa_tune.tuning.timing import time_cuda

#: Steps per consumer warpgroup a default recording keeps (CTA 0 of B=2 S=8K H=32 at 128-key
#: blocks runs about 1000).
DEFAULT_STEPS = 4096


@dataclass(frozen=True)
class Phase:
    """Cycles from one event of a step to the next recorded one (or, for the last, to the next
    step's first), over the steps where both were recorded."""

    start: str
    end: str
    median: float
    p10: float
    p90: float
    steps: int


@dataclass(frozen=True)
class Interleave:
    """How a consumer warpgroup's steps sit against warpgroup 0's on one clock: its step starts `offset`
    cycles after warpgroup 0's same step (median; `offset_share` of warpgroup 0's period: a two-consumer
    ping-pong aims at half), and its softmax (QK^T done to softmax done) runs beside warpgroup 0's for
    `softmax_overlap` of the latter (median over steps; near 1: the two softmaxes in lockstep, contending
    for the MUFU and the issue slots; 0: strictly one after the other)."""

    warpgroup: int
    offset: float
    offset_share: float
    softmax_overlap: float
    steps: int


@dataclass(frozen=True)
class Timeline:
    """clocks[warpgroup, step, event]: SM clock (cycles, unwrapped, from the first stamp), -1 where
    not recorded. traced_ms / plain_ms: median device time of the traced launch and of the same kernel
    without stamps on the same inputs (None when not timed)."""

    config: KernelConfig
    clocks: np.ndarray
    traced_ms: float | None = None
    plain_ms: float | None = None

    def stamp_cost(self) -> float | None:
        """How much longer the traced launch ran than the kernel without stamps (0.17: 17%), None
        when not timed. Where it is large the phases describe a differently scheduled kernel."""
        if self.traced_ms is None or self.plain_ms is None:
            return None
        return self.traced_ms / self.plain_ms - 1.0

    def events(self) -> list[int]:
        """The events this kernel's steps record (the overlapped step has no pv_issued)."""
        return [e for e in range(len(EVENTS)) if (self.clocks[:, :, e] >= 0).any()]

    def phases(self, warpgroup: int) -> list[Phase]:
        t = self.clocks[warpgroup]
        ev = self.events()
        out = []
        for a, b in zip(ev, ev[1:]):
            ok = (t[:, a] >= 0) & (t[:, b] >= 0)
            out.append(_phase(EVENTS[a], EVENTS[b], t[ok, b] - t[ok, a]))
        ok = (t[:-1, ev[-1]] >= 0) & (t[1:, ev[0]] >= 0)
        out.append(_phase(EVENTS[ev[-1]], f"next {EVENTS[ev[0]]}", t[1:, ev[0]][ok] - t[:-1, ev[-1]][ok]))
        return out

    def period(self, warpgroup: int) -> float:
        """Median cycles from one step's first event to the next step's."""
        first = self.clocks[warpgroup, :, self.events()[0]]
        ok = (first[:-1] >= 0) & (first[1:] >= 0)
        return float(np.median(np.diff(first)[ok])) if ok.any() else float("nan")

    def interleave(self, warpgroup: int) -> Interleave:
        """Warpgroup `warpgroup` (>= 1) against warpgroup 0, over the steps both recorded whole."""
        if not 1 <= warpgroup < self.clocks.shape[0]:
            raise ValueError(f"interleave: warpgroup must be in [1, {self.clocks.shape[0] - 1}], got {warpgroup}")
        start, done, end = (EVENT_INDEX[e] for e in ("start", "qk_done", "softmax_done"))
        a, b = self.clocks[0], self.clocks[warpgroup]
        n = a.shape[0]
        offsets, overlaps = [], []
        for s in range(n):
            if min(a[s, start], b[s, start], a[s, done], a[s, end]) < 0 or a[s, end] <= a[s, done]:
                continue
            offsets.append(b[s, start] - a[s, start])
            lo, hi = a[s, done], a[s, end]
            beside = sum(
                max(0, min(hi, b[t, end]) - max(lo, b[t, done]))  # its softmaxes of steps s-1..s+1
                for t in range(max(0, s - 1), min(n, s + 2))
                if min(b[t, done], b[t, end]) >= 0
            )
            overlaps.append(beside / (hi - lo))
        if not offsets:
            raise ValueError(f"interleave: no step recorded whole by warpgroups 0 and {warpgroup}")
        offset = float(np.median(offsets))
        return Interleave(warpgroup, offset, offset / self.period(0), float(np.median(overlaps)), len(offsets))

    def sample(self, step: int, count: int = 4) -> list[tuple[int, int, dict[str, int]]]:
        """(warpgroup, step, {event: cycles since warpgroup 0's first event of `step`}) for `count`
        steps from `step`: how the warpgroups interleave."""
        ev = self.events()
        if not 0 <= step < self.clocks.shape[1] or self.clocks[0, step, ev[0]] < 0:
            raise ValueError(f"sample: warpgroup 0 recorded no {EVENTS[ev[0]]!r} at step {step}")
        ref = self.clocks[0, step, ev[0]]
        return [
            (w, s, {EVENTS[e]: int(self.clocks[w, s, e] - ref) for e in ev if self.clocks[w, s, e] >= 0})
            for s in range(step, min(step + count, self.clocks.shape[1]))
            for w in range(self.clocks.shape[0])
        ]


def _phase(start: str, end: str, cycles: np.ndarray) -> Phase:
    if cycles.size == 0:
        return Phase(start, end, float("nan"), float("nan"), float("nan"), 0)
    return Phase(
        start,
        end,
        float(np.median(cycles)),
        float(np.percentile(cycles, 10)),
        float(np.percentile(cycles, 90)),
        int(cycles.size),
    )


def from_stamps(
    config: KernelConfig, raw: np.ndarray, *, traced_ms: float | None = None, plain_ms: float | None = None
) -> Timeline:
    """Raw int32 stamps (warpgroup, step, event), 0 = not recorded, as a Timeline: the 32-bit SM
    clock read unsigned and unwrapped (it wraps every ~2 s at 1.98 GHz, so once at most per launch)."""
    t = raw.astype(np.int64) & 0xFFFFFFFF
    seen = t > 0
    if not seen.any():
        raise RuntimeError("timeline: no stamps were recorded (was CTA 0 given any tile?)")
    if t[seen].max() - t[seen].min() > 2**31:
        t = np.where(seen & (t < 2**31), t + 2**32, t)
    return Timeline(config, np.where(seen, t - t[seen].min(), -1), traced_ms, plain_ms)


def record(
    config: KernelConfig,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    steps: int = DEFAULT_STEPS,
    warmup: int = 3,
    timed_reps: int = 20,
    out: torch.Tensor | None = None,
) -> Timeline:
    """Launch `config`'s traced twin on (q, k, v) (the layout `flash_attn_func` takes; FP8 inputs with
    their descales) `warmup` times, then once more into a cleared buffer; returns that launch's
    timeline. With timed_reps > 0 the traced launch and the same kernel without stamps are first timed
    on these inputs (kernels/timing.time_cuda, medians of timed_reps): what the stamps cost.
    The attention output goes to `out` if given (bf16, q's shape with V's head dim).
    Compiles the twin on first use (its source holds the buffer's address)."""
    if config.backend != "gluon":
        raise ValueError(f"timeline: only Gluon kernels are instrumented, not backend={config.backend!r}")
    if q.device.type != "cuda":
        raise ValueError("timeline: the inputs must be on a CUDA device")
    if timed_reps < 0:
        raise ValueError(f"timeline: timed_reps must be >= 0, got {timed_reps}")
    consumers = config.block_m // 64
    if out is None:
        out = torch.empty(*q.shape[:3], v.shape[3], device=q.device, dtype=torch.bfloat16)
    buf = torch.zeros(consumers * steps * len(EVENTS), device=q.device, dtype=torch.int32)
    traced = emit(config, trace=TraceBuffer(address=buf.data_ptr(), steps=steps))
    fn = jit_function(traced)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    head = (traced.source_hash, "timeline")
    grid, args, options = prepare(config, q, k, v, out, scale, causal, q_descale, k_descale, v_descale)
    traced_options = dict(options)
    constexprs = {"CAUSAL": traced_options.pop("CAUSAL")}
    device = q.device.index

    def traced_launch():
        fastlaunch.run(head, fn, grid, args, constexprs, traced_options, device)

    def plain_launch():
        run_prepared(config, grid, args, options, device)

    traced_ms = plain_ms = None
    try:
        if timed_reps:
            traced_ms = time_cuda([traced_launch], warmup=warmup, reps=timed_reps, device=device).median_ms
            plain_ms = time_cuda([plain_launch], warmup=warmup, reps=timed_reps, device=device).median_ms
        else:
            for _ in range(warmup):
                traced_launch()
        torch.cuda.synchronize(q.device)
        buf.zero_()
        traced_launch()
        torch.cuda.synchronize(q.device)
    finally:
        fastlaunch.forget(traced.source_hash)
    return from_stamps(
        config, buf.view(consumers, steps, len(EVENTS)).cpu().numpy(), traced_ms=traced_ms, plain_ms=plain_ms
    )
