"""The table and the plot of a `zyfa_tune.bench.results.BenchResult`, from a live run or from saved JSON.

Kept apart from the measuring code so that it runs where the plot is drawn: the GPU machine has
no matplotlib, so runs are saved as JSON there and drawn on the CPU side (`zyfa-tune bench --from
results.json --plot out.png`). matplotlib is an optional extra (`pip install zyfa-tune[plot]`).
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

from rich.table import Table

from zyfa_tune.bench.results import BenchResult, BenchRow

#: row kinds of the memory-traffic systems (`bench.peers.quantiser`), tabled apart from attention
TRAFFIC_KINDS = ("quantiser", "copy")
#: the quantiser's target: at most this times its traffic floor
FLOOR_TARGET = 1.5
OURS_COLORS = ("#d62728", "#ff7f0e", "#8c564b", "#e377c2", "#bcbd22")
PEER_COLORS = ("#1f77b4", "#2ca02c", "#9467bd", "#17becf", "#7f7f7f", "#393b79")


def require_matplotlib() -> None:
    """Fail before measuring, not after, when --plot cannot be drawn."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise RuntimeError(
            "--plot needs matplotlib, an optional extra: pip install 'zyfa-tune[plot]' "
            "(or save --json here and draw it elsewhere with --from)"
        ) from None


def best_peer(rows: Iterable[BenchRow]) -> dict[tuple[str, str, str | None], float]:
    """(shape, dtype, input family) -> the highest peer TFLOP/s."""
    best: dict[tuple[str, str, str | None], float] = {}
    for r in rows:
        if r.kind == "peer" and r.tflops:
            key = (r.shape, r.dtype, r.family)
            best[key] = max(best.get(key, 0.0), r.tflops)
    return best


def _families(result: BenchResult) -> list[str]:
    """The input families of a run, in measuring order (rows saved before rows had one: the run's)."""
    return list(dict.fromkeys(r.family or result.settings.get("input_family", "gaussian") for r in result.rows))


def _kernel(r: BenchRow) -> str:
    """Which of our kernels ran: the dispatcher's source and a config summary, after the recipe
    that quantised its inputs where the row names one (`attention()`)."""
    if r.config is None:
        return ""
    from zyfa_tune.generator import ConfigError, KernelConfig

    recipe = f"recipe {r.recipe}; " if r.recipe else ""
    source = r.source if r.entry is None else f"{r.source} ({r.entry})"  # another shape's kernel: whose
    try:
        c = KernelConfig.from_json(r.config)
    except ConfigError:
        return f"{recipe}{source}: (invalid config)"
    return f"{recipe}{source}: {c.summary()}"


def traffic_rows(rows: Iterable[BenchRow]) -> list[BenchRow]:
    """The memory-traffic rows (quantisers alone and the copy of `--quant-floor`), failed ones too."""
    return [r for r in rows if r.kind in TRAFFIC_KINDS]


def _shape(r: BenchRow, with_family: bool) -> str:
    return r.shape + (f" · {r.family}" if with_family and r.family else "")


def _num(value: float | None, fmt: str) -> str:
    return format(value, fmt) if value is not None and math.isfinite(value) else "-"


