"""`zyfa-tune bench`: our kernels against the peers (FlashAttention-3, cuDNN, torch SDPA), in one
process, on the same fresh inputs, by one timer and against one float64 reference.

Why one process and one timer: numbers from different scripts differ by clocks, warm-up and timing
method more than the kernels differ. So every system here is timed by `kernels.timing.time_cuda`
(CUDA events, median after warm-up) in rounds interleaved with the others on the same tensors (a GPU
at its power limit drifts by 20% in clock within a run), its error is rel.
L2 against `kernels.reference.attention_reference` (float64) on exactly the inputs it was given,
and the GPU state (NVML clocks, power, temperature) is recorded before and after the run and the
mean SM clock per row.

By default FP8 systems all get the same e4m3 tensors, quantised with one per-tensor scale (given to
FA3 and us as (batch, kv_heads) descales, to cuDNN as scalars): the error is the kernel's alone.
With `quant="native"` each quantises as it normally would (FA3 and ours `quantize_fp8` per (batch,
kv head), ours optionally with K smoothing / Hadamard; cuDNN per tensor) and every error is against
float64 attention on the unquantised inputs. Inputs come from an input family (`kernels.inputs`:
gaussian by default, or activation-like ones). BF16 systems get the bf16 tensors the FP8 ones were
quantised from. "ours" is `flash_attn_func` through the dispatcher (what a user gets);
forced configs (`--ours label:key=val,...`) run beside it. FLOPs = 2*B*H*S^2*(Dqk+Dv)/2 (causal).

Energy (`energy_s`): NVML's counter is only trustworthy over a second or more (kernels.timing), so
TFLOP/J comes from a separate window per system after its timing rounds, the calls back to back for
`energy_s` seconds at whatever clock the power limit then allows; the W column is that window's mean
power. The FP8 GEMM ceiling (`ceiling`): torch._scaled_mm at 8192^3 (e4m3 in, bf16 out), timed by the
same timer at the start and at the end of the run, so each FP8 row can say what share of the tensor
cores' practical rate it reaches.

Results are a `BenchResult` (JSON: `save` / `load`); `zyfa_tune.bench.report` draws the table and
the plot from it, so a saved run can be redrawn on a machine without a GPU.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch

from zyfa_tune.generator import HEAD_DIMS, ConfigError, KernelConfig
from zyfa_tune.kernels.quantize import E4M3_MAX
from zyfa_tune.tuning.timing import MIN_ENERGY_WINDOW_S
from zyfa_tune.tuning.worker import Shape

DTYPES = ("fp8", "bf16")
#: tokens per shape when no batch is given: batch = max(1, TOKENS // seqlen), as `zyfa-tune tune`
TOKENS = 16384
DEFAULT_HEADS = 32


# ---- what to measure ---------------------------------------------------------------------------

@dataclass(frozen=True)
class BenchShape(Shape):
    """A tuner shape (batch, heads, kv_heads, seqlen; validated there) with its head dims."""

    head_dim_qk: int
    head_dim_v: int

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("head_dim_qk", "head_dim_v"):
            if getattr(self, name) not in HEAD_DIMS:
                raise ValueError(f"{name}: {getattr(self, name)} is not one of {list(HEAD_DIMS)}")

    @property
    def label(self) -> str:
        heads = f"H={self.heads}" + (f"/{self.kv_heads}" if self.kv_heads != self.heads else "")
        return f"{self.head_dim_qk}/{self.head_dim_v} B={self.batch} S={self.seqlen} {heads}"

    @property
    def flops(self) -> float:
        from zyfa_tune.tuning.timing import attention_flops

        return attention_flops(self.batch, self.heads, self.seqlen, self.seqlen, self.head_dim_qk,
                               self.head_dim_v, True)


def _ints(text: str, what: str, sep: str = ",") -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(sep) if x.strip())
    except ValueError:
        raise ValueError(f"{what}: expected integers separated by {sep!r}, got {text!r}") from None


def parse_shape(text: str) -> BenchShape:
    """'dqk,dv,batch,seqlen,heads[,kv_heads]' (the format of the old benchmarks/peers.py)."""
    v = _ints(text, "--shape")
    if len(v) not in (5, 6):
        raise ValueError(f"--shape: expected dqk,dv,batch,seqlen,heads[,kv_heads], got {text!r}")
    return BenchShape(head_dim_qk=v[0], head_dim_v=v[1], batch=v[2], seqlen=v[3], heads=v[4],
                      kv_heads=v[5] if len(v) == 6 else v[4])


def shapes_from(head_dim: int, head_dim_v: int | None, seqlens: str, batch_heads: str | None = None,
                kv_heads: int | None = None) -> tuple[BenchShape, ...]:
    """Shapes from `--seqlens 4096,8192` and `--batch-heads 4x32,2x32` (one BxH per seqlen, or one
    for all; default: B = 16384 tokens / S, H = 32)."""
    lens = _ints(seqlens, "--seqlens")
    if not lens:
        raise ValueError("--seqlens: give at least one sequence length")
    if batch_heads:
        pairs = [_ints(item, "--batch-heads", "x") for item in batch_heads.split(",") if item.strip()]
        if any(len(p) != 2 for p in pairs) or len(pairs) not in (1, len(lens)):
            raise ValueError(f"--batch-heads: expected BxH, one for all or one per seqlen ({len(lens)}), "
                             f"got {batch_heads!r}")
        pairs = pairs * len(lens) if len(pairs) == 1 else pairs
    else:
        pairs = [(max(1, TOKENS // s), DEFAULT_HEADS) for s in lens]
    dv = head_dim_v or head_dim
    return tuple(BenchShape(head_dim_qk=head_dim, head_dim_v=dv, batch=b, seqlen=s, heads=h, kv_heads=kv_heads or h)
                 for s, (b, h) in zip(lens, pairs))


@dataclass(frozen=True)
class OursSpec:
    """One of our systems: the dispatcher's choice (`overrides` None) or a forced config (the
    default config of the shape's head dims, of the backend the overrides name, with these fields
    changed: backend=gluon alone is the Gluon default)."""

    label: str
    dtype: str
    overrides: tuple[tuple[str, Any], ...] | None = None
    quant: tuple[tuple[str, Any], ...] = ()  # quantize_fp8 options (QUANT_OPTIONS), --quant native only

    def config_for(self, head_dim_qk: int, head_dim_v: int) -> KernelConfig | None:
        from zyfa_tune.generator.defaults import config_with

        if self.overrides is None:
            return None
        return config_with(self.dtype, head_dim_qk, head_dim_v, dict(self.overrides))


def _kappa(text: Any) -> float:
    """--ours v_weight=K as a float >= 0 (parse_changes leaves a number it cannot type as its text)."""
    try:
        kappa = float(text) if not isinstance(text, bool) else -1.0
    except ValueError:
        kappa = -1.0
    if not 0 <= kappa < float("inf"):
        raise ValueError(f"--ours: v_weight expects a number >= 0, got {text!r}")
    return kappa


def parse_ours(text: str, dtypes: Sequence[str]) -> list[OursSpec]:
    """'[label:]key=val,...' -> one forced config per benched dtype (only the named one if the text
    sets dtype=), labelled -<dtype> when there are several, so that the labels stay distinct."""
    label, sep, body = text.partition(":")
    if not sep or "=" in label:
        label, body = "", text
    from zyfa_tune.generator.defaults import parse_changes

    over = parse_changes([body], "--ours")
    named = over.pop("dtype", None)
    if named is not None and named not in DTYPES:
        raise ValueError(f"--ours: dtype={named!r} is not one of {list(DTYPES)}")
    quant = {k: over.pop(k) for k in QUANT_OPTIONS if k in over}
    for k, v in quant.items():
        if k == "v_weight":   # balanced V's kappa (quantize_fp8's v_weight), a number
            quant[k] = _kappa(v)
            if not quant.get("balanced_v"):
                raise ValueError("--ours: v_weight weighs balanced V's moves: add balanced_v=true")
        elif not isinstance(v, bool):
            raise ValueError(f"--ours: {k} expects true or false, got {v!r}")
    if quant and named != "fp8" and list(dtypes) != ["fp8"]:
        raise ValueError(f"--ours: {sorted(quant)} are FP8 quantisation options: add dtype=fp8")
    kinds = [named] if named else list(dtypes)
    base = label or "ours-" + (",".join(f"{k}={v}" for k, v in {**over, **quant}.items()) or "default")
    configs = tuple(over.items()) if over or not quant else None  # only quantisation: the dispatcher's kernel
    return [OursSpec(base if len(kinds) == 1 else f"{base}-{dt}", dt, configs, tuple(quant.items()))
            for dt in kinds]


# ---- inputs and systems ------------------------------------------------------------------------

#: `--ours` keys that are `quantize_fp8` options, not config fields
QUANT_OPTIONS = ("smooth_k", "hadamard", "k_major_v", "balanced_v", "v_weight")
#: how FP8 systems get their inputs: one shared per-tensor quantisation (kernel error only), or each
#: system's own (FA3 and ours: `quantize_fp8` per (batch, kv head); cuDNN: per tensor), the error
#: then taken against float64 attention on the unquantised inputs (issue 5's comparison); "end-to-end":
#: as native, but FA3 and ours quantise the bf16 inputs inside every timed call (quantiser + attention:
#: what a model pays per layer; FA3 gets the plain `quantize_fp8`, its per-(batch, kv head) descales)
QUANT_MODES = ("per-tensor", "native", "end-to-end")


@dataclass(frozen=True)
class Inputs:
    """One shape's inputs of an input family (`kernels.inputs`): bf16 tensors and their per-tensor
    e4m3 quantisation; with `raw` (native mode) also the float32 originals, quantised per system."""

    shape: BenchShape
    q16: torch.Tensor
    k16: torch.Tensor
    v16: torch.Tensor
    q8: torch.Tensor
    k8: torch.Tensor
    v8: torch.Tensor
    scales: tuple[float, float, float]     # per-tensor q, k, v scales (dequantised = e4m3 * scale)
    raw: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    timed_quant: bool = False              # end-to-end: FP8 systems quantise q16, k16, v16 in each call
    _native: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def random(cls, shape: BenchShape, seed: int, device: str = "cuda", family: str = "gaussian",
               quant: str = "per-tensor") -> "Inputs":
        """`quant` (QUANT_MODES): beyond per-tensor, the float32 originals are kept for each system's own
        quantisation and the reference."""
        from zyfa_tune.tuning.inputs import make_qkv

        q, k, v = make_qkv(family, batch=shape.batch, seqlen=shape.seqlen, heads=shape.heads,
                           kv_heads=shape.kv_heads, head_dim_qk=shape.head_dim_qk, head_dim_v=shape.head_dim_v,
                           seed=seed, device=device)
        q16, k16, v16 = (t.to(torch.bfloat16) for t in (q, k, v))
        (q8, qs), (k8, ks), (v8, vs) = (_quantise(t) for t in (q16, k16, v16))
        return cls(shape, q16, k16, v16, q8, k8, v8, (qs, ks, vs), None if quant == "per-tensor" else (q, k, v),
                   quant == "end-to-end")

    def descales(self) -> dict[str, torch.Tensor]:
        """FA3-style (batch, kv_heads) descales, all equal to the per-tensor scale."""
        b, hk = self.shape.batch, self.shape.kv_heads
        return {f"{n}_descale": torch.full((b, hk), s, device=self.q16.device)
                for n, s in zip("qkv", self.scales)}

    def args(self, dtype: str, quant: tuple[tuple[str, Any], ...] = ()) -> tuple[tuple[torch.Tensor, ...],
                                                                                 dict[str, torch.Tensor]]:
        """(q, k, v) and descale keywords as `flash_attn_func` and FA3 take them: in native mode FP8
        inputs are `quantize_fp8(raw, **quant)` (made once per option set)."""
        if dtype == "fp8" and self.raw is not None:
            if quant not in self._native:
                self._native[quant] = _quantize_fp8(self.raw, quant)
            return self._native[quant]
        if dtype == "fp8":
            return (self.q8, self.k8, self.v8), self.descales()
        return (self.q16, self.k16, self.v16), {}

    def call(self, dtype: str, quant: tuple[tuple[str, Any], ...], fn: Callable[..., Any]) -> Callable[[], Any]:
        """A call of fn(*args, **kw) on `args(dtype, quant)`; end-to-end, FP8 inputs quantised from the bf16
        tensors inside the call (so that its timing counts the quantiser)."""
        if dtype == "fp8" and self.timed_quant:
            x16 = (self.q16, self.k16, self.v16)

            def quantise_and_run() -> Any:
                args, kw = _quantize_fp8(x16, quant)
                return fn(*args, **kw)
            return quantise_and_run
        args, kw = self.args(dtype, quant)
        return lambda: fn(*args, **kw)

    def reference(self, dtype: str) -> torch.Tensor:
        """Float64 attention on what `dtype` systems were given, or in native mode on the
        unquantised inputs (so input quantisation counts in every system's error)."""
        from zyfa_tune.tuning.reference import attention_reference

        if self.raw is not None:
            return attention_reference(*self.raw, causal=True)
        args, kw = self.args(dtype)
        return attention_reference(*args, causal=True, **kw)


def _quantize_fp8(x: tuple[torch.Tensor, ...], quant: tuple[tuple[str, Any], ...]) -> tuple[tuple, dict]:
    """`quantize_fp8` of (q, k, v) with `--ours` quantisation options, as (q8, k8, v8) and descale keywords."""
    from zyfa_tune.quantize import quantize_fp8

    opts = dict(quant)  # k_major_v: V's codes keys-fastest; balanced_v: v_rounding="balanced"
    opts["v_layout"] = "k_major" if opts.pop("k_major_v", False) else "natural"
    opts["v_rounding"] = "balanced" if opts.pop("balanced_v", False) else "nearest"
    q8, k8, v8, qd, kd, vd = quantize_fp8(*x, **opts)
    return (q8, k8, v8), dict(q_descale=qd, k_descale=kd, v_descale=vd)


def _quantise(x: torch.Tensor) -> tuple[torch.Tensor, float]:
    scale = float(x.float().abs().amax()) / E4M3_MAX
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


@dataclass(frozen=True)
class Bound:
    """A system bound to one input set: `call()` runs it, `output()` is its last output in
    (batch, seqlen, heads, head_dim_v) layout; `config`/`source` say which of our kernels ran."""

    call: Callable[[], None]
    output: Callable[[], torch.Tensor]
    config: str | None = None
    source: str | None = None
    entry: str | None = None   # the tuned entry's problem class where another shape's ran (nearest, other device)


@dataclass(frozen=True)
class System:
    name: str
    kind: str                          # "ours" (dispatcher) | "forced" (config given) | "peer"
    dtype: str
    bind: Callable[[Inputs], Bound]


def _boxed(fn: Callable[[], Any], pick: Callable[[Any], torch.Tensor] = lambda r: r):
    """(call, output): call() runs fn and keeps pick(result) for output()."""
    box: dict[str, torch.Tensor] = {}

    def call() -> None:
        box["o"] = pick(fn())
    return call, lambda: box["o"]


def borrowed_from(choice) -> str | None:
    """Where the dispatcher's kernel was tuned when that was not this call's own problem class or GPU
    (a `kernels.dispatch.Choice` of source nearest / other-device), else None: a row that runs another
    shape's kernel says whose, so a stale neighbour shows in the table (session 21: 192/128 at 32K ran
    a 16K entry tuned before the two-P-tile kernel existed)."""
    key, tuned = choice.key, choice.tuned_key
    if tuned is None or (tuned == key and choice.source == "exact"):
        return None
    where = f"tuned at seqlen<={tuned.seqlen_bucket} B*H<={tuned.bh_bucket}"
    if tuned.gqa_group != key.gqa_group:
        where += f" gqa={tuned.gqa_group}"
    return where + (f" on {choice.tuned_on}" if choice.source == "other-device" and choice.tuned_on else "")


def ours_system(spec: OursSpec, shape: BenchShape) -> System:
    config = spec.config_for(shape.head_dim_qk, shape.head_dim_v)

    def bind(x: Inputs) -> Bound:
        from zyfa_tune.api import explain, flash_attn_func

        call, output = _boxed(x.call(spec.dtype, spec.quant,
                                     lambda *a, **kw: flash_attn_func(*a, causal=True, config=config, **kw)))
        if config is not None:
            return Bound(call, output, config.to_json(), "forced")
        args, kw = x.args(spec.dtype, spec.quant)
        choice = explain(*args, causal=True, **kw)
        return Bound(call, output, choice.config.to_json(), choice.source, borrowed_from(choice))
    return System(spec.label, "ours" if config is None else "forced", spec.dtype, bind)


def _fa3(dtype: str) -> Callable[[Inputs], Bound]:
    def bind(x: Inputs) -> Bound:
        from fa3_fwd_interface import flash_attn_func as fa3_func

        return Bound(*_boxed(x.call(dtype, (), lambda *a, **kw: fa3_func(*a, causal=True, **kw)),
                             lambda r: r[0] if isinstance(r, tuple) else r))
    return bind


def _sdpa(backend_name: str) -> Callable[[Inputs], Bound]:
    def bind(x: Inputs) -> Bound:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, backend_name)
        q, k, v = (t.transpose(1, 2) for t in (x.q16, x.k16, x.v16))
        gqa = q.shape[1] != k.shape[1]

        def run() -> torch.Tensor:
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return Bound(*_boxed(run, lambda o: o.transpose(1, 2)))
    return bind


