"""Timeline instrumentation of the Gluon kernel: the PTX that stamps the SM clock at named points of
each consumer step (generator/gluon_sm90/common.py: `_mark`, `_marked`), and where it stores them.

A traced kernel is the same kernel with a clock read and a store at each point, for CTA 0 only, into
an int32 buffer laid out (consumer warpgroup, step, event): one row of EVENTS per step (`kv_it`,
the warpgroup's running count of key blocks over all its tiles). zyfa_tune/bench/timeline.py allocates the
buffer, launches and reads it back. The stamps pin some instructions in place (ptxas does not move
code across a clock read freely), and what that costs depends on the schedule: a few percent for most
kernels, but for the exact 256-key seed at 16K on an H100 the traced launch runs 30% longer than
the plain one (2.62 against 2.01 ms) and its median step 15% (4555 cycles against ~3950 untraced). So a
timeline shows where a step's time goes, not its duration, and two variants' periods are compared by the
benchmark, never by their timelines (`zyfa-tune timeline --timed-reps` prints the cost for the config).

Only validated ints reach the PTX: the buffer address and the number of slots.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The points of a consumer step, in the order they occur (the overlapped step has no separate
#: "pv_issued": PV(j-1) is issued with QK^T(j), at "issued").
EVENTS = (
    "start",  # the step begins
    "ready",  # its K (and V) block has landed and, with ping-pong, it is this warpgroup's turn
    "qk_issued",  # QK^T(j)'s wgmmas issued (the overlapped step's P(j-1) publication and PV(j-1)
    # issue follow; with f16 scores the publication comes before "ready")
    "issued",  # the step's wgmmas issued and the turn passed (overlapped step: with PV(j-1))
    "qk_done",  # QK^T(j) finished (its wgmma wait returned)
    "max_done",  # the row maxima of the block are known
    "softmax_done",  # probabilities and row sums done
    "pv_issued",  # plain step: PV(j) issued
    "pv_done",
)  # the step's PV wgmma finished (not recorded by pv_defer steps, which wait
# for PV(j-1) before their softmax)
EVENT_INDEX = {name: i for i, name in enumerate(EVENTS)}


@dataclass(frozen=True)
class TraceBuffer:
    """Where a traced kernel stores its clocks: a device address (int32 slots) and the steps per
    consumer warpgroup it has room for; later steps are not recorded."""

    address: int
    steps: int

    def __post_init__(self) -> None:
        for name in ("address", "steps"):
            if type(getattr(self, name)) is not int:
                raise TypeError(f"TraceBuffer.{name} must be an int, got {type(getattr(self, name)).__name__}")
        if not 0 < self.address < 2**64 or self.address % 4:
            raise ValueError(f"TraceBuffer.address: {self.address:#x} is not a 4-byte aligned device address")
        if not 1 <= self.steps <= 1 << 20:
            raise ValueError(f"TraceBuffer.steps must be in [1, 2^20], got {self.steps}")

    def slots(self, consumers: int) -> int:
        return consumers * self.steps * len(EVENTS)


def clock_asm(buffer: TraceBuffer, consumers: int, *, after_value: bool) -> str:
    """Inline PTX storing %clock into slot $idx of the buffer if this is CTA 0 and the slot exists.
    Every thread stores (the same word): a per-thread predicate made ptxas spill the 256-key kernel.
    after_value: the asm also passes a float32 through ($1 -> $0), so that it runs after that value
    is computed; else its output is the slot index, unused."""
    idx = "$2" if after_value else "$1"
    limit = buffer.slots(consumers)
    return (
        "{ .reg .u32 c, b; .reg .pred p; .reg .u64 a;\n"
        "mov.u32 c, %clock;\n"
        "mov.u32 b, %ctaid.x;\n"
        "setp.eq.u32 p, b, 0;\n"
        f"setp.lt.and.u32 p, {idx}, {int(limit)}, p;\n"
        f"mov.u64 a, {int(buffer.address)};\n"
        f"mad.wide.u32 a, {idx}, 4, a;\n"
        "@p st.global.u32 [a], c;\n"
        "mov.b32 $0, $1; }"
    )
