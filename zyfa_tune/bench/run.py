"""`zyfa-tune bench`: our kernels against the peers (FlashAttention-3, cuDNN, torch SDPA), in one
process, on the same fresh inputs, by one timer and against one float64 reference.

A `BenchPlan` says what to measure: shapes (`bench.shape`), our systems (`bench.peers.ours`: the
dispatcher's pick and forced `--ours` configs), the registered systems (`bench.peers.PEERS`: the
peers, and `zyfa_tune.attention` end to end), the input families, how FP8 inputs are quantised
(`bench.inputs`) and whether the quantisers are timed against their memory-traffic floor
(`bench.traffic`). `run` warms the GPU, measures every shape
(`bench.measure`) and records the GPU state (NVML clocks, power, temperature) before and after.
FLOPs = 2*B*H*S^2*(Dqk+Dv)/2 (causal).

The FP8 GEMM ceiling (`ceiling`): torch._scaled_mm at 8192^3 (e4m3 in, bf16 out), timed by the
same timer at the start and at the end of the run, so each FP8 row can say what share of the tensor
cores' practical rate it reaches.

Results are a `bench.results.BenchResult` (JSON: `save` / `load`); `bench.report` draws the table
and the plot from it.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from zyfa_tune.bench.inputs import QUANT_MODES
from zyfa_tune.bench.measure import measure_shape
from zyfa_tune.bench.peers import PEERS, systems_for
from zyfa_tune.bench.peers.ours import OursSpec
from zyfa_tune.bench.results import BenchResult, BenchRow
from zyfa_tune.bench.shape import BenchShape
from zyfa_tune.generator import ConfigError
from zyfa_tune.tuning.timing import MIN_ENERGY_WINDOW_S


@dataclass(frozen=True)
class BenchPlan:
    """What `run` measures: every shape, on each input family, with our systems and the named peers;
    validated up front so that a bad setting fails before minutes of measuring."""

    shapes: tuple[BenchShape, ...]
    ours: tuple[OursSpec, ...]
    peers: tuple[str, ...]
    reps: int = 30
    seed: int = 0
    rotate: int = 1  # input sets timed round-robin (>1 where inputs would sit in L2)
    rounds: int = 3  # timing rounds over all systems of a shape, each in a rotated order
    warm_s: float = 3.0  # seconds of bf16 GEMMs before the first timing
    input_family: str = "gaussian"  # tuning.inputs families, comma-separated: every shape on each
    quant: str = "per-tensor"  # QUANT_MODES
    energy_s: float = 0.0  # seconds of back-to-back calls per system for TFLOP/J (0: none)
    ceiling: bool = False  # also time the FP8 GEMM ceiling (gemm_ceiling) at the start and end
    quant_floor: bool = False  # also time the quantisers alone and the copy that makes their floor (bench.traffic)
    paged: int = 0  # packed shapes: a page size, ours also on a paged cache and its contiguous twin (peers.paged)

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
        from zyfa_tune.kvcache import PAGE_MULTIPLE

        if self.paged < 0 or self.paged % PAGE_MULTIPLE:
            raise ValueError(
                f"paged: a page size is a positive multiple of {PAGE_MULTIPLE} (0: no paged rows), got {self.paged}"
            )
        if self.paged and not all(s.lengths for s in self.shapes):
            raise ValueError("paged: paged caches are benched on packed sequences (--lengths) only")
        if any(s.lengths for s in self.shapes) and self.quant != "per-tensor":
            raise ValueError(f"quant: packed sequences (--lengths) are benched per-tensor only, not {self.quant!r}")
        quantised = [o.label for o in self.ours if o.quant]
        if quantised and self.quant == "per-tensor":
            raise ValueError(
                f"--ours {quantised[0]}: quantisation options need --quant native or end-to-end "
                f"(per-tensor mode gives every FP8 system the same tensors)"
            )
        if self.energy_s and not MIN_ENERGY_WINDOW_S <= self.energy_s <= 60:
            raise ValueError(
                f"energy_s: expected 0 (no energy window) or {MIN_ENERGY_WINDOW_S}-60 seconds "
                f"(NVML's counter is not trustworthy over shorter windows), got {self.energy_s}"
            )
        for name, lo in (("reps", 5), ("rotate", 1), ("rounds", 1)):
            if getattr(self, name) < lo:
                raise ValueError(f"{name}: expected >= {lo}, got {getattr(self, name)}")
        unknown = [p for p in self.peers if p not in PEERS]
        if unknown:
            raise ValueError(f"peers: unknown {unknown}; choose from {list(PEERS)}")
        for name in self.peers:  # e.g. cudnn-fp8's codes are made outside its call: never end-to-end
            if self.quant not in PEERS[name].quant_modes:
                raise ValueError(
                    f"peers: {name} does not run with --quant {self.quant} (only {' / '.join(PEERS[name].quant_modes)})"
                )
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


#: The FP8 GEMM whose rate is the ceiling FP8 attention is compared with (its n = m = k).
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
    """The ceiling's record from its timing blocks (tuning.timing.Timing, pooled over the run)."""
    from zyfa_tune.tuning.timing import pooled

    t = pooled(timings)
    return dict(
        system="torch._scaled_mm e4m3 x e4m3 -> bf16",
        m=n,
        n=n,
        k=n,
        median_ms=t.median_ms,
        tflops=2.0 * n**3 / (t.median_ms * 1e-3) / 1e12,
        sm_clock_mhz=t.sm_clock_mhz,
        reps=t.reps,
    )


def run(plan: BenchPlan, on_row: Callable[[BenchRow], None] | None = None) -> BenchResult:
    """Warm the GPU, then measure every shape; GPU state recorded before and after (and the FP8 GEMM
    ceiling at both ends where asked)."""
    from zyfa_tune.tuning.timing import gpu_state, time_cuda, warm_gpu

    if not torch.cuda.is_available():
        raise RuntimeError(
            "bench: no CUDA device is visible; measuring needs the GPU "
            "(redraw a saved run without one: zyfa-tune bench --from results.json --plot out.png)"
        )
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    before = gpu_state()
    warm_gpu(plan.warm_s)
    gemm = fp8_gemm() if plan.ceiling else None
    ceiling_blocks = [time_cuda([gemm], warmup=3, reps=plan.reps)] if gemm else []
    rows: list[BenchRow] = []
    for family in plan.families:
        for shape in plan.shapes:
            rows += measure_shape(
                shape,
                systems_for(shape, plan.ours, plan.peers, plan.quant_floor, plan.paged),
                seed=plan.seed,
                reps=plan.reps,
                rotate=plan.rotate,
                rounds=plan.rounds,
                on_row=on_row,
                input_family=family,
                quant=plan.quant,
                energy_s=plan.energy_s,
            )
            torch.cuda.empty_cache()
    if gemm:
        ceiling_blocks.append(time_cuda([gemm], warmup=3, reps=plan.reps))
    settings = dict(
        reps=plan.reps,
        seed=plan.seed,
        rotate=plan.rotate,
        rounds=plan.rounds,
        warm_s=plan.warm_s,
        input_family=plan.input_family,
        quant=plan.quant,
        energy_s=plan.energy_s,
        peers=list(plan.peers),
        quant_floor=plan.quant_floor,
        paged=plan.paged,
        ours=[dataclasses.asdict(o) for o in plan.ours],
    )
    return BenchResult(
        date=date,
        gpu=before,
        gpu_after=gpu_state(),
        environment=environment(),
        settings=settings,
        rows=tuple(rows),
        ceiling=gemm_ceiling(ceiling_blocks) if ceiling_blocks else {},
    )
