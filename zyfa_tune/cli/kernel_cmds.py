"""Kernel commands: `compile` (sm_90a, no GPU), `check` (one config vs float64) and `timeline`."""

from __future__ import annotations

import argparse
import json

from rich.markup import escape
from rich.table import Table

from zyfa_tune.generator import emit

from .common import add_config_options, config_from_args, console


def cmd_compile(args: argparse.Namespace) -> int:
    """Compile a config for sm_90a without a GPU and report its resources."""
    from zyfa_tune.generator.build import compile_for_target

    cfg = config_from_args(args)
    kernel = emit(cfg)
    art = compile_for_target(kernel, causal=not args.non_causal)
    table = Table(title=f"{kernel.kernel_name} {kernel.source_hash}")
    table.add_column("what")
    table.add_column("value", justify="right")
    for name, value in (
        ("registers / thread", art.registers),
        ("spill bytes / thread", art.spill_bytes),
        ("shared memory (bytes)", art.shared_bytes),
        ("QGMMA / HGMMA", f"{art.count('QGMMA')} / {art.count('HGMMA')}"),
        ("MUFU.EX2", art.count("MUFU.EX2")),
        ("USETMAXREG", art.count("USETMAXREG")),
        ("wgmma serialised by ptxas", art.serialised_wgmma or "no"),
    ):
        table.add_row(name, escape(str(value)))
    console.print(table)
    console.print(json.dumps(cfg.to_dict(), sort_keys=True))
    if args.source:
        console.print(kernel.source, markup=False, highlight=False)
    return 1 if art.spill_bytes or art.serialised_wgmma else 0


def cmd_check(args: argparse.Namespace) -> int:
    """Run the kernel on fresh random inputs and compare with float64 attention."""
    import torch

    from zyfa_tune.api import flash_attn_func
    from zyfa_tune.tuning.reference import attention_reference, rel_l2
    from zyfa_tune.tuning.verify import make_inputs

    if not torch.cuda.is_available():
        console.print("[red]check needs a CUDA GPU[/red]")
        return 2
    cfg = config_from_args(args)
    b, s, h = args.batch, args.seqlen, args.heads
    (q, k, v), kw = make_inputs(
        cfg.dtype, cfg.head_dim_qk, cfg.head_dim_v, batch=b, heads=h, kv_heads=h, seqlen=s, seed=args.seed
    )
    out = flash_attn_func(q, k, v, causal=True, config=cfg, **kw)
    err = rel_l2(out, attention_reference(q, k, v, causal=True, **kw))
    console.print(
        f"rel. L2 error vs float64: {err:.4e}  ({cfg.dtype} {cfg.head_dim_qk}/{cfg.head_dim_v} "
        f"B={b} S={s} H={h}, softmax={cfg.softmax})"
    )
    return 0 if err < args.max_error else 1