def _cudnn_fp8(x: Inputs) -> Bound:
    """cuDNN's sdpa_fp8 graph; its FP8 output is dequantised for the error."""
    import cudnn

    sh = x.shape
    qs, ks, vs = x.scales
    q, k, v = (t.permute(0, 2, 1, 3) for t in (x.q8, x.k8, x.v8))  # (b, h, s, d) views
    o = torch.empty(sh.batch, sh.seqlen, sh.heads, sh.head_dim_v, device=x.q8.device,
                    dtype=torch.float8_e4m3fn).permute(0, 2, 1, 3)
    scalars = {n: torch.full((1, 1, 1, 1), val, device=x.q8.device, dtype=torch.float32) for n, val in (
        ("dq", qs), ("dk", ks), ("dv", vs), ("ds", 1.0), ("ss", 1.0),
        ("so", 1.0 / vs))}  # |o| <= max|v| = 448 * vs: fills the e4m3 range
    amax = {n: torch.zeros(1, 1, 1, 1, device=x.q8.device, dtype=torch.float32) for n in ("s", "o")}
    graph = cudnn.pygraph(io_data_type=cudnn.data_type.FP8_E4M3, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT)
    tq, tk, tv = graph.tensor_like(q), graph.tensor_like(k), graph.tensor_like(v)
    ts = {n: graph.tensor_like(t) for n, t in scalars.items()}
    to, _, ta_s, ta_o = graph.sdpa_fp8(q=tq, k=tk, v=tv, descale_q=ts["dq"], descale_k=ts["dk"], descale_v=ts["dv"],
                                       descale_s=ts["ds"], scale_s=ts["ss"], scale_o=ts["so"], is_inference=True,
                                       attn_scale=sh.head_dim_qk ** -0.5, use_causal_mask=True, name="sdpa_fp8")
    to.set_output(True).set_dim(list(o.shape)).set_stride(list(o.stride())).set_data_type(cudnn.data_type.FP8_E4M3)
    for t in (ta_s, ta_o):
        t.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(cudnn.data_type.FLOAT)
    graph.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    ws = torch.empty(max(1, graph.get_workspace_size()), device=x.q8.device, dtype=torch.uint8)
    pack = {tq: q, tk: k, tv: v, to: o, ta_s: amax["s"], ta_o: amax["o"]}
    pack.update({ts[n]: scalars[n] for n in ts})
    return Bound(lambda: graph.execute(pack, ws), lambda: (o.float() / scalars["so"].view(1)).permute(0, 2, 1, 3))