def results_table(result: BenchResult) -> Table:
    """A row per (shape, system); quantiles and max error stay in the JSON."""
    gpu = result.gpu.get("name") or result.environment.get("gpu_name") or "GPU"
    families = _families(result)
    inputs = ", ".join(families)
    quant = result.settings.get("quant", "per-tensor")
    how = {
        "native": "each system quantises its own (error vs unquantised)",
        "end-to-end": "each system quantises its own inside the timed call (quantiser + attention; error vs "
        "unquantised)",
    }.get(quant, "shared FP8 inputs")
    gemm = result.ceiling.get("tflops")
    gemm_mhz = result.ceiling.get("sm_clock_mhz")
    caption = (
        f"FP8 GEMM ceiling: {gemm:.1f} TFLOP/s ({result.ceiling.get('system', 'FP8 GEMM')}, "
        f"{result.ceiling.get('m')}^3, {_num(gemm_mhz, '.0f')} MHz)"
        if gemm
        else None
    )
    table = Table(title=f"zyfa-tune bench: {gpu}, causal, {result.date[:16]}, {inputs} inputs, {how}", caption=caption)
    # the GEMM runs power-limited (~1600 MHz), a timed attention row near 1980: per clock is the fair share
    ceiling_cols = (["of FP8 GEMM"] + (["per clock"] if gemm_mhz else [])) if gemm else []
    columns = (
        ["shape", "system", "TFLOP/s", "vs best peer"]
        + ceiling_cols
        + ["median ms", "rel.L2", "SM MHz", "W", "TFLOP/J", "kernel"]
    )
    for col in columns:
        table.add_column(col, overflow="fold", justify="left" if col in ("shape", "system", "kernel") else "right")
    peers = best_peer(result.rows)
    for r in result.rows:
        if r.kind in TRAFFIC_KINDS:
            continue
        style = "bold" if r.kind != "peer" else None
        if r.error:
            table.add_row(
                _shape(r, len(families) > 1),
                r.system,
                *["-"] * (len(columns) - 3),
                f"[red]{r.error}[/red]",
                style=style,
            )
            continue
        ref = peers.get((r.shape, r.dtype, r.family))
        share = [f"{r.tflops / gemm:.0%}" if r.tflops and r.dtype == "fp8" else "-"] if gemm else []
        if gemm and gemm_mhz:
            share.append(
                f"{r.tflops / r.sm_clock_mhz / (gemm / gemm_mhz):.0%}"
                if r.tflops and r.dtype == "fp8" and r.sm_clock_mhz
                else "-"
            )
        table.add_row(
            _shape(r, len(families) > 1),
            r.system,
            _num(r.tflops, ".1f"),
            f"{r.tflops / ref:.2f}x" if ref and r.tflops else "-",
            *share,
            _num(r.median_ms, ".3f"),
            _num(r.rel_l2, ".2e"),
            _num(r.sm_clock_mhz, ".0f"),
            _num(r.power_w, ".0f"),
            _num(r.tflop_per_j, ".2f"),
            _kernel(r),
            style=style,
        )
    return table


def floor_table(result: BenchResult) -> Table | None:
    """The quantisers against their memory-traffic floor (`bench.traffic`), a row per (shape,
    quantiser) and the copy that sets the floor; None where the run timed none."""
    rows = traffic_rows(result.rows)
    if not rows:
        return None
    families = _families(result)
    table = Table(
        title="quantize_fp8 alone against its traffic floor: bytes = Q, K, V read once + codes and descales "
        "written once; floor = those bytes at the rate of a device-to-device copy timed in the same rounds",
        caption=f"target: at most {FLOOR_TARGET:g}x the floor",
    )
    columns = ["shape", "system", "recipe", "median ms", "MB", "GB/s", "floor ms", "x floor", "SM MHz"]
    for col in columns:
        table.add_column(col, overflow="fold", justify="left" if col in ("shape", "system", "recipe") else "right")
    for r in rows:
        if r.error:
            table.add_row(_shape(r, len(families) > 1), r.system, r.recipe or "", *["-"] * 5, f"[red]{r.error}[/red]")
            continue
        ratio = "-" if r.floor_ratio is None else f"{r.floor_ratio:.2f}x"
        if r.floor_ratio is not None and r.floor_ratio > FLOOR_TARGET:
            ratio = f"[red]{ratio}[/red]"
        table.add_row(
            _shape(r, len(families) > 1),
            r.system,
            r.recipe or "",
            _num(r.median_ms, ".3f"),
            _num(r.bytes_moved / 1e6 if r.bytes_moved else None, ".1f"),
            _num(r.gbps, ".0f"),
            _num(r.floor_ms, ".3f"),
            ratio,
            _num(r.sm_clock_mhz, ".0f"),
            style="bold" if r.kind == "copy" else None,
        )
    return table


def row_line(r: BenchRow) -> str:
    """One line per measured row, printed while a run goes on."""
    shape = _shape(r, True)
    if r.error:
        return f"{shape:<28} {r.system:<22} ERROR {r.error}"
    if r.bytes_moved:
        return (
            f"{shape:<28} {r.system:<22} {_num(r.median_ms, '8.3f')} ms  {r.bytes_moved / 1e6:.1f} MB  "
            f"{_num(r.gbps, '.0f')} GB/s  {_num(r.floor_ratio, '.2f')}x floor" + (f"  ({r.recipe})" if r.recipe else "")
        )
    return (
        f"{shape:<28} {r.system:<22} {_num(r.tflops, '7.1f')} TFLOP/s  {_num(r.median_ms, '8.3f')} ms  "
        f"relL2 {_num(r.rel_l2, '.3e')}  {_num(r.sm_clock_mhz, '.0f')} MHz  {_num(r.power_w, '.0f')} W"
        + (
            f"  sustained {r.sustained_tflops:.1f} TFLOP/s at {_num(r.sustained_clock_mhz, '.0f')} MHz, "
            f"{_num(r.tflop_per_j, '.2f')} TFLOP/J"
            if r.sustained_tflops
            else ""
        )
    )


