"""Host cost of `flash_attn_func` against a direct launch of the same compiled kernel.

Small shapes, where launch cost dominates. Host time per call is measured while launches queue
(no synchronisation inside the timed loop, fewer calls than the launch queue holds), so it is the
CPU time each path spends before the kernel is enqueued. Also checks that `flash_attn_func` can be
captured in a CUDA graph and replays bitwise identically.

    python benchmarks/dispatch_overhead.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from zyfa_tune import explain, flash_attn_func, quantize_fp8
from zyfa_tune.kernels import launch as launch_mod


def host_us(fn, calls: int = 200, rounds: int = 15) -> float:
    """Median over rounds of the host time per call of `calls` back-to-back calls."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        per_call.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(per_call)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    rows = []
    for dtype in ("fp8", "bf16"):
        for (b, s, h) in ((1, 128, 8), (1, 512, 16), (4, 1024, 16)):
            q = torch.randn(b, s, h, 128, device="cuda")
            k = torch.randn(b, s, h, 128, device="cuda")
            v = torch.randn(b, s, h, 128, device="cuda")
            if dtype == "fp8":
                q, k, v, qd, kd, vd = quantize_fp8(q, k, v)
                kw = dict(q_descale=qd, k_descale=kd, v_descale=vd)
            else:
                q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
                kw = {}
            choice = explain(q, k, v, **kw)
            out = flash_attn_func(q, k, v, **kw)
            grid, args, opts = launch_mod.prepare(choice.config, q, k, v, torch.empty_like(out), q.shape[-1] ** -0.5,
                                                  True, *(kw.get(n) for n in ("q_descale", "k_descale", "v_descale")))
            kern = launch_mod.kernel(choice.config)
            direct = host_us(lambda: kern[grid](*args, **opts))  # Triton's JIT launch
            runner = kern[grid](*args, **opts)[(grid[0], 1, 1)]  # the CompiledKernel's own launcher
            compiled = host_us(lambda: runner(*args, opts["CAUSAL"]))
            ours = host_us(lambda: flash_attn_func(q, k, v, **kw))
            forced = host_us(lambda: flash_attn_func(q, k, v, config=choice.config, **kw))
            # CUDA graph capture and bitwise replay
            static_out = None
            g = torch.cuda.CUDAGraph()
            s_ = torch.cuda.Stream()
            s_.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s_):
                flash_attn_func(q, k, v, **kw)
            torch.cuda.current_stream().wait_stream(s_)
            with torch.cuda.graph(g):
                static_out = flash_attn_func(q, k, v, **kw)
            g.replay()
            torch.cuda.synchronize()
            graph_ok = torch.equal(static_out, flash_attn_func(q, k, v, **kw))
            t_replay = host_us(g.replay)
            row = dict(dtype=dtype, b=b, s=s, h=h, source=choice.source, triton_jit_launch_us=direct,
                       compiled_launch_us=compiled, flash_attn_func_us=ours, forced_config_us=forced,
                       added_vs_triton_us=ours - direct, added_vs_compiled_us=ours - compiled, graph_bitwise=graph_ok,
                       graph_replay_host_us=t_replay, config=choice.config.to_dict())
            rows.append(row)
            print(f"{dtype} B={b} S={s} H={h}: triton launch {direct:6.1f} us  compiled launch {compiled:6.1f} us  "
                  f"flash_attn_func {ours:6.1f} us (config forced {forced:6.1f})  added vs triton {ours - direct:+6.1f} "
                  f"vs compiled {ours - compiled:+6.1f} us  graph bitwise={graph_ok} replay {t_replay:5.1f} us "
                  f"[{choice.source}]", flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
