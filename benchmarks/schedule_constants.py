"""The balanced tile schedule's two settings (the config's l2_group_mib, the K/V bytes of the heads kept
in flight together, and kernels/gluon_launch.py's TILE_OVERHEAD_BLOCKS, a tile's cost beyond its key
blocks), timed against each other in one process, rounds interleaved, on the GPU.

    python benchmarks/schedule_constants.py [--groups 8,16,32,64] [--overheads 256,512] [--rounds 3] [--json F]

--groups: MiB per group (KernelConfig's l2_group_mib choices); --overheads: a tile's extra cost in keys
(divided by the kernel's block_n). Kernels: the hd128 256-key seed at 4K / 8K / 16K and
the hd256 pv_defer seed at 8K (batch x seqlen = 16K tokens, 32 heads). Why the schedule has them: docs/design.md.
"""

from __future__ import annotations

import argparse
import json
import statistics

from zyfa_tune import api, flash_attn_func
from zyfa_tune.kernels import gluon_launch
from zyfa_tune.search_spaces.seeds import gluon_defer_config, gluon_wide_config
from zyfa_tune.tuning.timing import attention_flops, time_cuda, warm_gpu
from zyfa_tune.tuning.verify import make_inputs

SHAPES = (
    ("hd128", gluon_wide_config, 128, 4, 4096),
    ("hd128", gluon_wide_config, 128, 2, 8192),
    ("hd128", gluon_wide_config, 128, 1, 16384),
    ("hd256", gluon_defer_config, 256, 2, 8192),
)


def use_overhead(overhead_keys: int, block_n: int) -> None:
    """Set the tile overhead and drop every table and plan made with the old one."""
    gluon_launch.TILE_OVERHEAD_BLOCKS = overhead_keys / block_n
    gluon_launch.schedule.cache_clear()
    gluon_launch.tile_table.cache_clear()
    api._plans.clear()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", default="8,16,32,64")
    ap.add_argument("--overheads", default="256,512")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    variants = [(int(g), int(o)) for g in args.groups.split(",") for o in args.overheads.split(",")]
    warm_gpu(3.0)
    results: dict[str, list[float]] = {}
    for name, make, dim, batch, seqlen in SHAPES:
        base = make("fp8", dim, dim)
        sets = [
            make_inputs("fp8", dim, dim, batch=batch, heads=32, kv_heads=32, seqlen=seqlen, seed=i) for i in range(2)
        ]
        flops = attention_flops(batch, 32, seqlen, seqlen, dim, dim, True)
        for _ in range(args.rounds):
            for group, overhead in variants:
                use_overhead(overhead, base.block_n)
                cfg = base.replace(l2_group_mib=group)
                calls = [lambda a=a, k=k: flash_attn_func(*a, config=cfg, **k) for a, k in sets]
                for call in calls:  # the table is made outside the timing
                    call()
                t = time_cuda(calls, warmup=3, reps=20)
                key = f"{name} B={batch} S={seqlen} group={group}MiB overhead={overhead}keys"
                results.setdefault(key, []).append(flops / t.median_ms / 1e9)
        for key, tflops in results.items():
            if key.startswith(f"{name} B={batch} S={seqlen} "):
                print(f"{key:52s} {statistics.median(tflops):7.1f} TFLOP/s  rounds {[round(x, 1) for x in tflops]}")
    use_overhead(256, 256)  # the shipped value
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
