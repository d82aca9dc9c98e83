"""The plain quantiser in one persistent launch: each block of rows is read from HBM once and, a while
later, again from L2.

The two-pass quantiser (kernels/quantize_passes.py) reads every row twice, and at Q, K and V sizes of a
long prefill (128 MB each) the second read comes from HBM too. Its order is forced: a (batch, kv head)'s
codes need its amax, so every one of its rows must be read before any of its codes is written. Here
the work items are the two-pass grid's blocks (`_program_rows`, in its order: segment, batch, head,
rows, so the blocks of one unit, a (batch, kv head) of one tensor with its GQA group's q heads, are
consecutive), handed out in order by a ticket counter. Ticket t does pass 1 of block t (its amax
folded into AMAX[unit], then ARRIVED[unit] += 1, release) and pass 2 of block t - LAG (wait until
ARRIVED of its unit is the unit's block count C, acquire; read its amax; reload the rows, read LAG
blocks ago and still in L2; write the codes). Tickets run to CHUNKS + LAG: those past CHUNKS only
drain pass 2 of the last LAG blocks, so one counter and one loop do both.

Deadlock freedom, whatever the residency and order of the programs: LAG >= every C (`onepass_lag`), so
the unit of block t - LAG ends at block t - LAG + C - 1 < t at the latest: every block a ticket waits
on was ticketed earlier, by a program already running (tickets past CHUNKS wait on blocks below
CHUNKS). A program does the pass 1 of its ticket before it waits on anything, and pass 1 never waits,
so every block waited on arrives. (In Triton's interpreter programs run one after another: program 0
takes every ticket, and each wait is already met when it starts.)

The arithmetic is the two passes' (`_abs_max`, `_fold_amax`, `_scale_of`, `_plain_codes`), so codes and
descales are theirs bitwise, a NaN unit's descale NaN as before. The counters (ARRIVED, one per unit,
and TICKET) sit in the zeroed amax buffer after the amaxes: no launch but the zeroing one before.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .quantize_passes import (
    _SEGMENT_ARGS,
    _abs_max,
    _balanced_block,
    _fold_amax,
    _free_masks,
    _free_slot,
    _pick,
    _plain_codes,
    _program_rows,
    _scale_of,
)

#: rows x padded head dim per block (64 rows at hd128, 16 KB of bf16): larger than the two-pass's
#: 4096, since every block costs a few dependent atomics; at most ONEPASS_ROWS rows
ONEPASS_TILE, ONEPASS_ROWS, ONEPASS_WARPS = 8192, 128, 4
#: resident programs per SM: enough blocks in flight to cover HBM latency, few enough that the rows
#: read between a block's two reads (about LAG + grid blocks) stay well within L2 (part of a plan's key,
#: so that benchmarks/balanced_v_blocks.py can time others)
PROGRAMS_PER_SM = 4
#: programs where there is no GPU to count SMs of (Triton's interpreter runs them one after another)
INTERPRETED_PROGRAMS = 4
#: lag beyond a unit's blocks, in programs of the grid: with LAG just the blocks of a unit, pass 2 of a unit's
#: blocks waits on its last blocks, ticketed just before (still being read); this many programs' worth of
#: tickets later they have mostly arrived, for as many blocks more of rows held in L2 between the two reads
LAG_SLACK = 0.5
#: L2 eviction priorities (compiled in): the first read's rows are kept for the second, whose rows and the
#: codes (read by the next kernel, not by this one) go first
_FIRST_READ, _SECOND_READ, _CODES_STORE = (
    tl.constexpr("evict_last"),
    tl.constexpr("evict_first"),
    tl.constexpr("evict_first"),
)


def onepass_tiles(d: int) -> tuple[int, int, int, int]:
    """(rows per block, head dim padded to a power of two, columns per codes step, warps): `_tiles`'s
    contract for the one-pass kernel."""
    dp = triton.next_power_of_2(d)
    return max(16, min(ONEPASS_ROWS, ONEPASS_TILE // dp)), dp, dp, ONEPASS_WARPS


def onepass_programs(device: torch.device, chunks: int) -> int:
    """The persistent grid: PROGRAMS_PER_SM a multiprocessor (INTERPRETED_PROGRAMS off a GPU), at most one a
    block (none where there are none)."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count * PROGRAMS_PER_SM
    else:
        sms = INTERPRETED_PROGRAMS
    return min(sms, chunks)


def onepass_lag(unit_blocks: int, programs: int) -> int:
    """LAG: at least the most blocks of a unit (`unit_blocks`, what deadlock freedom needs), plus LAG_SLACK
    times the grid."""
    return unit_blocks + int(programs * LAG_SLACK)