#: peer name -> (dtype, bind, needs equal head dims)
PEERS: dict[str, tuple[str, Callable[[Inputs], Bound], bool]] = {
    "fa3-fp8": ("fp8", _fa3("fp8"), False),
    "cudnn-fp8": ("fp8", _cudnn_fp8, False),
    "fa3-bf16": ("bf16", _fa3("bf16"), False),
    "sdpa-cudnn-bf16": ("bf16", _sdpa("CUDNN_ATTENTION"), True),
    "sdpa-flash-bf16": ("bf16", _sdpa("FLASH_ATTENTION"), True),
}


def parse_peers(text: str | None, dtypes: Sequence[str]) -> tuple[str, ...]:
    """Comma list of PEERS names, 'none', or None: every peer of the benched dtypes."""
    if text is None:
        return tuple(n for n, (dt, _, _) in PEERS.items() if dt in dtypes)
    if text.strip() == "none":
        return ()
    names = tuple(p.strip() for p in text.split(",") if p.strip())
    unknown = [p for p in names if p not in PEERS]
    if unknown:
        raise ValueError(f"--peers: unknown {unknown}; choose from {list(PEERS)} or 'none'")
    return names


def systems_for(shape: BenchShape, ours: Iterable[OursSpec], peers: Iterable[str]) -> list[System]:
    out = [ours_system(spec, shape) for spec in ours]
    for name in peers:
        dtype, bind, equal_dims = PEERS[name]
        if equal_dims and shape.head_dim_qk != shape.head_dim_v:
            continue  # torch SDPA needs equal head dims
        out.append(System(name, "peer", dtype, bind))
    return out


