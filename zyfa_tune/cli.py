"""`zyfa-tune` command line.

    zyfa-tune compile [--dtype fp8] [--head-dim 128] [--set key=val ...]   # no GPU needed
    zyfa-tune check   [--dtype fp8] [--head-dim 128] [--seqlen 4096]        # GPU: vs float64
"""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.table import Table

from zyfa_tune.generator import ConfigError, KernelConfig, emit

console = Console()


def _config(args: argparse.Namespace) -> KernelConfig:
    from zyfa_tune.kernels.defaults import default_config

    dv = args.head_dim_v or args.head_dim
    cfg = default_config(args.dtype, args.head_dim, dv)
    changes = {}
    for item in args.set or []:
        key, sep, val = item.partition("=")
        if not sep:
            raise ConfigError(f"--set: expected key=value, got {item!r}")
        changes[key] = int(val) if val.lstrip("-").isdigit() else val
    return KernelConfig.from_dict({**cfg.to_dict(), **changes})


def cmd_compile(args: argparse.Namespace) -> int:
    """Compile a config for sm_90a without a GPU and report its resources."""
    from zyfa_tune.generator.build import compile_for_target

    cfg = _config(args)
    kernel = emit(cfg)
    art = compile_for_target(kernel, causal=not args.non_causal)
    table = Table(title=f"{kernel.kernel_name} {kernel.source_hash}")
    table.add_column("what")
    table.add_column("value", justify="right")
    for name, value in (("registers / thread", art.registers), ("spill bytes / thread", art.spill_bytes),
                        ("shared memory (bytes)", art.shared_bytes),
                        ("QGMMA / HGMMA", f"{art.count('QGMMA')} / {art.count('HGMMA')}"),
                        ("MUFU.EX2", art.count("MUFU.EX2"))):
        table.add_row(name, str(value))
    console.print(table)
    console.print(json.dumps(cfg.to_dict(), sort_keys=True))
    if args.source:
        console.print(kernel.source, markup=False, highlight=False)
    return 1 if art.spill_bytes else 0


def cmd_check(args: argparse.Namespace) -> int:
    """Run the kernel on fresh random inputs and compare with float64 attention."""
    import torch

    from zyfa_tune import flash_attn_func, quantize_fp8
    from zyfa_tune.kernels.reference import attention_reference, rel_l2

    if not torch.cuda.is_available():
        console.print("[red]check needs a CUDA GPU[/red]")
        return 2
    cfg = _config(args)
    b, s, h = args.batch, args.seqlen, args.heads
    g = torch.Generator(device="cuda").manual_seed(args.seed)
    q = torch.randn(b, s, h, cfg.head_dim_qk, device="cuda", generator=g)
    k = torch.randn(b, s, h, cfg.head_dim_qk, device="cuda", generator=g)
    v = torch.randn(b, s, h, cfg.head_dim_v, device="cuda", generator=g)
    if cfg.dtype == "fp8":
        q, k, v, qd, kd, vd = quantize_fp8(q, k, v)
        kw = dict(q_descale=qd, k_descale=kd, v_descale=vd)
    else:
        q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
        kw = {}
    out = flash_attn_func(q, k, v, causal=True, config=cfg, **kw)
    err = rel_l2(out, attention_reference(q, k, v, causal=True, **kw))
    console.print(f"rel. L2 error vs float64: {err:.4e}  ({cfg.dtype} {cfg.head_dim_qk}/{cfg.head_dim_v} "
                  f"B={b} S={s} H={h}, softmax={cfg.softmax})")
    return 0 if err < args.max_error else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="zyfa-tune", description="Autotuned FP8/BF16 attention for Hopper")
    sub = ap.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--dtype", choices=["fp8", "bf16"], default="fp8")
        p.add_argument("--head-dim", type=int, default=128)
        p.add_argument("--head-dim-v", type=int, default=None)
        p.add_argument("--set", action="append", metavar="KEY=VAL", help="override a config field")

    p = sub.add_parser("compile", help="compile a kernel config for sm_90a (no GPU needed)")
    common(p)
    p.add_argument("--non-causal", action="store_true")
    p.add_argument("--source", action="store_true", help="print the emitted source")
    p.set_defaults(fn=cmd_compile)
    p = sub.add_parser("check", help="check a kernel config against float64 attention on the GPU")
    common(p)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-error", type=float, default=0.05)
    p.set_defaults(fn=cmd_check)
    args = ap.parse_args(argv)
    try:
        return args.fn(args)
    except (ConfigError, ValueError, TypeError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
