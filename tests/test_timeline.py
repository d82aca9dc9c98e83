"""The timeline instrumentation (generator/gluon_sm90/trace.py, zyfa_tune/bench/timeline.py) without a GPU: what
reaches the PTX is validated, the stamps compile away when not tracing and into clock reads (no
spills) when tracing, and the stamps' decoding."""

from __future__ import annotations

import numpy as np
import pytest

from zyfa_tune.bench.timeline import from_stamps
from zyfa_tune.cli import main
from zyfa_tune.generator.build import compile_for_target
from zyfa_tune.generator.gluon_sm90.emit import emit
from zyfa_tune.generator.gluon_sm90.trace import EVENT_INDEX, EVENTS, TraceBuffer, clock_asm
from zyfa_tune.search_spaces.seeds import gluon_defer_config, gluon_packed_config, gluon_three_config, gluon_wide_config

WIDE = gluon_wide_config("fp8", 128, 128)
ADDR = 0x7F00_0000_0000


@pytest.mark.parametrize(
    "address,steps,error",
    [
        (0, 16, ValueError),
        (ADDR + 2, 16, ValueError),
        (2**64, 16, ValueError),
        (ADDR, 0, ValueError),
        (ADDR, 2**21, ValueError),
        (float(ADDR), 16, TypeError),
        (True, 16, TypeError),
        ("0x7f", 16, TypeError),
        (ADDR, "16; ret;", TypeError),
    ],
)
def test_trace_buffer_is_validated(address, steps, error):
    with pytest.raises(error):
        TraceBuffer(address=address, steps=steps)


def test_clock_asm_holds_only_the_address_and_the_slot_count():
    buf = TraceBuffer(address=ADDR, steps=100)
    asm = clock_asm(buf, 2, after_value=True)
    assert str(ADDR) in asm and str(2 * 100 * len(EVENTS)) in asm
    assert "%clock" in asm and "%ctaid.x" in asm and "$2" in asm
    assert "$2" not in clock_asm(buf, 2, after_value=False)
    with pytest.raises(TypeError):
        emit(WIDE, trace=(ADDR, 100))


def test_untraced_source_differs_only_in_the_trace_constants():
    plain = emit(WIDE).source.splitlines()
    traced = emit(WIDE, trace=TraceBuffer(address=ADDR, steps=64)).source.splitlines()
    diff = [(a, b) for a, b in zip(plain, traced) if a != b]
    assert len(plain) == len(traced)
    assert sorted(a.split(" = ")[0] for a, _ in diff) == ["TRACE", "TRACE_AFTER_ASM", "TRACE_ASM", "TRACE_STEPS"]
    assert "TRACE = gl.constexpr(False)" in plain and "TRACE = gl.constexpr(True)" in traced


@pytest.mark.parametrize(
    "cfg",
    [
        WIDE,
        gluon_packed_config("fp8", 128, 128),
        gluon_three_config("fp8", 64, 64),
        gluon_defer_config("fp8", 256, 256),
    ],
    ids=["wide", "packed-overlap", "hd64-three-consumers", "hd256-pv-defer"],
)
def test_stamps_compile_to_clock_reads_only_when_traced(cfg):
    plain = compile_for_target(emit(cfg), causal=True)
    traced = compile_for_target(emit(cfg, trace=TraceBuffer(address=ADDR, steps=64)), causal=True)
    assert "SR_CLOCKLO" not in plain.sass
    # every event of the step loops (masked and unmasked copies, two consumer partitions)
    assert traced.sass.count("SR_CLOCKLO") >= 2 * 6
    assert traced.spill_bytes == 0 and traced.serialised_wgmma is None
    assert traced.count("QGMMA") == plain.count("QGMMA")
    assert traced.count("MUFU.EX2") == plain.count("MUFU.EX2")


def _raw(steps: int, deltas: list[int], start: int = 1000, period: int = 500, lag: int = 37) -> np.ndarray:
    """Stamps of two warpgroups: event e of step s at start + lag * w + s * period + sum(deltas[:e])."""
    raw = np.zeros((2, steps, len(EVENTS)), dtype=np.int64)
    for w in range(2):
        for s in range(steps):
            raw[w, s] = start + lag * w + s * period + np.concatenate([[0], np.cumsum(deltas)])
    return raw