# ---- results -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class BenchRow:
    """One system on one shape. Field names match the JSON of the old benchmarks/peers.py."""

    shape: str
    system: str
    kind: str
    dtype: str
    dqk: int
    dv: int
    b: int
    s: int
    h: int
    hk: int
    tflops: float | None = None
    median_ms: float | None = None
    p20_ms: float | None = None
    p80_ms: float | None = None
    min_ms: float | None = None
    reps: int | None = None
    sm_clock_mhz: float | None = None
    power_w: float | None = None         # NVML: the energy window's mean power where one ran, else reads while timing
    energy_j_per_call: float | None = None
    tflop_per_j: float | None = None
    sustained_tflops: float | None = None      # over the energy window: at the clock the power limit allows
    sustained_clock_mhz: float | None = None
    rel_l2: float | None = None
    max_err: float | None = None
    config: str | None = None
    source: str | None = None
    entry: str | None = None    # Bound.entry: which tuned problem class a borrowed kernel came from
    error: str | None = None
    family: str | None = None   # kernels.inputs family of the inputs (None in runs saved before it)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "BenchRow":
        """From saved JSON; rows of the old peers.py lack kind/dtype/hk, which are inferred."""
        if not isinstance(d, dict) or not isinstance(d.get("system"), str):
            raise ValueError(f"rows: expected objects with a 'system' name, got {str(d)[:80]}")
        known = {f.name for f in dataclasses.fields(cls)}
        d = {k: v for k, v in d.items() if k in known}
        name = d["system"]
        d.setdefault("kind", "ours" if name.startswith("ours") else "peer")
        d.setdefault("dtype", "fp8" if "fp8" in name else "bf16")
        d.setdefault("hk", d.get("h"))
        try:
            return cls(**d)
        except TypeError as exc:
            raise ValueError(f"rows: {name}: {exc}") from None


