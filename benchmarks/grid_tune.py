"""A small grid search on the GPU that writes verified, timed trials into a tuning database.

Until the Optuna tuner (`zyfa-tune tune`, issue #4) exists, this is how the shipped default
database (zyfa_tune/kernels/tuned/) is made: for each dtype, head-dim pair and sequence length, a
handful of candidate configs are checked against float64 (error gate relative to the exact default
on the same inputs) and timed; every trial is recorded, and the store keeps the fastest correct one
per (GPU, problem class).

    python benchmarks/grid_tune.py --storage out.db [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback

from zyfa_tune.db import ProblemKey, TrialResult, current_fingerprint, open_store
from zyfa_tune.generator import ConfigError, emit
from zyfa_tune.kernels.defaults import default_config
from zyfa_tune.kernels.timing import attention_flops, warm_gpu
from zyfa_tune.kernels.verify import check_config, make_probe

HEAD_DIMS = [(64, 64), (96, 96), (128, 128), (192, 128), (256, 256)]
SEQLENS = [(4, 4096), (2, 8192), (1, 16384)]  # (batch, seqlen) at 32 heads (16 for 192/128)


def candidates(dtype: str, dqk: int, dv: int):
    base = default_config(dtype, dqk, dv)
    big = max(dqk, dv) > 128
    out = [base, base.replace(q_order="forward")]
    if dtype == "fp8":
        out += [base.replace(softmax="lean", rowsum="rounded"),
                base.replace(block_m=128, num_warps=8, num_stages=2 if big else 3)]
        if not big:
            out.append(base.replace(loads="pointer"))
    else:
        out += [base.replace(block_m=64, num_warps=4, num_stages=3),
                base.replace(num_stages=3 if not big else 2, block_n=64)]
    seen, unique = set(), []
    for c in out:
        if c not in seen:
            seen.add(c)
            unique.append(c)
    return unique


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--storage", required=True)
    ap.add_argument("--quick", action="store_true", help="hd128 fp8 only")
    ap.add_argument("--study", default="grid-" + time.strftime("%Y%m%d"))
    a = ap.parse_args(argv)
    fp = current_fingerprint()
    warm_gpu(2.0)
    work = [("fp8", 128, 128)] if a.quick else [(dt, *hd) for dt in ("fp8", "bf16") for hd in HEAD_DIMS]
    with open_store(a.storage) as store:
        for dtype, dqk, dv in work:
            heads = 16 if (dqk, dv) == (192, 128) else 32
            for batch, seqlen in SEQLENS:
                key = ProblemKey.from_shape(dtype=dtype, head_dim_qk=dqk, head_dim_v=dv, causal=True, batch=batch,
                                            heads=heads, kv_heads=heads, seqlen=seqlen)
                flops = attention_flops(batch, heads, seqlen, seqlen, dqk, dv, True)
                probe = make_probe(dtype, dqk, dv, batch=batch, heads=heads, kv_heads=heads, seqlen=seqlen, seed=seqlen)
                for cfg in candidates(dtype, dqk, dv):
                    shape = dict(batch=batch, heads=heads, seqlen=seqlen)
                    try:
                        v = check_config(cfg, probe)
                        if v.ok:
                            res = TrialResult(status="ok", median_ms=v.median_ms, error_rel_l2=v.error_rel_l2,
                                              tflops=flops / (v.median_ms * 1e-3) / 1e12, **shape)
                        else:
                            res = TrialResult(status="wrong", error_rel_l2=v.error_rel_l2, message=v.reason, **shape)
                    except ConfigError:
                        raise
                    except Exception as exc:  # a failing variant is recorded, the grid goes on
                        res = TrialResult(status="crash", message="".join(traceback.format_exception_only(exc))[-2000:],
                                          **shape)
                    store.record_trial(fp, key, cfg, res, source_hash=emit(cfg).source_hash, study=a.study,
                                       provenance=f"benchmarks/grid_tune.py {a.study}")
                    tf = f"{res.tflops:7.1f} TFLOP/s" if res.tflops else res.status
                    print(f"{dtype} {dqk}/{dv} B={batch} S={seqlen}: {tf}  err {res.error_rel_l2 or 0:.3e}  "
                          f"{cfg.softmax} {cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages} "
                          f"{cfg.loads}/{cfg.v_layout} {cfg.q_order}", flush=True)
        for e in store.best_entries():
            print(f"best {e.key.dtype} {e.key.head_dim_qk}/{e.key.head_dim_v} S<={e.key.seqlen_bucket}: "
                  f"{e.tflops:.1f} TFLOP/s {e.config_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
