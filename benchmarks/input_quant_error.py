"""Error that FP8 input quantisation alone adds, per input family and quantisation option (CPU).

Float64 attention on the dequantised q8, k8, v8 against float64 attention on the unquantised
inputs; no kernel involved, so this is the floor every FP8 kernel (ours, FA3, cuDNN) starts from when
it quantises the same way. Options: plain per-(batch, kv head) scales (what FA3 is given), Hadamard
rotation of Q and K, K smoothing (mean over tokens removed), both. `entry_outliers` is the FA3
paper's test distribution, N(0,1) + N(0,100) * Bernoulli(0.001) per entry (zyfa_tune/tuning/inputs.py).

    python benchmarks/input_quant_error.py [--seqlen 1024] [--seeds 0,1] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys

from zyfa_tune.quantize import dequantize_fp8, quantize_fp8
from zyfa_tune.tuning.inputs import FAMILY_NAMES, make_qkv
from zyfa_tune.tuning.reference import attention_reference, rel_l2

OPTIONS = {
    "plain": {},
    "hadamard": dict(hadamard=True),
    "smooth_k": dict(smooth_k=True),
    "smooth_k+hadamard": dict(smooth_k=True, hadamard=True),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlen", type=int, default=1024)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    seeds = [int(s) for s in a.seeds.split(",")]
    shape = dict(batch=1, seqlen=a.seqlen, heads=4, kv_heads=2)
    rows = []
    print(f"B=1 S={a.seqlen} H=4/2 d=128 causal; rel. L2 vs float64 on unquantised inputs, seeds {seeds}")
    for fam in FAMILY_NAMES:
        errs: dict[str, list[float]] = {o: [] for o in OPTIONS}
        for seed in seeds:
            q, k, v = make_qkv(fam, head_dim_qk=128, head_dim_v=128, seed=seed, device="cpu", **shape)
            ref = attention_reference(q.double(), k.double(), v.double(), causal=True)
            for name, kw in OPTIONS.items():
                q8, k8, v8, qd, kd, vd = quantize_fp8(q, k, v, **kw)
                out = attention_reference(
                    dequantize_fp8(q8, qd), dequantize_fp8(k8, kd), dequantize_fp8(v8, vd), causal=True
                )
                errs[name].append(rel_l2(out, ref))
        rows.append(dict(family=fam, **{o: e for o, e in errs.items()}))
        print(f"{fam:15s} " + "  ".join(f"{o} {'/'.join(f'{x:.3f}' for x in e)}" for o, e in errs.items()))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
