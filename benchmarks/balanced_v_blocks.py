"""Balanced V's quantiser at each program size: `quantize_fp8(q, k, v, v_rounding="balanced")` with
`kernels.quantize.BALANCE_BLOCKS` (16-key blocks a program) and `BALANCE_CHANNELS` (channels a thread) set
to each pair, in one persistent launch (`ONE_PASS`) and in two passes, natural and K-major V, and the one
launch's grid at other `PROGRAMS_PER_SM` (whether more programs in flight hide the balanced rows' integer work
behind the reads); beside it what
makes its cost: kappa's estimate alone (`balance_weights`) and the quantiser without it (`v_weight=0`); the
plain quantiser in one pass and in two; and a device-to-device copy of the bytes the quantiser must move (its
floor). All on the same inputs in one process, in interleaved rounds (each round in a rotated order), medians
of each round's median. Each call sets the module constants it is named for (they are part of a plan's key).

    python benchmarks/balanced_v_blocks.py [--seqlen 16384] [--heads 32] [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from zyfa_tune.kernels import quantize as passes
from zyfa_tune.kernels import quantize_onepass as onepass
from zyfa_tune.kernels.balanced_v import balance_weights
from zyfa_tune.quantize import quantize_fp8
from zyfa_tune.tuning.inputs import make_qkv
from zyfa_tune.tuning.timing import gpu_state, time_cuda, warm_gpu

PAIRS = ((1, 1), (2, 1), (4, 1), (4, 2))
#: one launch's programs per SM beside the default
GRIDS = (2, 3, 6, 8)
#: the constants' defaults, restored before each call that is not named for others
DEFAULTS = (passes.BALANCE_BLOCKS, passes.BALANCE_CHANNELS)
PROGRAMS = onepass.PROGRAMS_PER_SM


def _quantizer(q, k, v, one_pass: bool, pair: tuple[int, int] = DEFAULTS, programs: int = PROGRAMS, **options):
    def call():
        passes.ONE_PASS, onepass.PROGRAMS_PER_SM = one_pass, programs
        passes.BALANCE_BLOCKS, passes.BALANCE_CHANNELS = pair
        return quantize_fp8(q, k, v, **options)

    return call


def systems(q, k, v) -> dict[str, object]:
    """name -> call."""
    out: dict[str, object] = {}
    for one_pass in (True, False):
        passes_name = "one pass" if one_pass else "two passes"
        for b, c in PAIRS:
            for layout in ("k_major", "natural"):
                opts = dict(v_rounding="balanced", v_layout=layout)
                out[f"balanced {layout} blocks={b} channels={c} {passes_name}"] = _quantizer(
                    q, k, v, one_pass, (b, c), **opts
                )
        for programs in GRIDS if one_pass else ():
            for layout in ("k_major", "natural"):
                out[f"balanced {layout} {programs} programs an SM one pass"] = _quantizer(
                    q, k, v, one_pass, programs=programs, v_rounding="balanced", v_layout=layout
                )
        out[f"balanced k_major, kappa 0, {passes_name}"] = _quantizer(
            q, k, v, one_pass, v_rounding="balanced", v_layout="k_major", v_weight=0.0
        )
        for layout in ("k_major", "natural"):
            out[f"plain {layout} {passes_name}"] = _quantizer(q, k, v, one_pass, v_layout=layout)
    out["kappa alone (balance_weights)"] = lambda: balance_weights(q, k)
    moved = sum(t.numel() for t in (q, k, v)) * 3  # bf16 read once, e4m3 written once
    src = torch.empty(moved // 2, dtype=torch.uint8, device=q.device)
    dst = torch.empty_like(src)
    out["copy (floor)"] = lambda: dst.copy_(src)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dims = dict(batch=1, seqlen=args.seqlen, heads=args.heads, kv_heads=args.heads)
    x = make_qkv(**dims, head_dim_qk=args.head_dim, head_dim_v=args.head_dim, seed=0, device="cuda")
    q, k, v = (t.to(torch.bfloat16) for t in x)
    calls = systems(q, k, v)
    warm_gpu(2.0)
    times: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(time_cuda([calls[name]], reps=20).median_ms)
    floor = statistics.median(times["copy (floor)"])
    for name in names:
        ms = statistics.median(times[name])
        print(f"{name:52s} {ms:7.3f} ms  {ms / floor:5.2f}x the floor")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": gpu_state(), "shape": vars(args), "ms": times}, f, indent=1)


if __name__ == "__main__":
    main()
