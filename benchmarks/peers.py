"""Side by side, in one process, on the same inputs: zyfa-tune vs FlashAttention-3 (fp8, bf16),
cuDNN sdpa_fp8 and torch SDPA bf16 (cuDNN and flash backends). Causal prefill.

    python benchmarks/peers.py                       # the shapes of shared/device/README.md
    python benchmarks/peers.py --shape 128,128,1,16384,32 --ours softmax=lean,rowsum=rounded
    python benchmarks/peers.py --json out.json

FP8 systems all get the same e4m3 tensors (one per-tensor scale, given to FA3 and us as
(batch, kv_heads) descales); their error is rel. L2 against float64 attention on those same
dequantised inputs. BF16 systems get the bf16 tensors the fp8 ones were quantised from.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
from dataclasses import asdict
from typing import Callable

import torch

from zyfa_tune import flash_attn_func
from zyfa_tune.generator import KernelConfig
from zyfa_tune.kernels.defaults import default_config
from zyfa_tune.kernels.reference import attention_reference, max_abs_err, rel_l2
from zyfa_tune.kernels.timing import attention_flops, gpu_state, time_cuda, warm_gpu

E4M3_MAX = 448.0
#: (head_dim_qk, head_dim_v, batch, seqlen, heads) of shared/device/README.md's table
DEFAULT_SHAPES = [(128, 128, 4, 4096, 32), (128, 128, 2, 8192, 32), (128, 128, 1, 16384, 32),
                  (128, 128, 1, 32768, 32), (64, 64, 2, 8192, 32), (256, 256, 2, 8192, 32),
                  (192, 128, 2, 8192, 16)]


class Inputs:
    def __init__(self, dqk: int, dv: int, b: int, s: int, h: int, hk: int, seed: int):
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.shape = (dqk, dv, b, s, h, hk)
        self.q16 = torch.randn(b, s, h, dqk, device="cuda", generator=g).to(torch.bfloat16)
        self.k16 = torch.randn(b, s, hk, dqk, device="cuda", generator=g).to(torch.bfloat16)
        self.v16 = torch.randn(b, s, hk, dv, device="cuda", generator=g).to(torch.bfloat16)
        self.q8, self.qs = self._quant(self.q16)
        self.k8, self.ks = self._quant(self.k16)
        self.v8, self.vs = self._quant(self.v16)
        self.descale = {n: torch.full((b, hk), float(x), device="cuda") for n, x in
                        (("q", self.qs), ("k", self.ks), ("v", self.vs))}

    @staticmethod
    def _quant(x: torch.Tensor) -> tuple[torch.Tensor, float]:
        scale = float(x.float().abs().amax()) / E4M3_MAX
        return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale

    def reference(self, fp8: bool) -> torch.Tensor:
        if fp8:
            return attention_reference(self.q8, self.k8, self.v8, causal=True, q_descale=self.descale["q"],
                                       k_descale=self.descale["k"], v_descale=self.descale["v"])
        return attention_reference(self.q16, self.k16, self.v16, causal=True)


# ---- systems: each returns (call, output getter) or raises if unavailable -----------------------

def ours(cfg: KernelConfig):
    def build(x: Inputs, fp8: bool):
        if fp8:
            d = x.descale
            args = (x.q8, x.k8, x.v8)
            kw = dict(q_descale=d["q"], k_descale=d["k"], v_descale=d["v"])
        else:
            args, kw = (x.q16, x.k16, x.v16), {}
        box = {}

        def call():
            box["o"] = flash_attn_func(*args, causal=True, config=cfg, **kw)
        return call, lambda: box["o"]
    return build


def fa3(x: Inputs, fp8: bool):
    from fa3_fwd_interface import flash_attn_func as fa3_func
    if fp8:
        d = x.descale
        args, kw = (x.q8, x.k8, x.v8), dict(q_descale=d["q"], k_descale=d["k"], v_descale=d["v"])
    else:
        args, kw = (x.q16, x.k16, x.v16), {}
    box = {}

    def call():
        r = fa3_func(*args, causal=True, **kw)
        box["o"] = r[0] if isinstance(r, tuple) else r
    return call, lambda: box["o"]


def torch_sdpa(backend_name: str):
    def build(x: Inputs, fp8: bool):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        backend = getattr(SDPBackend, backend_name)
        q, k, v = (t.transpose(1, 2) for t in (x.q16, x.k16, x.v16))
        gqa = q.shape[1] != k.shape[1]
        box = {}

        def call():
            with sdpa_kernel(backend):
                box["o"] = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return call, lambda: box["o"].transpose(1, 2)
    return build


def cudnn_fp8(x: Inputs, fp8: bool):
    import cudnn
    dqk, dv, b, s, h, hk = x.shape
    q, k, v = (t.permute(0, 2, 1, 3) for t in (x.q8, x.k8, x.v8))  # (b, h, s, d) views
    o = torch.empty(b, s, h, dv, device="cuda", dtype=torch.float8_e4m3fn).permute(0, 2, 1, 3)
    scalars = {n: torch.full((1, 1, 1, 1), val, device="cuda", dtype=torch.float32) for n, val in (
        ("dq", x.qs), ("dk", x.ks), ("dv", x.vs), ("ds", 1.0), ("ss", 1.0),
        ("so", 1.0 / x.vs))}  # |o| <= max|v| = 448 * vs: fills the e4m3 range
    amax = {n: torch.zeros(1, 1, 1, 1, device="cuda", dtype=torch.float32) for n in ("s", "o")}
    graph = cudnn.pygraph(io_data_type=cudnn.data_type.FP8_E4M3, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT)
    tq, tk, tv = graph.tensor_like(q), graph.tensor_like(k), graph.tensor_like(v)
    ts = {n: graph.tensor_like(t) for n, t in scalars.items()}
    to, _, ta_s, ta_o = graph.sdpa_fp8(q=tq, k=tk, v=tv, descale_q=ts["dq"], descale_k=ts["dk"], descale_v=ts["dv"],
                                       descale_s=ts["ds"], scale_s=ts["ss"], scale_o=ts["so"], is_inference=True,
                                       attn_scale=dqk ** -0.5, use_causal_mask=True, name="sdpa_fp8")
    to.set_output(True).set_dim(list(o.shape)).set_stride(list(o.stride())).set_data_type(cudnn.data_type.FP8_E4M3)
    for t in (ta_s, ta_o):
        t.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(cudnn.data_type.FLOAT)
    graph.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    ws = torch.empty(max(1, graph.get_workspace_size()), device="cuda", dtype=torch.uint8)
    pack = {tq: q, tk: k, tv: v, to: o, ta_s: amax["s"], ta_o: amax["o"]}
    pack.update({ts[n]: scalars[n] for n in ts})

    def call():
        graph.execute(pack, ws)
    return call, lambda: (o.float() / scalars["so"].view(1)).permute(0, 2, 1, 3)


PEERS = ("fa3-fp8", "cudnn-fp8", "fa3-bf16", "sdpa-cudnn-bf16", "sdpa-flash-bf16")


def systems(our_cfgs: dict[str, KernelConfig], dqk: int, dv: int, peers=PEERS) -> list[tuple[str, bool, Callable]]:
    out = [(name, cfg.dtype == "fp8", ours(cfg)) for name, cfg in our_cfgs.items()]
    table = {"fa3-fp8": (True, fa3), "cudnn-fp8": (True, cudnn_fp8), "fa3-bf16": (False, fa3),
             "sdpa-cudnn-bf16": (False, torch_sdpa("CUDNN_ATTENTION")),
             "sdpa-flash-bf16": (False, torch_sdpa("FLASH_ATTENTION"))}
    for name in peers:
        if name.startswith("sdpa") and dqk != dv:
            continue  # torch SDPA needs equal head dims
        out.append((name, *table[name]))
    return out


def parse_overrides(text: str) -> dict:
    out = {}
    for item in filter(None, text.split(",")):
        key, _, val = item.partition("=")
        out[key.strip()] = int(val) if val.strip().lstrip("-").isdigit() else val.strip()
    return out


def run(shapes, our_specs: list[str], reps: int, seed: int, peers=PEERS) -> list[dict]:
    rows = []
    warm_gpu(3.0)
    for (dqk, dv, b, s, h) in shapes:
        hk = h
        x = Inputs(dqk, dv, b, s, h, hk, seed)
        refs = {True: x.reference(True), False: x.reference(False)}
        flops = attention_flops(b, h, s, s, dqk, dv, True)
        cfgs = {}
        for spec in our_specs:
            label, _, over = spec.partition(":") if ":" in spec else ("", "", spec)
            over_d = parse_overrides(over)
            base = default_config(str(over_d.get("dtype", "fp8")), dqk, dv)
            cfg = base.replace(**over_d)
            cfgs[label or ("ours-" + (over or cfg.dtype))] = cfg
        for name, fp8, build in systems(cfgs, dqk, dv, peers):
            row = dict(shape=f"{dqk}/{dv} B={b} S={s} H={h}", system=name, dqk=dqk, dv=dv, b=b, s=s, h=h)
            try:
                call, get = build(x, fp8)
                call()
                torch.cuda.synchronize()
                o = get()
                row["rel_l2"] = rel_l2(o, refs[fp8])
                row["max_err"] = max_abs_err(o, refs[fp8])
                t = time_cuda([call], warmup=3, reps=reps)
                row.update(asdict(t))
                row["tflops"] = flops / (t.median_ms * 1e-3) / 1e12
                if t.energy_j_per_call:
                    row["tflop_per_j"] = flops / t.energy_j_per_call / 1e12
            except Exception as exc:  # a missing or failing peer is reported, not fatal
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
            rows.append(row)
            print(_fmt(row), flush=True)
        del x, refs
        torch.cuda.empty_cache()
    return rows


def _fmt(r: dict) -> str:
    if "error" in r:
        return f"{r['shape']:<26} {r['system']:<22} ERROR {r['error']}"
    clock = f"{r['sm_clock_mhz']:.0f}MHz" if r.get("sm_clock_mhz") else "-"
    tpj = f"{r['tflop_per_j']:.2f}TF/J" if r.get("tflop_per_j") else ""
    return (f"{r['shape']:<26} {r['system']:<22} {r['tflops']:7.1f} TFLOP/s  {r['median_ms']:8.3f} ms  "
            f"relL2 {r['rel_l2']:.3e}  max {r['max_err']:.2e}  {clock} {r.get('power_w') or 0:.0f}W {tpj}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", action="append", help="dqk,dv,batch,seqlen,heads (repeatable)")
    ap.add_argument("--ours", action="append",
                    help="[label:]key=val,... overrides of the default config (repeatable); default: the default fp8 and bf16 configs")
    ap.add_argument("--peers", default=",".join(PEERS), help=f"comma list from {','.join(PEERS)} (or 'none')")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write all rows and the GPU state here")
    a = ap.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split(",")) for s in a.shape] if a.shape else DEFAULT_SHAPES
    specs = a.ours or ["ours-fp8:dtype=fp8", "ours-bf16:dtype=bf16"]
    state = gpu_state()
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC  {state}  torch {torch.__version__}", flush=True)
    peers = [] if a.peers == "none" else [p for p in a.peers.split(",") if p]
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        ap.error(f"--peers: unknown {unknown}; choose from {list(PEERS)}")
    rows = run(shapes, specs, a.reps, a.seed, peers)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "gpu": state,
                       "gpu_after": gpu_state(), "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
