"""Where lean P's line should sit: the error of the linear fold's codes by reference and offset (CPU, float64).

The linear fold codes round(8 (x + P) + 56 - offset) for x = s - ref (log2 units), a line 0 to 0.69 codes
above 2^x's code coordinate. On the grid reference (ref = the row maximum rounded up to 1/8) the offset is
uniform over a code from row to row; on the maximum itself (`lean_ref="max"`) it is one constant. This
emulates the Gluon kernel's online softmax in float64 on the e4m3 inputs `quantize_fp8` makes (128-row
tiles, 256-key blocks from the diagonal down, codes against the running maximum, O and the row sum of the
decoded codes rescaled exactly when it moves) and compares the codes' attention error with P correctly
rounded (FA3's model: the exact maximum, row sums of the unrounded probabilities). `--floor` adds
`lean_floor`'s second line (3 codes an octave below code 8), `--mufu k` lean_mufu's share of correctly rounded
pairs (k of every four key pairs). The kernel's own f16 roundings (scores, a, b)
are not modelled: its offset is LEAN_MAX_CENTER plus b's f16 margin (docs/design.md).

    python benchmarks/lean_offset_error.py [--seqlen 2048] [--offsets 0,0.25,0.45] [--floor] [--mufu 1] [--v-weight 0]
                                           [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from zyfa_tune.generator.asm.lean import E4M3_ONE_CODE, LEAN_FLOOR_AT, LEAN_FLOOR_SLOPE
from zyfa_tune.quantize import E4M3_MAX, dequantize_fp8, quantize_fp8
from zyfa_tune.tuning.inputs import FAMILY_NAMES, make_qkv
from zyfa_tune.tuning.reference import attention_reference, rel_l2

#: the Gluon lean kernel's tiles: query rows per tile, keys per block
ROWS, KEYS = 128, 256
#: p_scale_log2 of the lean f16 seed
P = 8


def decoded(codes: torch.Tensor) -> torch.Tensor:
    """e4m3 codes (float64 integers, clamped to [0, 126]) as float64 values."""
    return codes.clamp(0, 126).to(torch.uint8).view(torch.float8_e4m3fn).double()


def lean_p(x: torch.Tensor, offset: float, floor: bool, mufu: int = 0) -> torch.Tensor:
    """The linear fold's probabilities 2^(x + P) as e4m3 values (x <= 0, keys on the last dim; -inf gives 0);
    `mufu`: of every four key pairs (keys 2j, 2j + 1), the last `mufu` correctly rounded instead (lean_mufu's
    MUFU pairs, on x itself: the kernel puts them where the fold's codes are unbiased, about the same)."""
    line = 8 * (x + P) + E4M3_ONE_CODE - offset
    if floor:
        line = torch.maximum(line, LEAN_FLOOR_SLOPE * (x + P - LEAN_FLOOR_AT) + 8 - offset)
    p = decoded(torch.round(line).nan_to_num(0.0, neginf=0.0))
    if mufu:
        exact = torch.exp2(x + P).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn).double()
        p = torch.where((torch.arange(x.shape[-1]) // 2) % 4 >= 4 - mufu, exact, p)
    return p


def online_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rule: str,
    offset: float = 0.0,
    floor: bool = False,
    mufu: int = 0,
) -> torch.Tensor:
    """Causal attention of one head ((seqlen, dim) float64) as the Gluon kernel runs it. rule "fa3": P
    correctly rounded at 2^(x + P) (row sums unrounded); "grid" / "max": lean codes against the running
    maximum rounded up to 1/8 / as it is, lowered by `offset` codes (row sums of the decoded codes)."""
    s_len, d = q.shape
    scale = math.log2(math.e) / math.sqrt(d)
    out = []
    for r0 in range(0, s_len, ROWS):
        qt, rows = q[r0 : r0 + ROWS], torch.arange(r0, min(r0 + ROWS, s_len))[:, None]
        m = torch.full((qt.shape[0], 1), float("-inf"), dtype=torch.float64)
        acc, l = torch.zeros(qt.shape[0], v.shape[1], dtype=torch.float64), torch.zeros_like(m)
        for n0 in reversed(range(0, r0 + qt.shape[0], KEYS)):
            s = (qt @ k[n0 : n0 + KEYS].T) * scale
            s = s.masked_fill(torch.arange(n0, n0 + s.shape[1])[None, :] > rows, float("-inf"))
            ref = torch.maximum(m, s.max(1, keepdim=True).values)
            if rule == "grid":
                ref = torch.ceil(8 * ref) / 8
            alpha = torch.exp2(torch.where(m > float("-inf"), m - ref, torch.zeros_like(m)))
            x = s - ref
            if rule == "fa3":
                p = torch.exp2(x + P).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn).double()
                sums = torch.exp2(x + P).sum(1, keepdim=True)
            else:
                p = lean_p(x, offset, floor, mufu)
                sums = p.sum(1, keepdim=True)
            acc, l, m = acc * alpha + p @ v[n0 : n0 + KEYS], l * alpha + sums, ref
        out.append(acc / l)
    return torch.cat(out)


