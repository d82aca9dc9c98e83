"""Where a kernel's warps wait, from Nsight Compute's warp-state samples: one profiled launch of a config
(`launch`, GPU), and a summary of ncu's SASS source page (`summarize`, CPU) by opcode and along each step
loop, which is what sessions 7-34 read by hand (docs/PERF.md).

    ncu --profile-from-start off --set full --clock-control none -f -o rep \\
        python3 benchmarks/ncu_stalls.py launch --spec 'backend=gluon,block_n=256,...' --k-major-v
    ncu -i rep.ncu-rep --page source --csv --print-source sass > sass.csv
    python3 benchmarks/ncu_stalls.py summarize sass.csv [--window 25]

A step loop is a run of consecutive SASS instructions executed at least half as often as the most executed
wgmma (QGMMA / HGMMA) and holding one; each consumer partition has its own copy. Reasons are ncu's
`stall_*` columns (all samples, issued or not): "wait" is a fixed-latency dependence or the stall cycles
ptxas encodes, "selected" an issue, "math" a pipe throttle, "long_sb" / "short_sb" a scoreboard (memory,
MUFU), "barrier" a bar.sync.
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
#: wgmma opcodes: a step loop holds one
WGMMA = ("QGMMA", "HGMMA", "IGMMA")


@dataclass(frozen=True)
class Instruction:
    """One SASS instruction of ncu's source page: its text, warp-state samples (all, then per stall
    reason) and how many warp instructions executed it."""
    sass: str
    samples: int
    executed: int
    reasons: tuple[tuple[str, int], ...]

    @property
    def opcode(self) -> str:
        """The opcode without modifiers or predicate: '@!P0 BRA 0x..' -> 'BRA', 'MUFU.EX2 R3, R4' -> 'MUFU'."""
        words = self.sass.split()
        if not words:
            return "?"
        op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
        return op.split(".")[0]


def _int(cell: str) -> int:
    cell = cell.strip().replace(",", "")
    return int(float(cell)) if cell and cell not in ("-", "n/a") else 0


def read_source_page(path: str | Path) -> dict[str, list[Instruction]]:
    """Kernel name -> its instructions, from `ncu -i REP --page source --csv --print-source sass` (one
    '"Kernel Name",NAME' line, then a header, then one row per instruction, for each profiled kernel).
    Raises ValueError naming what is missing when the file is not such a page."""
    rows = list(csv.reader(Path(path).read_text().splitlines()))
    kernels: dict[str, list[Instruction]] = {}
    i = 0
    while i < len(rows):
        row = rows[i]
        if not row or row[0] != "Kernel Name":
            i += 1
            continue
        name = row[1] if len(row) > 1 else f"kernel {len(kernels)}"
        if i + 1 >= len(rows):
            raise ValueError(f"{path}: kernel {name!r} has no header row")
        header = rows[i + 1]
        for column in ("Source", SAMPLES, EXECUTED):
            if column not in header:
                raise ValueError(f"{path}: not an ncu source page with SASS ({column!r} column missing; "
                                 f"use --page source --csv --print-source sass)")
        col = {h: k for k, h in enumerate(header)}
        stall = [(h[len("stall_"):], k) for h, k in col.items() if h.startswith("stall_") and "(Not Issued)" not in h]
        body = []
        i += 2
        while i < len(rows) and (not rows[i] or rows[i][0] != "Kernel Name"):
            r = rows[i]
            if len(r) == len(header):
                body.append(Instruction(r[col["Source"]].strip(), _int(r[col[SAMPLES]]), _int(r[col[EXECUTED]]),
                                        tuple((reason, _int(r[k])) for reason, k in stall)))
            i += 1
        kernels[f"{name} #{len(kernels)}" if name in kernels else name] = body
    if not kernels:
        raise ValueError(f"{path}: no '\"Kernel Name\",...' line: not an ncu --page source --csv export")
    return kernels


def reasons_of(instructions) -> Counter:
    total: Counter = Counter()
    for ins in instructions:
        for reason, n in ins.reasons:
            total[reason] += n
    return total


def step_loops(instructions: list[Instruction], min_length: int = 20) -> list[tuple[int, int]]:
    """(first, last) indices of each step loop: a maximal run of instructions executed at least half as
    often as the most executed wgmma, holding a wgmma, at least `min_length` long."""
    wgmma = [ins.executed for ins in instructions if ins.opcode in WGMMA]
    if not wgmma or max(wgmma) == 0:
        return []
    floor = max(wgmma) / 2
    loops, start = [], None
    for k, ins in enumerate(instructions + [Instruction("", 0, 0, ())]):
        if ins.executed >= floor and k < len(instructions):
            start = k if start is None else start
        elif start is not None:
            run = instructions[start:k]
            if len(run) >= min_length and any(x.opcode in WGMMA for x in run):
                loops.append((start, k - 1))
            start = None
    return loops


def _top(counter: Counter, n: int) -> str:
    return ", ".join(f"{k} {v}" for k, v in counter.most_common(n) if v)


def summary(instructions: list[Instruction], window: int = 25, opcodes: int = 24) -> str:
    """The report: samples by reason, by opcode (share, top reasons), then each step loop in windows of
    `window` instructions (samples, most frequent opcodes, top reasons)."""
    total = sum(ins.samples for ins in instructions)
    lines = [f"total samples {total}; by reason: {_top(reasons_of(instructions), 20)}"]
    by_op: dict[str, list[Instruction]] = {}
    for ins in instructions:
        by_op.setdefault(ins.opcode, []).append(ins)
    ranked = sorted(by_op.items(), key=lambda kv: -sum(x.samples for x in kv[1]))
    for op, group in ranked[:opcodes]:
        n = sum(x.samples for x in group)
        lines.append(f"{op:10s} {n:8d} {100 * n / max(total, 1):5.1f}%  {_top(reasons_of(group), 4)}")
    for c, (lo, hi) in enumerate(step_loops(instructions)):
        loop = instructions[lo:hi + 1]
        n_loop = sum(x.samples for x in loop)
        lines.append(f"\nstep loop {c}: SASS {lo}..{hi} ({hi - lo + 1} instructions), samples {n_loop}")
        for a in range(lo, hi + 1, window):
            seg = instructions[a:min(a + window, hi + 1)]
            n = sum(x.samples for x in seg)
            ops = Counter(x.opcode for x in seg)
            lines.append(f"{a:6d} {n:7d} {100 * n / max(n_loop, 1):5.1f}%  "
                         + " ".join(f"{k}:{v}" for k, v in ops.most_common(4)) + f"  |  {_top(reasons_of(seg), 3)}")
    return "\n".join(lines)


def launch(spec: str, shape: tuple[int, int, int, int, int], k_major_v: bool, warmups: int = 3) -> None:
    """Run `spec` (zyfa-tune's `k=v,...` config changes) on native-quantised random inputs: `warmups`
    calls, then one between cudaProfilerStart / Stop (so `ncu --profile-from-start off` sees that one).
    With k_major_v, V is quantised keys-fastest (the `k_perm` twins read it without the V^T copy)."""
    import torch

    from zyfa_tune.api import flash_attn_func
    from zyfa_tune.generator.defaults import config_with, parse_changes
    from zyfa_tune.quantize import quantize_fp8

    dqk, dv, b, s, h = shape
    config = config_with("fp8", dqk, dv, parse_changes([spec], "--spec"))
    q, k = (torch.randn(b, s, h, dqk, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(b, s, h, dv, device="cuda", dtype=torch.bfloat16)
    q8, k8, v8, qd, kd, vd = quantize_fp8(q, k, v, v_layout="k_major" if k_major_v else "natural")

    def run():
        return flash_attn_func(q8, k8, v8, causal=True, config=config, q_descale=qd, k_descale=kd, v_descale=vd)

    for _ in range(warmups):
        run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"profiled one launch of {config.summary()}")


def _shape(text: str) -> tuple[int, int, int, int, int]:
    try:
        dqk, dv, b, s, h = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shape {text!r}: expected hd_qk,hd_v,batch,seqlen,heads, e.g. "
                                         "128,128,1,16384,32") from None
    if min(dqk, dv, b, s, h) <= 0:
        raise argparse.ArgumentTypeError(f"--shape {text!r}: every entry must be positive")
    return dqk, dv, b, s, h


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    la = sub.add_parser("launch", help="one profiled launch of a config (GPU; run it under ncu)")
    la.add_argument("--spec", required=True, help="config changes as zyfa-tune takes them: 'k=v,...'")
    la.add_argument("--shape", type=_shape, default=(128, 128, 1, 16384, 32), help="hd_qk,hd_v,batch,seqlen,heads")
    la.add_argument("--k-major-v", action="store_true", help="V quantised keys-fastest (no V^T copy for k_perm)")
    su = sub.add_parser("summarize", help="summarise ncu's SASS source page (CSV)")
    su.add_argument("csv", help="ncu -i REP --page source --csv --print-source sass > this file")
    su.add_argument("--window", type=int, default=25, help="instructions per line along a step loop")
    su.add_argument("--kernel", help="the kernel to summarise (default: every kernel in the file)")
    args = ap.parse_args(argv)
    if args.cmd == "launch":
        launch(args.spec, args.shape, args.k_major_v)
        return 0
    if args.window <= 0:
        ap.error(f"--window {args.window}: must be positive")
    try:
        kernels = read_source_page(args.csv)
    except (OSError, ValueError) as e:
        print(f"ncu_stalls: {e}", file=sys.stderr)
        return 2
    if args.kernel is not None and args.kernel not in kernels:
        print(f"ncu_stalls: no kernel {args.kernel!r} in {args.csv} (it has {', '.join(kernels)})", file=sys.stderr)
        return 2
    for name, instructions in kernels.items():
        if args.kernel in (None, name):
            print(f"# {name}: {len(instructions)} SASS instructions")
            print(summary(instructions, args.window))
    return 0


if __name__ == "__main__":
    sys.exit(main())
