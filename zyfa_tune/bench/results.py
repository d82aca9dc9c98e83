"""A bench run's results: one `BenchRow` per system and shape, and the `BenchResult` around them
(GPU state, environment, settings) with its JSON form, which `bench.report` draws from, so that a
saved run can be redrawn on a machine without a GPU. Fields are only ever added, with defaults, so
that every saved run still loads (and unknown keys of a newer run are skipped)."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class BenchRow:
    """One system on one shape; its fields are the keys of a row in the saved JSON."""

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
    power_w: float | None = None  # NVML: the energy window's mean power where one ran, else reads while timing
    energy_j_per_call: float | None = None
    tflop_per_j: float | None = None
    sustained_tflops: float | None = None  # over the energy window: at the clock the power limit allows
    sustained_clock_mhz: float | None = None
    rel_l2: float | None = None
    max_err: float | None = None
    config: str | None = None
    source: str | None = None
    entry: str | None = None  # Bound.entry: which tuned problem class a borrowed kernel came from
    error: str | None = None
    family: str | None = None  # tuning.inputs family of the inputs (None where the run did not record it)
    recipe: str | None = None  # the quantisation recipe the row ran (Recipe.summary), where it quantises
    # memory-traffic rows (the quantisers and the copy beside them, `bench.traffic`): bytes a call must
    # move at least, the rate that makes, and the floor (those bytes at the copy's rate, same run)
    bytes_moved: int | None = None
    gbps: float | None = None
    floor_ms: float | None = None
    floor_ratio: float | None = None  # median_ms / floor_ms

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "BenchRow":
        """From saved JSON; rows of the first format lack kind/dtype/hk, which are inferred from the name."""
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
    date: str  # ISO 8601, UTC
    gpu: dict[str, Any]  # NVML state before the run (tuning.timing.gpu_state)
    gpu_after: dict[str, Any]
    environment: dict[str, Any]  # driver, CUDA, torch, Triton, generator version
    settings: dict[str, Any]  # reps, seed, rotate, warm-up seconds
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
        """Read a saved run (either JSON format)."""
        try:
            with open(path) as fh:
                data = json.load(fh)
        except (OSError, ValueError) as exc:
            raise ValueError(f"--from: cannot read {path}: {exc}") from None
        if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
            raise ValueError(f"--from: {path} holds no 'rows' list; is it a zyfa-tune bench JSON?")
        rows = tuple(BenchRow.from_dict(r) for r in data["rows"])
        return cls(
            date=str(data.get("date", "")),
            gpu=dict(data.get("gpu") or {}),
            gpu_after=dict(data.get("gpu_after") or {}),
            environment=dict(data.get("environment") or {}),
            settings=dict(data.get("settings") or {}),
            rows=rows,
            ceiling=dict(data.get("ceiling") or {}),
        )