# ---- plot --------------------------------------------------------------------------------------


def _seqlen_label(s: int) -> str:
    return f"{s // 1024}K" if s % 1024 == 0 else str(s)


def _panels(rows: Iterable[BenchRow]) -> dict[tuple, list[BenchRow]]:
    """Measured rows grouped by (dqk, dv, heads, kv_heads, input family): one panel each."""
    panels: dict[tuple, list[BenchRow]] = defaultdict(list)
    for r in rows:
        if r.tflops:
            panels[(r.dqk, r.dv, r.h, r.hk, r.family or "")].append(r)
    return dict(panels)


def _lines(rows: list[BenchRow]) -> dict[str, list[BenchRow]]:
    """One line per system (per system and batch where a panel holds several batches per seqlen),
    ours first, points by seqlen."""
    multi = len({(r.s, r.b) for r in rows}) > len({r.s for r in rows})
    lines: dict[str, list[BenchRow]] = defaultdict(list)
    for r in sorted(rows, key=lambda r: (r.kind == "peer", r.kind == "forced", r.s)):
        lines[f"{r.system} B={r.b}" if multi else r.system].append(r)
    return dict(lines)


def _style(kind: str, dtype: str, index: int) -> dict:
    dash = "-" if dtype == "fp8" else "--"
    if kind == "peer":
        return dict(
            color=PEER_COLORS[index % len(PEER_COLORS)], lw=1.4, ls=dash, marker="s", ms=4, alpha=0.85, zorder=2
        )
    return dict(
        color=OURS_COLORS[index % len(OURS_COLORS)],
        lw=3.0 if kind == "ours" else 2.0,
        ls=dash,
        marker="o",
        ms=6,
        zorder=3,
    )


def _title(result: BenchResult, dims: str | None) -> str:
    gpu = result.gpu.get("name") or result.environment.get("gpu_name") or "unknown GPU"
    dtypes = "/".join(sorted({r.dtype for r in result.rows}, key=("fp8", "bf16").index))
    parts = [gpu, dtypes, dims, "causal", result.date[:10] or "undated"]
    return " · ".join(p for p in parts if p)


def plot(result: BenchResult, path: str | os.PathLike) -> Path:
    """TFLOP/s against sequence length (log2 axis), a line per system, ours thick and warm-coloured,
    peers thin; a panel per head-dim/heads combination. Writes a PNG and returns its path."""
    require_matplotlib()
    from matplotlib.figure import Figure

    panels = _panels(result.rows)
    if not panels:
        raise ValueError("--plot: the results hold no measured row to draw")
    several_families = len({key[4] for key in panels}) > 1
    ncols = min(3, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig = Figure(figsize=(6.4 * ncols, 4.6 * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, ((dqk, dv, h, hk, family), rows) in zip(axes, sorted(panels.items())):
        counters = {"peer": 0, "ours": 0}
        for label, points in _lines(rows).items():
            kind = points[0].kind
            group = "peer" if kind == "peer" else "ours"
            ax.plot(
                [p.s for p in points],
                [p.tflops for p in points],
                label=label,
                **_style(kind, points[0].dtype, counters[group]),
            )
            counters[group] += 1
        seqlens = sorted({r.s for r in rows})
        ax.set_xscale("log", base=2)
        ax.set_xticks(seqlens, [_seqlen_label(s) for s in seqlens])
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.set_xlabel("sequence length")
        ax.set_ylabel("TFLOP/s")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small", loc="best")
        heads = f"H={h}" + (f"/{hk}" if hk != h else "") + (f", {family} inputs" if several_families else "")
        if len(panels) > 1:
            ax.set_title(f"head dims {dqk}/{dv}, {heads}", fontsize="medium")
        else:
            ax.set_title(_title(result, f"head dims {dqk}/{dv}, {heads}"))
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    if len(panels) > 1:
        fig.suptitle(_title(result, None))
    out = Path(path)
    fig.savefig(out, dpi=150)
    return out
