"""What the bf16 API costs in `zyfa-tune bench`, on the CPU: `attention()` end to end (row
ours-attention, its recipe and kernel named) and `--quant-floor` (each quantiser alone against the
memory-traffic floor a copy of the same bytes sets in the same rounds): which systems a plan runs,
the bytes counted (GQA, 192/128), the floor arithmetic, the table, JSON old and new. A GPU test runs
the real thing."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from bench_cases import System, fake_timer, sample_result, write_first_format

from zyfa_tune import cli
from zyfa_tune.bench import report as bench_report
from zyfa_tune.bench import run as bench_run
from zyfa_tune.bench.inputs import Inputs
from zyfa_tune.bench.measure import measure_shape
from zyfa_tune.bench.peers import PEERS, parse_peers, systems_for
from zyfa_tune.bench.peers.base import Bound
from zyfa_tune.bench.peers.ours import OursSpec, parse_ours
from zyfa_tune.bench.peers.quantiser import FLOOR_RECIPES, Copy, Quantiser, floor_systems
from zyfa_tune.bench.results import BenchResult, BenchRow
from zyfa_tune.bench.run import BenchPlan
from zyfa_tune.bench.shape import BenchShape
from zyfa_tune.bench.traffic import gbps, traffic_bytes, with_floor
from zyfa_tune.generator.recipe import Recipe

GQA_192 = BenchShape(head_dim_qk=192, head_dim_v=128, batch=2, seqlen=64, heads=8, kv_heads=2)
MHA_128 = BenchShape(head_dim_qk=128, head_dim_v=128, batch=1, seqlen=96, heads=4, kv_heads=4)
FLOOR_NAMES = ["quant:plain", "quant:v_layout=k_major", "quant:v_rounding=balanced", "quant:hadamard+smooth_k"]


# ---- bytes and the floor -----------------------------------------------------------------------


@pytest.mark.parametrize("shape", [GQA_192, MHA_128], ids=["gqa-192/128", "mha-128"])
def test_traffic_bytes_are_what_quantize_fp8_reads_and_writes(shape):
    """The floor's bytes: the bf16 Q, K, V a quantiser reads and the codes and descales it returns,
    counted from real tensors (K and V have kv_heads, V its own head dim)."""
    from zyfa_tune import quantize_fp8

    x = Inputs.random(shape, seed=0, device="cpu")
    read = sum(t.numel() * t.element_size() for t in (x.q16, x.k16, x.v16))
    written = sum(t.numel() * t.element_size() for t in quantize_fp8(x.q16, x.k16, x.v16))
    assert traffic_bytes(shape) == read + written
    b, s, h, hk = shape.batch, shape.seqlen, shape.heads, shape.kv_heads
    elements = b * s * (h * shape.head_dim_qk + hk * shape.head_dim_qk + hk * shape.head_dim_v)
    assert traffic_bytes(shape, 4) == elements * 5 + 3 * b * hk * 4
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="input_bytes"):
            traffic_bytes(shape, bad)


def traffic_row(system: str, kind: str, ms: float | None, moved: int, **kw) -> BenchRow:
    return BenchRow(
        shape=MHA_128.label,
        system=system,
        kind=kind,
        dtype="fp8",
        dqk=128,
        dv=128,
        b=1,
        s=96,
        h=4,
        hk=4,
        median_ms=ms,
        bytes_moved=moved,
        gbps=gbps(moved, ms) if ms else None,
        **kw,
    )


def test_floor_is_the_rows_bytes_at_the_copys_rate():
    copy = traffic_row("copy", "copy", 0.5, 4_000_000)
    quant = traffic_row("quant:plain", "quantiser", 0.9, 3_000_000, recipe="plain")
    attention = dataclasses.replace(sample_result().rows[0], shape=MHA_128.label)
    rows = with_floor([attention, quant, copy])
    assert rows[0] == attention  # attention rows are left alone
    assert rows[1].floor_ms == pytest.approx(0.375) and rows[1].floor_ratio == pytest.approx(2.4)
    assert rows[2].floor_ms == pytest.approx(0.5) and rows[2].floor_ratio == pytest.approx(1.0)
    assert copy.gbps == pytest.approx(8.0)  # 4 MB in 0.5 ms
    failed_copy = traffic_row("copy", "copy", None, 4_000_000, error="RuntimeError: out of memory")
    assert with_floor([quant, failed_copy]) == [quant, failed_copy]  # no rate measured: no floor


# ---- which systems a plan runs -----------------------------------------------------------------


def test_systems_with_the_floor_and_attention():
    """--quant-floor adds a quantiser per floor recipe, per distinct --ours option set, and for the
    recipe attention() picks where ours-attention runs, then the copy; ours-attention is registered
    (kind ours) and runs only end to end."""
    ours = [OursSpec("ours-fp8", "fp8"), *parse_ours("sk:smooth_k=true", ["fp8"])]
    ours += parse_ours("bal:balanced_v=true", ["fp8"])  # the floor's balanced recipe: not timed twice
    systems = systems_for(MHA_128, ours, ("ours-attention", "fa3-fp8"), quant_floor=True)
    assert [(s.name, s.kind) for s in systems] == [
        ("ours-fp8", "ours"),
        ("sk", "ours"),
        ("bal", "ours"),
        ("ours-attention", "ours"),
        ("fa3-fp8", "peer"),
        *[(n, "quantiser") for n in FLOOR_NAMES],
        ("quant:smooth_k", "quantiser"),
        ("quant:ours-attention", "quantiser"),
        ("copy", "copy"),
    ]
    assert systems[-2].from_attention and dict(systems[-3].options)["smooth_k"] is True
    assert [s.name for s in systems_for(MHA_128, [], ("fa3-fp8",))] == ["fa3-fp8"]  # no floor unless asked
    assert [s.name for s in floor_systems()][-1] == "copy"
    assert len(FLOOR_RECIPES) == 4 and "quant:ours-attention" not in [s.name for s in floor_systems()]
    assert [
        dict(q.options)["v_weight"] for q in floor_systems([{"v_rounding": "balanced", "v_weight": 0.0}])[4:-1]
    ] == [0.0]  # kappa given: another quantiser
    assert parse_peers(None, ["fp8"], "end-to-end") == ("fa3-fp8",)  # cudnn's codes are made outside its call
    assert "ours-attention" not in parse_peers(None, ["fp8", "bf16"], "end-to-end")  # ours, not a peer
    shapes = (MHA_128,)
    BenchPlan(shapes=shapes, ours=(), peers=("ours-attention", "fa3-fp8"), quant="end-to-end", quant_floor=True)
    for quant in ("per-tensor", "native"):
        with pytest.raises(ValueError, match="ours-attention.*end-to-end"):
            BenchPlan(shapes=shapes, ours=(), peers=("ours-attention",), quant=quant)


@pytest.mark.parametrize(
    "argv,peers,floor",
    [
        (["--quant", "end-to-end", "--peers", "fa3-fp8"], ("ours-attention", "fa3-fp8"), False),
        (["--quant", "end-to-end"], ("ours-attention", "fa3-fp8"), False),
        (["--quant", "end-to-end", "--no-dispatch", "--peers", "fa3-fp8", "--quant-floor"], ("fa3-fp8",), True),
        (["--quant", "native", "--peers", "fa3-fp8"], ("fa3-fp8",), False),
        (["--quant-floor"], ("fa3-fp8", "cudnn-fp8"), True),
        (["--dtype", "bf16", "--quant", "end-to-end", "--peers", "none"], (), False),
    ],
)
def test_cli_plan_adds_attention_end_to_end_and_the_floor(monkeypatch, argv, peers, floor):
    plans = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench_run, "run", lambda plan, on_row=None: plans.append(plan) or sample_result())
    assert cli.main(["bench", "--seqlens", "4096", *argv]) == 0
    (plan,) = plans
    assert plan.peers == peers and plan.quant_floor is floor


# ---- measuring on the CPU ----------------------------------------------------------------------


def fake_attention(monkeypatch, recipe: Recipe) -> list:
    """attention() / explain_attention() on the CPU: float64 SDPA of the bf16 inputs, and a choice of
    `recipe` with the default kernel. Returns the list of calls made."""
    import importlib

    za = importlib.import_module("zyfa_tune.attention")  # the package exports a function of that name
    from zyfa_tune.generator.defaults import default_config
    from zyfa_tune.kernels.dispatch import Choice

    calls = []

    def attention(q, k, v, causal=True):
        calls.append(q)
        q, k, v = (t.double().transpose(1, 2) for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        return out.transpose(1, 2).to(torch.bfloat16)

    def explain(q, k, v, causal=True):
        kernel = Choice(default_config("fp8", q.shape[3], v.shape[3]), "default", None)
        return za.AttentionChoice(recipe, kernel, "fake")

    monkeypatch.setattr(za, "attention", attention)
    monkeypatch.setattr(za, "explain_attention", explain)
    return calls


def by_result(calls, warmup, reps):
    """A timer by what the call returns: the copy 0.5 ms, a quantiser 0.8 ms, attention 2 ms."""
    out = calls[0]()
    ms = 0.5 if isinstance(out, torch.Tensor) and out.dtype == torch.uint8 else 0.8 if isinstance(out, tuple) else 2.0
    return dataclasses.replace(fake_timer(calls, warmup, reps), median_ms=ms)


def test_end_to_end_rows_with_the_floor_on_cpu(monkeypatch):
    """ours-attention is timed on the bf16 inputs, checked against float64 on the unquantised ones and
    names its recipe and kernel; the quantisers and the copy share the rounds, get GB/s and time /
    floor and no TFLOP/s, error or energy window."""
    calls = fake_attention(monkeypatch, Recipe(v_layout="k_major"))
    windows = []

    def energy(fns, seconds, call_ms):
        windows.append(call_ms)
        from zyfa_tune.tuning.timing import Energy

        return Energy(calls=10, seconds=seconds, joules=5.0, sm_clock_mhz=1500.0)

    shape = GQA_192
    systems = systems_for(shape, [], ("ours-attention",), quant_floor=True)
    seen = []
    rows = measure_shape(
        shape,
        systems,
        seed=0,
        reps=5,
        rounds=2,
        device="cpu",
        timer=by_result,
        quant="end-to-end",
        energy_s=1.0,
        energy=energy,
        on_row=seen.append,
    )
    assert seen == rows and all(r.error is None for r in rows), [r.error for r in rows]
    attention, *quants, copy = rows
    assert len(calls) >= 3 and all(q.dtype == torch.bfloat16 for q in calls)  # the whole call, bf16 in
    assert (attention.system, attention.kind, attention.recipe, attention.source) == (
        "ours-attention",
        "ours",
        "v_layout=k_major",
        "default",
    )
    assert 1e-5 < attention.rel_l2 < 1e-2  # bf16 inputs against float64 on the float32 originals
    assert attention.tflops == pytest.approx(shape.flops / 2e-3 / 1e12) and attention.tflop_per_j
    assert windows == [2.0]  # the energy window ran for the attention row alone
    assert [q.system for q in quants] == [*FLOOR_NAMES, "quant:ours-attention"]
    assert [q.recipe for q in quants] == [r.summary() for r in FLOOR_RECIPES] + ["v_layout=k_major"]
    moved = traffic_bytes(shape)
    for q in quants:
        assert (q.tflops, q.rel_l2, q.tflop_per_j, q.bytes_moved) == (None, None, None, moved)
        assert q.gbps == pytest.approx(moved / 0.8e-3 / 1e9)
        assert q.floor_ms == pytest.approx(0.5 * moved / copy.bytes_moved)
        assert q.floor_ratio == pytest.approx(1.6, rel=1e-6)
    assert copy.bytes_moved == moved and copy.floor_ratio == pytest.approx(1.0)
    assert "x floor" in bench_report.row_line(quants[0]) and "GB/s" in bench_report.row_line(copy)


def test_attention_outside_end_to_end_and_a_failing_quantiser_are_rows_with_errors():
    def broken(x: Inputs) -> Bound:
        raise RuntimeError("codes buffer: out of memory")

    shape = MHA_128
    systems = [PEERS["ours-attention"], Quantiser("quant:plain"), System("quant:x", "quantiser", "fp8", broken)]
    rows = measure_shape(shape, [*systems, Copy()], seed=0, reps=5, device="cpu", timer=by_result, quant="native")
    attention, plain, failed, copy = rows
    assert "end-to-end" in attention.error and attention.kind == "ours"
    assert plain.error is None and plain.floor_ratio == pytest.approx(1.6, rel=1e-3)
    assert failed.error.startswith("RuntimeError") and failed.floor_ratio is None
    table = bench_report.floor_table(dataclasses.replace(sample_result(), rows=tuple(rows)))
    assert [c.header for c in table.columns][-2:] == ["x floor", "SM MHz"]


# ---- results and the table ---------------------------------------------------------------------


def floor_result() -> BenchResult:
    """sample_result with an attention() row and the floor rows of its first shape."""
    base = sample_result()
    first = base.rows[0]
    from zyfa_tune.generator.defaults import default_config

    config = default_config("fp8", 128, 128).to_json()
    attention = dataclasses.replace(
        first, system="ours-attention", tflops=560.0, recipe="hadamard smooth_k", source="exact", config=config
    )
    moved = traffic_bytes(BenchShape(head_dim_qk=128, head_dim_v=128, batch=1, seqlen=4096, heads=32, kv_heads=32))
    traffic = [
        traffic_row("quant:plain", "quantiser", 0.30, moved, recipe="plain"),
        traffic_row("quant:hadamard+smooth_k", "quantiser", 0.45, moved, recipe="hadamard smooth_k"),
        traffic_row("copy", "copy", 0.25, moved),
    ]
    traffic = [dataclasses.replace(r, shape=first.shape, s=4096, h=32, hk=32) for r in with_floor(traffic)]
    return dataclasses.replace(base, rows=(attention, *base.rows, *traffic), settings={"quant_floor": True})


def test_tables_show_attention_against_fa3_and_the_quantisers_against_the_floor():
    from rich.console import Console

    console = Console(width=300, record=True)
    result = floor_result()
    console.print(bench_report.results_table(result))
    main = console.export_text()
    assert "0.80x" in main and "recipe hadamard smooth_k; exact" in main  # 560 vs FA3's 700
    assert "quant:plain" not in main and "floor" not in main
    console.print(bench_report.floor_table(result))
    floor = console.export_text()
    assert "1.20x" in floor and "1.80x" in floor and "1.00x" in floor  # 0.30, 0.45 and 0.25 ms over 0.25
    assert "at most 1.5x" in floor and f"{result.rows[-1].bytes_moved / 1e6:.1f}" in floor
    assert bench_report.floor_table(sample_result()) is None


def test_json_round_trip_with_the_new_rows_and_old_runs_load(tmp_path):
    result = floor_result()
    result.save(tmp_path / "new.json")
    loaded = BenchResult.load(tmp_path / "new.json")
    assert loaded == result and loaded.rows[-1].floor_ratio == pytest.approx(1.0)
    first = BenchResult.load(write_first_format(tmp_path / "first.json"))
    assert all(r.recipe is None and r.bytes_moved is None and r.floor_ratio is None for r in first.rows)
    assert bench_report.floor_table(first) is None
    assert len(bench_report._panels(result.rows)) == 1  # the plot draws TFLOP/s rows only


# ---- GPU ---------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_end_to_end_and_floor_on_gpu(tmp_path):
    """attention() beside FA3-fp8 end to end, and the quantisers against the copy, at two small shapes
    (one GQA at 192/128); FA3 may be missing (its row then has an error, not ours)."""
    out = tmp_path / "e2e.json"
    argv = ["bench", "--shape", "128,128,1,2048,8", "--shape", "192,128,1,2048,16,4", "--quant", "end-to-end"]
    argv += ["--quant-floor", "--peers", "fa3-fp8", "--reps", "5", "--rounds", "2", "--warm", "0.2", "--json", str(out)]
    assert cli.main(argv) == 0
    res = BenchResult.load(out)
    for shape in {r.shape for r in res.rows}:
        rows = {r.system: r for r in res.rows if r.shape == shape}
        ours = rows["ours-attention"]
        assert ours.error is None and ours.tflops > 0 and ours.rel_l2 < 5e-2 and ours.recipe and ours.config
        names = [*FLOOR_NAMES, "quant:ours-attention", "copy"]
        assert all(rows[n].error is None for n in names), [rows[n].error for n in names]
        copy = rows["copy"]
        assert 100 < copy.gbps < 20_000 and copy.floor_ratio == pytest.approx(1.0)
        for n in names[:-1]:
            assert rows[n].bytes_moved == copy.bytes_moved
            assert rows[n].floor_ratio > 0.3 and rows[n].gbps > 0
    assert res.settings["quant_floor"] is True


# ---- packed sequences (--lengths) --------------------------------------------------------------

PACKED = BenchShape.packed((5, 1, 40, 18), 4, 2, head_dim_qk=128, head_dim_v=64)


def test_packed_floor_rows_time_quantize_fp8_varlen_against_the_same_floor():
    """--quant-floor with --lengths: the packed quantiser (quantize_fp8_varlen) and the copy, whose bytes
    are what the packed quantiser reads and writes (every sequence's tokens, descales per sequence)."""
    from zyfa_tune import quantize_fp8_varlen

    systems = systems_for(PACKED, [], (), quant_floor=True)
    assert [(s.name, s.kind) for s in systems] == [("quant:varlen", "quantiser"), ("copy", "copy")]
    x = Inputs.random(PACKED, seed=0, device="cpu", quant="per-tensor")
    cu, _ = x.packed_bounds()
    packed = (x.q16[0], x.k16[0], x.v16[0])
    read = sum(t.numel() * t.element_size() for t in packed)
    written = sum(t.numel() * t.element_size() for t in quantize_fp8_varlen(*packed, cu, cu))
    assert traffic_bytes(PACKED) == read + written
    rows = measure_shape(PACKED, systems, seed=0, reps=5, device="cpu", timer=by_result, quant="per-tensor")
    quant, copy = rows
    assert quant.error is None and (quant.recipe, quant.bytes_moved) == ("plain", read + written)
    assert copy.bytes_moved == read + written and quant.floor_ratio == pytest.approx(1.6, rel=1e-3)
    assert not Quantiser("quant:plain").supports(PACKED) and not systems[0].supports(MHA_128)