@dataclass(frozen=True)
class BenchResult:
    date: str                            # ISO 8601, UTC
    gpu: dict[str, Any]                  # NVML state before the run (kernels.timing.gpu_state)
    gpu_after: dict[str, Any]
    environment: dict[str, Any]          # driver, CUDA, torch, Triton, generator version
    settings: dict[str, Any]             # reps, seed, rotate, warm-up seconds
    rows: tuple[BenchRow, ...]
    ceiling: dict[str, Any] = dataclasses.field(default_factory=dict)  # gemm_ceiling's, where measured

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["rows"] = [dataclasses.asdict(r) for r in self.rows]
        return out

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w") as fh:
            json.dump(self.to_dict(), fh, indent=1)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "BenchResult":
        """Read a saved run (this module's or the old benchmarks/peers.py's JSON)."""
        try:
            with open(path) as fh:
                data = json.load(fh)
        except (OSError, ValueError) as exc:
            raise ValueError(f"--from: cannot read {path}: {exc}") from None
        if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
            raise ValueError(f"--from: {path} holds no 'rows' list; is it a zyfa-tune bench JSON?")
        rows = tuple(BenchRow.from_dict(r) for r in data["rows"])
        return cls(date=str(data.get("date", "")), gpu=dict(data.get("gpu") or {}),
                   gpu_after=dict(data.get("gpu_after") or {}), environment=dict(data.get("environment") or {}),
                   settings=dict(data.get("settings") or {}), rows=rows, ceiling=dict(data.get("ceiling") or {}))


