"""Host cost of `flash_attn_func` against a direct launch of the same compiled kernel.

Small shapes, where launch cost dominates. "compiled launch" is Triton's own launch of the
CompiledKernel with its arguments made beforehand (it encodes each TMA descriptor per launch);
"bound" is flash_attn_func's launch alone (kernels/launch.py BoundLaunch: descriptors encoded once
per pointer, the V^T copy included, no output allocated). Host time per call is measured while launches queue
(no synchronisation inside the timed loop, fewer calls than the launch queue holds), so it is the
CPU time each path spends before the kernel is enqueued. FP8 rows: the dispatcher's pick with V
as given (a V^T-copy kernel is two launches, a natural-V kernel one; short sequences tune to the
latter), its pick for a K-major V (no copy), and, beside a V^T-copy pick, the one-launch natural-V
kernel the study measured against it; each with its device time per call, and marked
"launch-bound" where the call's host time exceeds it. Also checks that `flash_attn_func` can be
captured in a CUDA graph and replays bitwise identically.

    python benchmarks/dispatch_overhead.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from zyfa_tune import explain, flash_attn_func
from zyfa_tune.kernels import launch as launch_mod
from zyfa_tune.search_spaces.seeds import gluon_natural_config
from zyfa_tune.tuning.timing import gpu_state, host_us, time_cuda
from zyfa_tune.tuning.verify import make_inputs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    rows = []
    print(gpu_state(), flush=True)
    for dtype in ("fp8", "bf16"):
        for b, s, h in ((1, 128, 8), (1, 512, 16), (4, 1024, 16)):
            given = make_inputs(dtype, 128, 128, batch=b, heads=h, kv_heads=h, seqlen=s, seed=0)
            choice = explain(*given[0], **given[1])
            variants = [("auto", given, choice.config, True)]
            if dtype == "fp8":  # V stored as FP8 kernels read it: the dispatcher's pick for that layout
                k_major = make_inputs(
                    dtype, 128, 128, batch=b, heads=h, kv_heads=h, seqlen=s, seed=0, v_layout="k_major"
                )
                variants.append(("K-major V", k_major, explain(*k_major[0], **k_major[1]).config, True))
                if choice.config.v_layout == "transposed":  # the one-launch alternative the tuner measured
                    variants.append(("natural V", given, one_launch(choice.config), False))
            for label, (args, kw), cfg, auto in variants:
                q, k, v = args
                out = flash_attn_func(*args, config=cfg, **kw)
                grid, largs, opts = launch_mod.prepare(
                    cfg, q, k, v, torch.empty_like(out), q.shape[-1] ** -0.5, True, *(kw.get(n) for n in DESCALES)
                )
                runner = launch_mod.kernel(cfg)[grid](*largs, **opts)[(grid[0], 1, 1)]  # the CompiledKernel
                out_b = torch.empty_like(out)
                bound = launch_mod.bind(cfg, q, k, v, out_b, q.shape[-1] ** -0.5, True, *(kw.get(n) for n in DESCALES))
                fns = dict(
                    direct=lambda: runner(*largs, opts["CAUSAL"]),  # arguments (and V^T) made beforehand
                    forced=lambda: flash_attn_func(*args, config=cfg, **kw),
                )
                if bound is not None:  # flash_attn_func's launch alone (V^T copy included), no output allocated
                    fns["bound"] = lambda: bound(q, k, v, out_b, *(kw.get(n) for n in DESCALES))
                if auto:
                    fns["auto"] = lambda: flash_attn_func(*args, **kw)  # the dispatcher's choice
                t = host_us(fns)
                ours = t.get("auto", t["forced"])
                gpu_ms = device_ms(lambda: flash_attn_func(*args, config=cfg, **kw))
                row = dict(
                    dtype=dtype,
                    b=b,
                    s=s,
                    h=h,
                    variant=label,
                    source=choice.source,
                    compiled_launch_us=t["direct"],
                    flash_attn_func_us=t.get("auto"),
                    forced_config_us=t["forced"],
                    added_vs_compiled_us=ours - t["direct"],
                    bound_launch_us=t.get("bound"),
                    launches=1 + (bound is not None and bound.transpose is not None),
                    gpu_us_per_call=gpu_ms * 1e3,
                    launch_bound=ours > gpu_ms * 1e3,
                    config=cfg.to_dict(),
                )
                if label == "auto":
                    row.update(graph_capture(args, kw))
                rows.append(row)
                print(
                    f"{dtype} B={b} S={s} H={h} {label:9s}: compiled launch {t['direct']:5.1f} us  "
                    f"(bound {t.get('bound', float('nan')):5.1f})  "
                    f"flash_attn_func {ours:5.1f} us (config given {t['forced']:5.1f})  added "
                    f"{ours - t['direct']:+5.1f} us  device time {gpu_ms * 1e3:6.1f} us/call  "
                    f"{row['launches']} launch(es){'  launch-bound' if row['launch_bound'] else ''}"
                    + (
                        f"  graph bitwise={row['graph_bitwise']} replay {row['graph_replay_host_us']:4.1f} us "
                        f"[{choice.source}] {cfg.summary()}"
                        if label == "auto"
                        else ""
                    ),
                    flush=True,
                )
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


DESCALES = ("q_descale", "k_descale", "v_descale")


def one_launch(config):
    """The natural-V kernel a study measures beside a V^T-copy winner (`gluon_natural_config`; for
    Triton the same config reading V as given)."""
    if config.backend == "gluon":
        return gluon_natural_config(config.dtype, config.head_dim_qk, config.head_dim_v)
    return config.replace(v_layout="natural")


def device_ms(fn, calls: int = 20) -> float:
    """Device time of one call, without the host's launch gaps: `calls` calls captured in a CUDA
    graph, replays timed with events (METHOD.md: time many small launches through a graph)."""
    g = capture(lambda: [fn() for _ in range(calls)])
    return time_cuda([g.replay], reps=50).median_ms / calls


def capture(fn) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `fn` (run once on a side stream first, as graph capture wants)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def graph_capture(args, kw) -> dict:
    """Capture flash_attn_func in a CUDA graph; replay must equal an eager call bitwise."""
    outs = []
    g = capture(lambda: outs.append(flash_attn_func(*args, **kw)))
    static_out = outs[-1]
    g.replay()
    torch.cuda.synchronize()
    return dict(
        graph_bitwise=torch.equal(static_out, flash_attn_func(*args, **kw)),
        graph_replay_host_us=host_us(dict(replay=g.replay))["replay"],
    )


if __name__ == "__main__":
    sys.exit(main())