def cmd_timeline(args: argparse.Namespace) -> int:
    """Clock stamps of one launch (CTA 0): median cycles of each phase of a consumer step."""
    import torch

    from zyfa_tune.bench import timeline
    from zyfa_tune.tuning.verify import make_inputs

    if not torch.cuda.is_available():
        console.print("[red]timeline needs a CUDA GPU[/red]")
        return 2
    if not any(item.startswith("backend=") for item in args.set or []):
        args.set = ["backend=gluon", *(args.set or [])]  # the instrumented backend: Gluon's default config
    cfg = config_from_args(args)
    (q, k, v), kw = make_inputs(
        cfg.dtype,
        cfg.head_dim_qk,
        cfg.head_dim_v,
        batch=args.batch,
        heads=args.heads,
        kv_heads=args.heads,
        seqlen=args.seqlen,
        seed=args.seed,
    )
    tl = timeline.record(cfg, q, k, v, causal=not args.non_causal, steps=args.steps, timed_reps=args.timed_reps, **kw)
    console.print(f"{cfg.summary()}  B={args.batch} S={args.seqlen} H={args.heads}: CTA 0, cycles per step phase")
    if tl.stamp_cost() is not None:
        console.print(
            f"traced launch {tl.traced_ms:.4f} ms, the same kernel without stamps {tl.plain_ms:.4f} ms: "
            f"the stamps cost {tl.stamp_cost():+.1%} (medians of {args.timed_reps}; compare variants' "
            f"speed with `zyfa-tune bench`, not their periods here)"
        )
    for w in range(tl.clocks.shape[0]):
        table = Table(title=f"consumer warpgroup {w}: step period median {tl.period(w):.0f} cycles")
        for col in ("from", "to", "median", "p10", "p90", "steps"):
            table.add_column(col, justify="right" if col not in ("from", "to") else "left")
        for ph in tl.phases(w):
            table.add_row(ph.start, ph.end, f"{ph.median:.0f}", f"{ph.p10:.0f}", f"{ph.p90:.0f}", str(ph.steps))
        console.print(table)
    for w in range(1, tl.clocks.shape[0]):
        il = tl.interleave(w)
        console.print(
            f"warpgroup {w}: a step starts {il.offset:.0f} cycles after warpgroup 0's ({il.offset_share:.0%} "
            f"of its period; ping-pong's aim with two consumers: 50%), its softmax beside warpgroup 0's "
            f"for {il.softmax_overlap:.0%} of that softmax ({il.steps} steps)"
        )
    if args.sample is not None:
        for w, step, events in tl.sample(args.sample):
            console.print(f"warpgroup {w} step {step}: " + "  ".join(f"{e}={c}" for e, c in events.items()))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {
                    "config": cfg.to_dict(),
                    "shape": [args.batch, args.seqlen, args.heads],
                    "events": list(timeline.EVENTS),
                    "clocks": tl.clocks.tolist(),
                    "traced_ms": tl.traced_ms,
                    "plain_ms": tl.plain_ms,
                },
                fh,
            )
        console.print(f"stamps: {args.json}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("compile", help="compile a kernel config for sm_90a (no GPU needed)")
    add_config_options(p)
    p.add_argument("--non-causal", action="store_true", help="attention without the causal mask")
    p.add_argument("--source", action="store_true", help="print the emitted source")
    p.set_defaults(fn=cmd_compile)

    def inputs(p: argparse.ArgumentParser, batch: int, seqlen: int, heads: int) -> None:
        """The random inputs a GPU command runs its kernel on."""
        p.add_argument("--batch", type=int, default=batch, help="batch size of the random inputs")
        p.add_argument("--seqlen", type=int, default=seqlen, help="sequence length of the random inputs")
        p.add_argument("--heads", type=int, default=heads, help="heads of the random inputs")
        p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (and sampler)")

    p = sub.add_parser("check", help="check a kernel config against float64 attention on the GPU")
    add_config_options(p)
    inputs(p, 1, 4096, 8)
    p.add_argument("--max-error", type=float, default=0.05, help="largest rel. L2 error vs float64 that passes")
    p.set_defaults(fn=cmd_check)
    p = sub.add_parser("timeline", help="GPU: clock stamps of each consumer step of one launch (Gluon kernels)")
    add_config_options(p)
    inputs(p, 2, 8192, 32)
    p.add_argument("--non-causal", action="store_true", help="attention without the causal mask")
    p.add_argument("--steps", type=int, default=4096, help="steps per warpgroup with room in the buffer")
    p.add_argument(
        "--sample",
        type=int,
        default=None,
        metavar="STEP",
        help="also print both warpgroups' events for 4 steps from STEP on one clock",
    )
    p.add_argument(
        "--timed-reps",
        type=int,
        default=20,
        metavar="N",
        help="time the traced launch and the kernel without stamps, N launches each (0: skip)",
    )
    p.add_argument("--json", default=None, metavar="OUT.json", help="save the raw stamps")
    p.set_defaults(fn=cmd_timeline)
