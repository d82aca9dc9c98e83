"""Side by side with the peers: a thin wrapper over `zyfa-tune bench` (zyfa_tune/bench holds the
measuring code) with a fixed table of shapes as its default (hd128 at 4K-32K; hd64, hd256 and
192/128 at 8K) and both dtypes (ours through the dispatcher, FA3 fp8/bf16, cuDNN sdpa_fp8, torch
SDPA bf16).

    python benchmarks/peers.py [--json out.json]            # the default shapes below
    python benchmarks/peers.py --shape 128,128,1,16384,32 --ours lean:softmax=lean,rowsum=rounded

Every other `zyfa-tune bench` flag passes through (see `zyfa-tune bench --help`).
"""

from __future__ import annotations

import sys

from zyfa_tune import cli

#: dqk,dv,batch,seqlen,heads: 16K tokens (32K at S=32K) a shape, 16 heads where the head dims are 192/128
DEFAULT_SHAPES = (
    "128,128,4,4096,32",
    "128,128,2,8192,32",
    "128,128,1,16384,32",
    "128,128,1,32768,32",
    "64,64,2,8192,32",
    "256,256,2,8192,32",
    "192,128,2,8192,16",
)
_SHAPE_FLAGS = ("--shape", "--seqlens", "--head-dim", "--batch-heads", "--from")


def bench_argv(argv: list[str]) -> list[str]:
    """`zyfa-tune bench` arguments: argv plus the defaults it does not override."""
    out = ["bench", *argv]
    if not any(a.split("=")[0] in _SHAPE_FLAGS for a in argv):
        out += [x for s in DEFAULT_SHAPES for x in ("--shape", s)]
    if not any(a.split("=")[0] == "--dtype" for a in argv):
        out += ["--dtype", "both"]
    return out


def main(argv: list[str] | None = None) -> int:
    return cli.main(bench_argv(list(sys.argv[1:] if argv is None else argv)))


if __name__ == "__main__":
    sys.exit(main())