@triton.jit(do_not_specialize=_SEGMENT_ARGS + ["CHUNKS", "LAG", "ARRIVED_AT", "TICKET_AT"])
def _onepass_kernel(
    X0,
    X1,
    X2,
    R,
    MEAN,
    AMAX,
    FREE,
    CU0,
    CU1,
    CU2,
    WEIGHT,
    DESCALE,
    OUT0,
    OUT1,
    OUT2,
    P1,
    P2,
    F0,
    F1,
    F2,
    S0,
    S1,
    S2,
    H0,
    H1,
    H2,
    G0,
    G1,
    G2,
    SB0,
    SB1,
    SB2,
    SS0,
    SS1,
    SS2,
    SH0,
    SH1,
    SH2,
    stride_d,
    D,
    inv_sqrt,
    SKP,
    NSEQ,
    STEPS,
    CHUNKS,
    LAG,
    ARRIVED_AT,
    TICKET_AT,
    NSEG: tl.constexpr,
    DP: tl.constexpr,
    BN: tl.constexpr,
    BLOCK_S: tl.constexpr,
    CENTER: tl.constexpr,
    ROTATE: tl.constexpr,
    TERMS: tl.constexpr,
    LAST_K_MAJOR: tl.constexpr,
    BALANCED: tl.constexpr,
    PACKED: tl.constexpr,
):
    """Both passes of CHUNKS blocks (the module docstring): `_codes_kernel`'s arguments and, in the int32
    view of AMAX, the per-unit arrival counts from ARRIVED_AT (indexed as AMAX) and the ticket at TICKET_AT,
    all zero at launch. Plain rows, or BALANCED ones (V alone, `_codes_kernel`'s rounding: pass 1 also stores
    which keys of each 16 may move, pass 2 reads them back); no rotation, centring or packing."""
    tl.static_assert(not (CENTER or ROTATE or PACKED), "one pass: plain or balanced rows only")
    counts = AMAX.to(tl.pointer_type(tl.int32))
    arrived = counts + ARRIVED_AT
    t = tl.atomic_add(counts + TICKET_AT, 1, sem="relaxed")
    while t < CHUNKS + LAG:
        for p in tl.static_range(2):  # pass 1 of block t (never waits), then pass 2 of block t - LAG
            go = t < CHUNKS
            if p == 1:
                go = t >= LAG
            if go:
                x, seg, b, h, kv, s0, S, H, GROUP, src, stride_s, first = _program_rows(
                    X0,
                    X1,
                    X2,
                    MEAN,
                    CU0,
                    CU1,
                    CU2,
                    P1,
                    P2,
                    F0,
                    F1,
                    F2,
                    S0,
                    S1,
                    S2,
                    H0,
                    H1,
                    H2,
                    G0,
                    G1,
                    G2,
                    SB0,
                    SB1,
                    SB2,
                    SS0,
                    SS1,
                    SS2,
                    SH0,
                    SH1,
                    SH2,
                    stride_d,
                    D,
                    NSEQ,
                    STEPS,
                    NSEG,
                    DP,
                    BLOCK_S,
                    CENTER,
                    PACKED,
                    not BALANCED,
                    t - LAG * p,
                    _FIRST_READ if p == 0 else _SECOND_READ,
                )
                if p == 0:
                    if BALANCED:  # (the masks stored before the release below, as the rows' amax is folded)
                        m = _free_masks(
                            src, stride_s, stride_d, FREE + _free_slot(b, h, H, s0, SKP), S - s0, D, DP, BLOCK_S
                        )
                    else:
                        m = _abs_max(x.to(tl.float32))
                    _fold_amax(AMAX, kv, m)
                    tl.debug_barrier()  # (every thread's part of the block done before it counts as arrived)
                    tl.atomic_add(arrived + kv, 1, sem="release")
                else:  # once its unit's blocks have all arrived
                    blocks = tl.cdiv(S, BLOCK_S) * GROUP
                    while tl.atomic_add(arrived + kv, 0, sem="acquire") < blocks:
                        pass
                    # (an atomic read: served by L2, where the other programs' atomic maxes are)
                    amax = tl.atomic_add(counts + kv, 0, sem="relaxed").to(tl.float32, bitcast=True)
                    scale = _scale_of(amax, DESCALE, kv, first & (h % GROUP == 0))
                    k_major = False
                    if LAST_K_MAJOR:
                        k_major = seg == NSEG - 1
                    out = _pick(seg, OUT0, OUT1, OUT2, NSEG)
                    if BALANCED:
                        _balanced_block(src, stride_s, stride_d, S, s0, D, b, h, H, GROUP, scale, out, FREE, WEIGHT,
                                        SKP, k_major, DP, BLOCK_S)  # fmt: skip
                    else:
                        _plain_codes(
                            x,
                            R,
                            inv_sqrt,
                            scale,
                            out,
                            s0,
                            S,
                            D,
                            b,
                            h,
                            H,
                            SKP,
                            k_major,
                            DP,
                            BN,
                            ROTATE,
                            TERMS,
                            BLOCK_S,
                            _CODES_STORE,
                        )
        t = tl.atomic_add(counts + TICKET_AT, 1, sem="relaxed")
