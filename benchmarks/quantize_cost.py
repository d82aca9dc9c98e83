"""What FP8 input quantisation costs next to the attention it feeds (the options that buy accuracy,
Hadamard rotation and K smoothing among them, measured against the attention they serve).

For each shape: bf16 Q, K, V (gaussian family), then device time (median, `time_cuda`) and host time
per call (`host_us`: what a launch-bound caller waits) of `quantize_fp8` with each option (the Triton
kernels of kernels/quantize.py), device time of the same arithmetic
in torch ops (`quantize_heads_reference`, the unfused form), and of the attention on
the quantised inputs: `flash_attn_func` (the dispatcher's kernel) and FA3-fp8, same process, same
inputs. (Each recipe's quantiser against its memory-traffic floor, a copy of the same bytes timed in
the same rounds: `zyfa-tune bench --quant-floor`.)

    python benchmarks/quantize_cost.py [--seqlens 4096,8192,16384,32768] [--heads 32] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import torch

from zyfa_tune import flash_attn_func
from zyfa_tune.kernels.quantize import quantize_heads_reference
from zyfa_tune.quantize import quantize_fp8
from zyfa_tune.tuning.inputs import make_qkv
from zyfa_tune.tuning.timing import attention_flops, gpu_state, host_us, time_cuda, warm_gpu

OPTIONS = {
    "plain": {},
    "hadamard": dict(hadamard=True),
    "smooth_k": dict(smooth_k=True),
    "smooth_k+hadamard": dict(smooth_k=True, hadamard=True),
    "balanced_v": dict(v_rounding="balanced"),
    # kappa given: without balance_weights' sample of the scores (what estimating it costs)
    "balanced_v kappa 0": dict(v_rounding="balanced", v_weight=0.0),
    "smooth_k+hadamard+balanced_v": dict(smooth_k=True, hadamard=True, v_rounding="balanced", v_layout="k_major"),
}


def _torch_path(q, k, v, hadamard: bool, smooth_k: bool, balance: bool) -> None:
    hk = k.shape[2]
    mean = k.float().mean(dim=1) if smooth_k else None
    quantize_heads_reference(q, hk, rotate=hadamard)
    quantize_heads_reference(k, hk, rotate=hadamard, mean=mean)
    quantize_heads_reference(v, hk, balance=balance)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlens", default="4096,8192,16384,32768")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=16384, help="batch = max(1, tokens // seqlen)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    try:
        from fa3_fwd_interface import flash_attn_func as fa3
    except ImportError:
        fa3 = None
    rows = []
    warm_gpu(3.0)  # sustained clocks before the first shape
    for s in (int(x) for x in args.seqlens.split(",")):
        b, h, d = max(1, args.tokens // s), args.heads, args.head_dim
        q, k, v = (
            t.to(torch.bfloat16)
            for t in make_qkv(
                "gaussian", batch=b, seqlen=s, heads=h, kv_heads=h, head_dim_qk=d, head_dim_v=d, seed=s, device="cuda"
            )
        )
        row = dict(batch=b, seqlen=s, heads=h, head_dim=d)
        for name, opts in OPTIONS.items():
            call = functools.partial(quantize_fp8, q, k, v, **opts)
            row[f"kernels {name}"] = time_cuda([call], warmup=3, reps=args.reps).median_ms
            row[f"host us {name}"] = host_us({name: call}, calls=50, rounds=7)[name]
            row[f"torch {name}"] = time_cuda(
                [
                    lambda o=opts: _torch_path(
                        q, k, v, o.get("hadamard", False), o.get("smooth_k", False), o.get("v_rounding") == "balanced"
                    )
                ],
                warmup=2,
                reps=max(5, args.reps // 4),
            ).median_ms
        q8, k8, v8, qd, kd, vd = quantize_fp8(q, k, v)
        kw = dict(causal=True, q_descale=qd, k_descale=kd, v_descale=vd)
        flops = attention_flops(b, h, s, s, d, d, causal=True)
        row["attention ours"] = time_cuda(
            [lambda: flash_attn_func(q8, k8, v8, **kw)], warmup=3, reps=args.reps
        ).median_ms
        if fa3 is not None:
            row["attention fa3-fp8"] = time_cuda([lambda: fa3(q8, k8, v8, **kw)], warmup=3, reps=args.reps).median_ms
        row["tflops ours"] = flops / row["attention ours"] / 1e9
        rows.append(row)
        att = row["attention ours"]
        print(
            f"B={b} S={s} H={h} d={d}: attention ours {att:.3f} ms"
            + (f", FA3-fp8 {row['attention fa3-fp8']:.3f} ms" if fa3 else ""),
            flush=True,
        )
        for name in OPTIONS:
            kt, tt = row[f"kernels {name}"], row[f"torch {name}"]
            host = row[f"host us {name}"]
            print(
                f"  quantize {name:18s} kernels {kt:7.3f} ms ({100 * kt / att:5.1f}% of attention), host "
                f"{host:5.1f} us a call   torch ops {tt:7.3f} ms ({100 * tt / att:5.1f}%)",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(rows=rows, gpu=gpu_state()), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