def family_errors(
    family: str,
    seqlen: int,
    offsets: list[float],
    floor: bool,
    heads: int = 1,
    seed: int = 0,
    mufu: int = 0,
    v_weight: float | None = None,
) -> dict[str, float]:
    """Rel. L2 against float64 attention on the unquantised inputs: FA3's model with V rounded to nearest and
    balanced, then the lean codes (balanced V) on the grid and on the maximum at each offset (with `mufu` of
    every four key pairs correctly rounded on the maximum's line); `v_weight`: balanced V's kappa (default: estimated
    from the scores, `quantize_fp8`'s)."""
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
    errs, inputs = {}, {}
    for vq in ("nearest", "balanced"):  # quantised once per V rounding
        q8, k8, v8, qd, kd, vd = quantize_fp8(q, k, v, v_rounding=vq, v_weight=v_weight if vq == "balanced" else None)
        inputs[vq] = dequantize_fp8(q8, qd)[0], dequantize_fp8(k8, kd)[0], dequantize_fp8(v8, vd)[0]

    def error(vq: str, rule: str, offset: float = 0.0, fl: bool = False) -> float:
        qq, kk, vv = inputs[vq]
        out = torch.stack(
            [
                online_attention(qq[:, h], kk[:, h], vv[:, h], rule, offset, fl, mufu if rule == "max" else 0)
                for h in range(heads)
            ],
            1,
        )[None]
        return rel_l2(out, ref)

    errs["fa3"] = error("nearest", "fa3")
    errs["fa3 balV"] = error("balanced", "fa3")
    errs["grid"] = error("balanced", "grid")
    for offset in offsets:
        errs[f"max {offset:g}"] = error("balanced", "max", offset)
        if floor:
            errs[f"max {offset:g} floor"] = error("balanced", "max", offset, True)
    return errs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--offsets", default="0,0.25,0.375,0.45,0.49,0.625", help="codes the line is lowered by")
    ap.add_argument("--floor", action="store_true", help="also with lean_floor's second line")
    ap.add_argument(
        "--mufu",
        type=int,
        default=0,
        choices=range(5),
        help="of every four key pairs, so many correctly rounded on the maximum's line (lean_mufu)",
    )
    ap.add_argument("--families", default=",".join(FAMILY_NAMES))
    ap.add_argument(
        "--v-weight",
        type=float,
        default=None,
        help="balanced V's kappa (0: every move that shrinks a block's sum; default: estimated per head)",
    )
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    offsets = [float(x) for x in a.offsets.split(",")]
    if any(not 0.0 <= o < 1.0 for o in offsets):
        ap.error(f"--offsets: each must be in [0, 1) code, got {offsets}")
    print(
        f"B=1 S={a.seqlen} H=1 d=128 causal, quantize_fp8 inputs (V balanced but in 'fa3'), mufu {a.mufu}/4; rel. L2 "
        f"vs float64 on unquantised inputs, over FA3's model with V rounded to nearest"
    )
    table = {}
    for fam in a.families.split(","):
        table[fam] = family_errors(fam, a.seqlen, offsets, a.floor, mufu=a.mufu, v_weight=a.v_weight)
        fa3 = table[fam]["fa3"]
        print(
            f"{fam:15s} fa3 {fa3:.5f} "
            + " ".join(f"{name} {e / fa3:.3f}" for name, e in table[fam].items() if name != "fa3"),
            flush=True,
        )
    if a.json:
        Path(a.json).write_text(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
