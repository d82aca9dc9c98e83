"""What P's power-of-2 scale buys in accuracy: `p_scale_log2` and a per-block exponent (CPU, float64).

Would a per-block power-of-2 scale of P (blocks of 16-128 keys) beat one scale per tile? This
emulates the kernels' online softmax in float64 on the same e4m3 inputs every FP8 system gets, with P
rounded to e4m3 (round to nearest, as `cvt.rn.satfinite.e4m3x2.f32` does) at 2^(x - ref + p), where
ref is the running row maximum, p is `p_scale_log2`, and, per block of `block` keys, x is raised by the
block's own exponent k = floor(ref - block max) (capped at 16) and the block's PV product divided by
2^k again. Row sums are of the unrounded probabilities (`rowsum="fp32"`). Nothing else is rounded, so
the difference between columns is what the scale alone does.

e4m3 is a floating grid: scaling a block by 2^k moves its codes along the same 3-bit mantissa and
changes nothing until a code would fall below 2^-6 (subnormal, coarser) or 2^-9 (zero). A block's
scale therefore only rescues probabilities under 2^-(6 + p) of the row maximum; this script measures
how much of the output error those are.

    python benchmarks/p_scale_error.py [--seqlen 2048] [--p 0,3,6,8] [--blocks 0,128,64,32,16] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from zyfa_tune.quantize import E4M3_MAX, dequantize_fp8, quantize_fp8
from zyfa_tune.tuning.inputs import FAMILY_NAMES, make_qkv
from zyfa_tune.tuning.reference import attention_reference, rel_l2

#: the key tile of the emulated online softmax (the Triton backend's default block_n)
TILE = 128
#: largest per-block exponent: keeps the PV rescale within 2^16, as the Triton backend's per-tile form
CAP = 16


def round_p(x: torch.Tensor) -> torch.Tensor:
    """Round to nearest e4m3, saturating at 448, back in float64 (-inf rows give 0)."""
    return x.nan_to_num(0.0).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn).double()


def online_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, p_scale_log2: int | None, block: int = 0
) -> torch.Tensor:
    """Causal attention of one head ((seqlen, dim) float64) by 128-key tiles as the kernels run it.

    p_scale_log2=None keeps P unrounded (the float64 online softmax itself, equal to the reference);
    block=0 gives no per-block exponent, block=TILE one per tile, smaller blocks several per tile.
    """
    s_len, d = q.shape
    s = (q @ k.T) * (math.log2(math.e) / math.sqrt(d))
    s = s.masked_fill(torch.ones(s_len, s_len, dtype=torch.bool).triu(1), float("-inf"))
    m = torch.full((s_len,), float("-inf"), dtype=torch.float64)
    l = torch.zeros(s_len, dtype=torch.float64)
    acc = torch.zeros(s_len, v.shape[1], dtype=torch.float64)
    p = p_scale_log2 or 0
    for n0 in range(0, s_len, TILE):
        t = s[:, n0 : n0 + TILE]
        ref = torch.maximum(m, t.max(1).values)
        ref = torch.where(ref > float("-inf"), ref, torch.zeros_like(ref))  # rows with no key yet
        alpha = torch.exp2(m - ref)
        acc, l, m = acc * alpha[:, None], l * alpha, ref
        width = block or t.shape[1]
        for b0 in range(0, t.shape[1], width):
            tb = t[:, b0 : b0 + width]
            kx = torch.zeros_like(ref)
            if block:
                bmax = tb.max(1).values
                kx = torch.where(bmax > float("-inf"), (ref - bmax).floor().clamp(max=CAP), kx)
            x = torch.exp2(tb - ref[:, None] + p + kx[:, None])
            pb = x.nan_to_num(0.0) if p_scale_log2 is None else round_p(x)
            l += torch.exp2(tb - ref[:, None] + p).nan_to_num(0.0).sum(1)
            acc += (pb @ v[n0 + b0 : n0 + b0 + width]) * torch.exp2(-kx)[:, None]
    return acc / l[:, None]


def family_errors(
    family: str, seqlen: int, p_values: list[int], blocks: list[int], heads: int = 2, seed: int = 0
) -> dict[str, float]:
    """Rel. L2 against float64 attention on the unquantised inputs, per (p, block), one family."""
    q, k, v = make_qkv(
        family,
        head_dim_qk=128,
        head_dim_v=128,
        seed=seed,
        device="cpu",
        batch=1,
        seqlen=seqlen,
        heads=heads,
        kv_heads=heads,
    )
    ref = attention_reference(q.double(), k.double(), v.double(), causal=True)
    q8, k8, v8, qd, kd, vd = quantize_fp8(q, k, v)
    qq, kk, vv = dequantize_fp8(q8, qd)[0], dequantize_fp8(k8, kd)[0], dequantize_fp8(v8, vd)[0]
    errs = {}
    for p in p_values:
        for blk in blocks:
            out = torch.stack(
                [online_attention(qq[:, h], kk[:, h], vv[:, h], p_scale_log2=p, block=blk) for h in range(heads)], 1
            )[None]
            errs[f"p{p}/b{blk}"] = rel_l2(out, ref)
    return errs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--p", default="0,3,6,8", help="p_scale_log2 values")
    ap.add_argument("--blocks", default="0,128,64,32,16", help="keys per exponent (0: none, 128: per tile)")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    p_values = [int(x) for x in a.p.split(",")]
    blocks = [int(x) for x in a.blocks.split(",")]
    if any(b < 0 or (b and TILE % b) for b in blocks):
        ap.error(f"--blocks: each must be 0 or divide the {TILE}-key tile, got {blocks}")
    print(
        f"B=1 S={a.seqlen} H=2 d=128 causal, per-head e4m3 inputs; rel. L2 vs float64 on unquantised "
        f"inputs; columns p{{p_scale_log2}}/b{{keys per exponent}}"
    )
    print(f"{'family':15s} " + " ".join(f"{f'p{p}/b{b}':>8s}" for p in p_values for b in blocks))
    table = {}
    for fam in FAMILY_NAMES:
        table[fam] = family_errors(fam, a.seqlen, p_values, blocks)
        print(f"{fam:15s} " + " ".join(f"{e:8.5f}" for e in table[fam].values()), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
