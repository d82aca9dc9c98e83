"""After `zyfa-tune tune`: does `flash_attn_func` pick what the study stored, and is it right?

For each best entry of this GPU in a tuning database: install the database as the only layer,
make fresh inputs of the entry's shape, ask `explain` (must say "exact" and name the stored config),
run `flash_attn_func` (error against float64), and time it against the default config on the same
inputs in the same process.

    python benchmarks/picked_by_dispatcher.py --storage study.db [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from zyfa_tune import explain, flash_attn_func
from zyfa_tune.db import current_fingerprint, open_store
from zyfa_tune.generator import KernelConfig
from zyfa_tune.generator.defaults import default_config
from zyfa_tune.kernels import dispatch
from zyfa_tune.tuning.reference import attention_reference, rel_l2
from zyfa_tune.tuning.timing import attention_flops, time_cuda
from zyfa_tune.tuning.verify import make_inputs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--storage", required=True)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    gpu = current_fingerprint().gpu_name
    with open_store(a.storage, readonly=True, create=False) as store:
        entries = store.best_entries(gpu_name=gpu)
    if not entries:
        print(f"{a.storage}: no best entries for {gpu}")
        return 1
    dispatch.set_databases([a.storage])
    rows, failures = [], 0
    for e in entries:
        k = e.key
        heads = e.heads or 32
        kv_heads = heads // k.gqa_group
        args, kw = make_inputs(
            k.dtype,
            k.head_dim_qk,
            k.head_dim_v,
            batch=e.batch or 1,
            heads=heads,
            kv_heads=kv_heads,
            seqlen=e.seqlen or 4096,
            seed=7,
        )
        choice = explain(*args, **kw)
        stored = KernelConfig.from_json(e.config_json)
        picked = choice.source == "exact" and choice.config == stored
        out = flash_attn_func(*args, **kw)
        err = rel_l2(out, attention_reference(*args, **kw))
        default = default_config(k.dtype, k.head_dim_qk, k.head_dim_v)
        flops = attention_flops(
            e.batch or 1, heads, e.seqlen or 4096, e.seqlen or 4096, k.head_dim_qk, k.head_dim_v, k.causal
        )
        t_ours = time_cuda([lambda: flash_attn_func(*args, **kw)], reps=50).median_ms
        t_def = time_cuda([lambda: flash_attn_func(*args, config=default, **kw)], reps=50).median_ms
        row = dict(
            key=str(k),
            batch=e.batch,
            heads=heads,
            seqlen=e.seqlen,
            source=choice.source,
            picked_stored=picked,
            error_rel_l2=err,
            tflops=flops / t_ours / 1e9,
            default_tflops=flops / t_def / 1e9,
            stored_tflops=e.tflops,
            config=stored.to_dict(),
        )
        rows.append(row)
        failures += not picked
        print(
            f"{k.dtype} {k.head_dim_qk}/{k.head_dim_v} B={e.batch} H={heads} S={e.seqlen}: explain -> "
            f"{choice.source}, stored config {'picked' if picked else 'NOT picked'}; error {err:.3e}; "
            f"{row['tflops']:.1f} TFLOP/s vs default config {row['default_tflops']:.1f} "
            f"(study measured {e.tflops or float('nan'):.1f})",
            flush=True,
        )
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    torch.manual_seed(0)
    sys.exit(main())
