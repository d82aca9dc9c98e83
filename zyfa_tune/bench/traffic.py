"""The memory-traffic floor of FP8 input quantisation, and each quantiser's time against it.

Every recipe must read Q, K and V once and write their e4m3 codes and float32 (batch, kv head)
descales once; nothing faster is possible than moving those bytes at the rate the GPU copies
memory. That rate is measured in the same run, interleaved with the quantisers in the timing
rounds (`bench.peers.quantiser.Copy`: a device-to-device copy whose reads plus writes are those
bytes), so that clocks and the card's state are the same for both. The floor of a row is then
its bytes at the copy's rate, and `floor_ratio` = its time / floor: 1.0 would be a quantiser that
moves its data as fast as a copy does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from zyfa_tune.bench.results import BenchRow
from zyfa_tune.bench.shape import BenchShape

#: e4m3 codes: one byte an element; descales: float32
CODE_BYTES, DESCALE_BYTES = 1, 4


def traffic_bytes(shape: BenchShape, input_bytes: int = 2) -> int:
    """Bytes a quantiser of one shape must move: Q (heads), K and V (kv heads) read once at
    `input_bytes` an element (bf16: 2), their codes written once, and the three (batch, kv_heads)
    descales written (packed sequences: every sequence's tokens, a descale per sequence and kv head,
    as quantize_fp8_varlen returns them)."""
    if isinstance(input_bytes, bool) or not isinstance(input_bytes, int) or input_bytes <= 0:
        raise ValueError(f"input_bytes: expected a positive element size in bytes (bf16: 2), got {input_bytes!r}")
    tokens = shape.tokens
    elements = tokens * (shape.heads * shape.head_dim_qk + shape.kv_heads * (shape.head_dim_qk + shape.head_dim_v))
    return elements * (input_bytes + CODE_BYTES) + 3 * shape.batch * shape.kv_heads * DESCALE_BYTES


def gbps(bytes_moved: int, ms: float) -> float:
    """Decimal GB/s of `bytes_moved` in `ms` milliseconds."""
    return bytes_moved / (ms * 1e-3) / 1e9


def with_floor(rows: Sequence[BenchRow]) -> list[BenchRow]:
    """Rows of one shape with each memory-traffic row's floor filled in from the copy row's rate
    (rows as they were where no copy row was measured)."""
    copy = next((r for r in rows if r.kind == "copy" and r.median_ms and r.bytes_moved), None)
    if copy is None:
        return list(rows)
    rate = copy.bytes_moved / copy.median_ms  # bytes a millisecond
    out = []
    for r in rows:
        if r.bytes_moved and r.median_ms:
            floor = r.bytes_moved / rate
            r = dataclasses.replace(r, floor_ms=floor, floor_ratio=r.median_ms / floor)
        out.append(r)
    return out