# ---- measuring ---------------------------------------------------------------------------------

def _error_text(exc: BaseException) -> str:
    first = str(exc).splitlines()[0][:160] if str(exc) else ""
    return f"{type(exc).__name__}: {first}"


def measure_shape(shape: BenchShape, systems: Sequence[System], *, seed: int, reps: int, rotate: int = 1,
                  rounds: int = 3, device: str = "cuda", timer: Callable[..., Any] | None = None,
                  input_family: str = "gaussian", quant: str = "per-tensor", energy_s: float = 0.0,
                  energy: Callable[..., Any] | None = None,
                  on_row: Callable[[BenchRow], None] | None = None) -> list[BenchRow]:
    """All systems on `rotate` fresh input sets of one shape (seeds seed, seed+1, ...). Each system
    runs once on the first set for its error against the float64 reference (computed once per
    dtype); then they are timed in `rounds` rounds of about reps / rounds calls each, every round in
    a rotated order, so that the clock drift of a GPU at its power limit (1980 -> 1500 MHz within a
    run, docs/PERF.md) falls on every system alike instead of on whichever runs last. A failing
    system gives a row with `error`. With `energy_s` > 0 each system then runs for that long back to
    back (`energy`, default kernels.timing.sustained_energy) for its joules per call."""
    from zyfa_tune.tuning.reference import max_abs_err, rel_l2
    from zyfa_tune.tuning.timing import pooled, sustained_energy, time_cuda

    timer = timer or time_cuda
    energy = energy or sustained_energy
    inputs = [Inputs.random(shape, seed + i, device, input_family, quant) for i in range(rotate)]
    refs: dict[str, torch.Tensor] = {}
    base = dict(shape=shape.label, dqk=shape.head_dim_qk, dv=shape.head_dim_v, b=shape.batch, s=shape.seqlen,
                h=shape.heads, hk=shape.kv_heads, family=input_family)
    rows: dict[int, BenchRow] = {}
    ready: dict[int, tuple[list[Bound], dict[str, float]]] = {}

    def failed(system: System, bound: list[Bound], exc: BaseException) -> BenchRow:
        info = dict(config=bound[0].config, source=bound[0].source, entry=bound[0].entry) if bound else {}
        return BenchRow(**base, system=system.name, kind=system.kind, dtype=system.dtype, **info,
                        error=_error_text(exc))

    for i, system in enumerate(systems):
        bound: list[Bound] = []
        try:
            bound = [system.bind(x) for x in inputs]
            bound[0].call()
            if inputs[0].q16.is_cuda:
                torch.cuda.synchronize()
            if system.dtype not in refs:
                refs[system.dtype] = inputs[0].reference(system.dtype)
            out, ref = bound[0].output(), refs[system.dtype]
            ready[i] = bound, dict(rel_l2=rel_l2(out, ref), max_err=max_abs_err(out, ref))
            del out
        except Exception as exc:  # a missing or failing peer is reported, not fatal
            rows[i] = failed(system, bound, exc)
    blocks: dict[int, list] = {i: [] for i in ready}
    order = list(ready)
    per_round = max(5, -(-reps // max(1, rounds)))
    for r in range(max(1, rounds) if order else 0):
        for i in order[r % len(order):] + order[:r % len(order)]:
            if i in rows:
                continue
            try:
                blocks[i].append(timer([b.call for b in ready[i][0]], warmup=3, reps=per_round))
            except Exception as exc:
                rows[i] = failed(systems[i], ready[i][0], exc)
    timings = {i: pooled(blocks[i]) for i in order if i not in rows}
    windows: dict[int, Any] = {}
    if energy_s > 0:
        for i in timings:
            try:
                windows[i] = energy([b.call for b in ready[i][0]], seconds=energy_s, call_ms=timings[i].median_ms)
            except Exception as exc:
                rows[i] = failed(systems[i], ready[i][0], exc)
    out_rows = []
    for i, system in enumerate(systems):
        if i not in rows:
            bound, errors = ready[i]
            t, window = timings[i], windows.get(i)
            joules = window.joules_per_call if window else t.energy_j_per_call
            rows[i] = BenchRow(**base, system=system.name, kind=system.kind, dtype=system.dtype, **errors,
                               tflops=shape.flops / (t.median_ms * 1e-3) / 1e12, median_ms=t.median_ms,
                               p20_ms=t.p20_ms, p80_ms=t.p80_ms, min_ms=t.min_ms, reps=t.reps,
                               sm_clock_mhz=t.sm_clock_mhz, power_w=window.power_w if window else t.power_w,
                               energy_j_per_call=joules, tflop_per_j=shape.flops / joules / 1e12 if joules else None,
                               sustained_tflops=shape.flops * window.calls / window.seconds / 1e12 if window else None,
                               sustained_clock_mhz=window.sm_clock_mhz if window else None,
                               config=bound[0].config, source=bound[0].source, entry=bound[0].entry)
        out_rows.append(rows[i])
        if on_row:
            on_row(rows[i])
    return out_rows


@dataclass(frozen=True)
class BenchPlan:
    shapes: tuple[BenchShape, ...]
    ours: tuple[OursSpec, ...]
    peers: tuple[str, ...]
    reps: int = 30
    seed: int = 0
    rotate: int = 1          # input sets timed round-robin (>1 where inputs would sit in L2)
    rounds: int = 3          # timing rounds over all systems of a shape, each in a rotated order
    warm_s: float = 3.0      # seconds of bf16 GEMMs before the first timing
    input_family: str = "gaussian"   # kernels.inputs families, comma-separated: every shape on each
    quant: str = "per-tensor"        # QUANT_MODES
    energy_s: float = 0.0            # seconds of back-to-back calls per system for TFLOP/J (0: none)
    ceiling: bool = False            # also time the FP8 GEMM ceiling (gemm_ceiling) at the start and end

    @property
    def families(self) -> tuple[str, ...]:
        return tuple(f.strip() for f in self.input_family.split(","))

    def __post_init__(self) -> None:
        from zyfa_tune.tuning.inputs import check_family

        if not self.shapes:
            raise ValueError("shapes: need at least one")
        if not isinstance(self.input_family, str) or len(set(self.families)) != len(self.families):
            raise ValueError(f"input_family: expected distinct comma-separated family names, got {self.input_family!r}")
        for family in self.families:
            check_family(family, "input_family")
        if self.quant not in QUANT_MODES:
            raise ValueError(f"quant: {self.quant!r} is not one of {list(QUANT_MODES)}")
        quantised = [o.label for o in self.ours if o.quant]
        if quantised and self.quant == "per-tensor":
            raise ValueError(f"--ours {quantised[0]}: quantisation options need --quant native or end-to-end "
                             f"(per-tensor mode gives every FP8 system the same tensors)")
        if self.quant == "end-to-end" and "cudnn-fp8" in self.peers:
            raise ValueError("peers: cudnn-fp8 is given per-tensor codes made outside its call; "
                             "--quant end-to-end times each system's quantiser (FA3 and ours)")
        if self.energy_s and not MIN_ENERGY_WINDOW_S <= self.energy_s <= 60:
            raise ValueError(f"energy_s: expected 0 (no energy window) or {MIN_ENERGY_WINDOW_S}-60 seconds "
                             f"(NVML's counter is not trustworthy over shorter windows), got {self.energy_s}")
        for name, lo in (("reps", 5), ("rotate", 1), ("rounds", 1)):
            if getattr(self, name) < lo:
                raise ValueError(f"{name}: expected >= {lo}, got {getattr(self, name)}")
        unknown = [p for p in self.peers if p not in PEERS]
        if unknown:
            raise ValueError(f"peers: unknown {unknown}; choose from {list(PEERS)}")
        for spec in self.ours:  # a bad forced config fails now, not after minutes of measuring
            for dims in {(s.head_dim_qk, s.head_dim_v) for s in self.shapes}:
                try:
                    spec.config_for(*dims)
                except (ConfigError, TypeError) as exc:
                    raise ConfigError(f"--ours {spec.label}: {exc}") from None


def environment() -> dict[str, Any]:
    """Driver, CUDA, torch, Triton and generator versions of GPU 0 (empty without a GPU)."""
    try:
        from zyfa_tune.db import current_fingerprint

        return dataclasses.asdict(current_fingerprint(0))
    except Exception:  # informational only
        return {"torch": torch.__version__}


#: The FP8 GEMM whose rate is the ceiling FP8 attention is compared with (issue 6: ~1270 TFLOP/s here).
CEILING_N = 8192


def fp8_gemm(n: int = CEILING_N, device: str = "cuda") -> Callable[[], Any]:
    """One call of torch._scaled_mm on n x n x n e4m3 operands (B column-major, as cuBLASLt's FP8
    GEMM wants it), bf16 out: the tensor cores' practical FP8 rate on this GPU."""
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, generator=g).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=device, generator=g).to(torch.float8_e4m3fn).t()
    one = torch.ones((), device=device)
    return lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)