def test_phases_are_the_medians_between_consecutive_events():
    deltas = [10, 20, 30, 40, 50, 60, 70, 80]
    tl = from_stamps(WIDE, _raw(20, deltas).astype(np.uint32).view(np.int32))
    assert tl.events() == list(range(len(EVENTS)))
    phases = tl.phases(1)
    assert [p.median for p in phases[:-1]] == deltas
    assert (phases[-1].start, phases[-1].end, phases[-1].median) == ("pv_done", "next start", 500 - sum(deltas))
    assert tl.period(0) == 500
    first = tl.sample(3, count=1)
    assert [w for w, _, _ in first] == [0, 1] and first[0][2]["start"] == 0 and first[1][2]["start"] == 37
    with pytest.raises(ValueError, match="step 20"):
        tl.sample(20)


@pytest.mark.parametrize(
    "lag,overlap",
    [
        (37, 73 / 110),  # softmaxes [100, 210] and [137, 247]: 73 of warpgroup 0's 110 cycles side by side
        (0, 1.0),  # lockstep
        (250, 0.0),  # half a period apart: one softmax after the other
        (450, 60 / 110),
    ],
)  # warpgroup 1's softmax of the step before, [50, 160] on step s's clock, overlaps it
def test_interleave_measures_the_offset_and_the_softmaxes_side_by_side(lag, overlap):
    deltas = [10, 20, 30, 40, 50, 60, 70, 80]  # qk_done at 100, softmax_done at 210 in a 500-cycle step
    tl = from_stamps(WIDE, _raw(20, deltas, lag=lag).astype(np.int32))
    il = tl.interleave(1)
    assert (il.warpgroup, il.offset, il.steps) == (1, lag, 20)
    assert il.offset_share == pytest.approx(lag / 500)
    assert il.softmax_overlap == pytest.approx(overlap)


def test_interleave_needs_a_second_warpgroup_and_whole_steps():
    tl = from_stamps(WIDE, _raw(6, [5] * 8).astype(np.int32))
    for bad in (0, 2):
        with pytest.raises(ValueError, match="warpgroup must be in"):
            tl.interleave(bad)
    raw = _raw(6, [5] * 8)
    raw[0, :, EVENT_INDEX["softmax_done"]] = 0  # warpgroup 0 never recorded a softmax's end
    with pytest.raises(ValueError, match="no step recorded whole"):
        from_stamps(WIDE, raw.astype(np.int32)).interleave(1)


def test_unrecorded_events_and_steps_are_skipped():
    raw = _raw(10, [5] * 8)
    raw[:, :, EVENT_INDEX["pv_issued"]] = 0  # the overlapped step has no pv_issued
    raw[:, 6:, :] = 0  # steps past the end of the kernel
    tl = from_stamps(WIDE, raw.astype(np.int32))
    assert EVENT_INDEX["pv_issued"] not in tl.events()
    phases = tl.phases(0)
    assert [(p.start, p.end) for p in phases][6] == ("softmax_done", "pv_done")
    assert phases[6].median == 10 and all(p.steps in (6, 5) for p in phases)


def test_the_32_bit_clock_is_unwrapped():
    raw = _raw(8, [100] * 8, start=2**32 - 2001)  # (a clock reading of exactly 0 reads as "not recorded")
    tl = from_stamps(WIDE, (raw % 2**32).astype(np.uint32).view(np.int32))
    assert tl.period(0) == 500 and [p.median for p in tl.phases(0)[:-1]] == [100] * 8
    assert tl.clocks.min() == 0


def test_stamp_cost_is_the_traced_launch_over_the_plain_one():
    raw = _raw(6, [5] * 8).astype(np.int32)
    assert from_stamps(WIDE, raw).stamp_cost() is None  # not timed
    assert from_stamps(WIDE, raw, traced_ms=2.34, plain_ms=2.0).stamp_cost() == pytest.approx(0.17)
    assert from_stamps(WIDE, raw, traced_ms=2.0, plain_ms=None).stamp_cost() is None


def test_no_stamps_is_an_error():
    with pytest.raises(RuntimeError, match="no stamps"):
        from_stamps(WIDE, np.zeros((2, 4, len(EVENTS)), dtype=np.int32))


def test_cli_timeline_needs_a_gpu(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert main(["timeline", "--seqlen", "1024"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out