def gemm_ceiling(timings: Sequence[Any], n: int = CEILING_N) -> dict[str, Any]:
    """The ceiling's record from its timing blocks (kernels.timing.Timing, pooled over the run)."""
    from zyfa_tune.tuning.timing import pooled

    t = pooled(timings)
    return dict(system="torch._scaled_mm e4m3 x e4m3 -> bf16", m=n, n=n, k=n, median_ms=t.median_ms,
                tflops=2.0 * n ** 3 / (t.median_ms * 1e-3) / 1e12, sm_clock_mhz=t.sm_clock_mhz, reps=t.reps)


def run(plan: BenchPlan, on_row: Callable[[BenchRow], None] | None = None) -> BenchResult:
    """Warm the GPU, then measure every shape; GPU state recorded before and after (and the FP8 GEMM
    ceiling at both ends where asked)."""
    from zyfa_tune.tuning.timing import gpu_state, time_cuda, warm_gpu

    if not torch.cuda.is_available():
        raise RuntimeError("bench: no CUDA device is visible; measuring needs the GPU "
                           "(redraw a saved run without one: zyfa-tune bench --from results.json --plot out.png)")
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    before = gpu_state()
    warm_gpu(plan.warm_s)
    gemm = fp8_gemm() if plan.ceiling else None
    ceiling_blocks = [time_cuda([gemm], warmup=3, reps=plan.reps)] if gemm else []
    rows: list[BenchRow] = []
    for family in plan.families:
        for shape in plan.shapes:
            rows += measure_shape(shape, systems_for(shape, plan.ours, plan.peers), seed=plan.seed, reps=plan.reps,
                                  rotate=plan.rotate, rounds=plan.rounds, on_row=on_row, input_family=family,
                                  quant=plan.quant, energy_s=plan.energy_s)
            torch.cuda.empty_cache()
    if gemm:
        ceiling_blocks.append(time_cuda([gemm], warmup=3, reps=plan.reps))
    settings = dict(reps=plan.reps, seed=plan.seed, rotate=plan.rotate, rounds=plan.rounds, warm_s=plan.warm_s,
                    input_family=plan.input_family, quant=plan.quant, energy_s=plan.energy_s,
                    peers=list(plan.peers), ours=[dataclasses.asdict(o) for o in plan.ours])
    return BenchResult(date=date, gpu=before, gpu_after=gpu_state(), environment=environment(),
                       settings=settings, rows=tuple(rows),
                       ceiling=gemm_ceiling(ceiling_blocks) if ceiling_blocks else {})
