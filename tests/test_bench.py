"""`zyfa-tune bench` on the CPU: argument parsing, the measuring loop with a CPU system and a fake
timer, JSON round trip (including the old benchmarks/peers.py JSON), the table, the plot from
saved JSON, and the clear errors without a GPU or without matplotlib. One GPU test runs the real
thing."""

from __future__ import annotations

import dataclasses

import json
import sys
from pathlib import Path

import pytest
import torch

from zyfa_tune import cli
from zyfa_tune.bench import run as bench
from zyfa_tune.bench import report as bench_report
from zyfa_tune.generator import ConfigError
from zyfa_tune.tuning.timing import Timing

OLD_JSON = Path(__file__).resolve().parents[1] / "docs" / "results" / "2026-11-30-peers-defaults.json"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def fake_timer(calls, warmup, reps):
    """Runs every call once (round-robin is the real timer's job) and reports 2 ms."""
    fake_timer.calls = len(calls)
    fake_timer.blocks = getattr(fake_timer, "blocks", 0) + 1
    for c in calls:
        c()
    return Timing(median_ms=2.0, p20_ms=1.9, p80_ms=2.1, min_ms=1.8, reps=reps, sm_clock_mhz=1755.0, power_w=500.0,
                  energy_j_per_call=1.0)


def dequantised_sdpa(x: bench.Inputs) -> bench.Bound:
    """An 'fp8 system' for the CPU: SDPA on the e4m3 inputs times their scales."""
    args, kw = x.args("fp8")
    q, k, v = (a.float() * x.scales[i] for i, a in enumerate(args))
    assert all(torch.all(kw[f"{n}_descale"] == float(kw[f"{n}_descale"][0, 0])) for n in "qkv")
    return bench.Bound(*bench._boxed(lambda: torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
        enable_gqa=q.shape[2] != k.shape[2]).transpose(1, 2)))


def broken(x: bench.Inputs) -> bench.Bound:
    raise ImportError("no module named fa3_fwd_interface")


def sample_result(rows=None) -> bench.BenchResult:
    def row(system, kind, s, tflops, dtype="fp8", **kw):
        return bench.BenchRow(shape=f"128/128 B=1 S={s} H=32", system=system, kind=kind, dtype=dtype, dqk=128,
                              dv=128, b=1, s=s, h=32, hk=32, tflops=tflops, median_ms=1.0, rel_l2=0.02, **kw)
    rows = rows or [r for s, f in ((4096, 1.0), (8192, 1.2), (16384, 1.3)) for r in (
        row("ours-fp8", "ours", s, 500 * f, config=None, source="exact"),
        row("lean", "forced", s, 480 * f),
        row("fa3-fp8", "peer", s, 700 * f),
        row("cudnn-fp8", "peer", s, 0, error="ImportError: no cudnn"))]
    return bench.BenchResult(date="2026-12-01T10:00:00+00:00", gpu={"name": "NVIDIA H200"}, gpu_after={},
                             environment={}, settings={}, rows=tuple(rows))


# ---- parsing -----------------------------------------------------------------------------------

def test_shapes_from_flags():
    shapes = bench.shapes_from(128, None, "4096,8192,16384")
    assert [(s.batch, s.seqlen, s.heads, s.kv_heads) for s in shapes] == [(4, 4096, 32, 32), (2, 8192, 32, 32),
                                                                         (1, 16384, 32, 32)]
    one = bench.shapes_from(192, 128, "1024,2048", "2x16", kv_heads=4)
    assert [(s.head_dim_v, s.batch, s.heads, s.kv_heads) for s in one] == [(128, 2, 16, 4)] * 2
    per = bench.shapes_from(64, None, "1024,2048", "3x8,1x8")
    assert [s.batch for s in per] == [3, 1]
    with pytest.raises(ValueError, match="--batch-heads"):
        bench.shapes_from(128, None, "1024,2048,4096", "1x8,1x8")
    with pytest.raises(ValueError, match="--seqlens"):
        bench.shapes_from(128, None, "4k")
    with pytest.raises(ValueError, match="head_dim_qk"):
        bench.shapes_from(80, None, "1024")
    with pytest.raises(ValueError, match="kv_heads"):
        bench.shapes_from(128, None, "1024", "1x8", kv_heads=3)


def test_parse_shape_and_peers():
    assert bench.parse_shape("192,128,2,8192,16") == bench.BenchShape(head_dim_qk=192, head_dim_v=128, batch=2,
                                                                 seqlen=8192, heads=16, kv_heads=16)
    assert bench.parse_shape("128,128,1,4096,32,8").kv_heads == 8
    assert bench.parse_shape("128,128,1,4096,32").label == "128/128 B=1 S=4096 H=32"
    with pytest.raises(ValueError, match="--shape"):
        bench.parse_shape("128,128,4096")
    assert bench.parse_peers(None, ["fp8"]) == ("fa3-fp8", "cudnn-fp8")
    assert set(bench.parse_peers(None, ["bf16"])) == {"fa3-bf16", "sdpa-cudnn-bf16", "sdpa-flash-bf16"}
    assert bench.parse_peers("none", ["fp8"]) == ()
    with pytest.raises(ValueError, match="--peers.*fa4"):
        bench.parse_peers("fa3-fp8,fa4", ["fp8"])


def test_parse_ours_labels_and_dtypes():
    (lean,) = bench.parse_ours("lean:softmax=lean,rowsum=rounded", ["fp8"])
    assert (lean.label, lean.dtype, lean.overrides) == ("lean", "fp8", (("softmax", "lean"), ("rowsum", "rounded")))
    cfg = lean.config_for(128, 128)
    assert (cfg.softmax, cfg.rowsum, cfg.head_dim_qk) == ("lean", "rounded", 128)
    both = bench.parse_ours("fwd:q_order=forward", ["fp8", "bf16"])
    assert [(o.label, o.dtype) for o in both] == [("fwd-fp8", "fp8"), ("fwd-bf16", "bf16")]
    (named,) = bench.parse_ours("block_m=128,dtype=bf16", ["fp8", "bf16"])
    assert (named.label, named.dtype, dict(named.overrides)) == ("ours-block_m=128", "bf16", {"block_m": 128})
    assert bench.OursSpec("ours-fp8", "fp8").config_for(128, 128) is None  # the dispatcher chooses
    with pytest.raises(ValueError, match="--ours"):
        bench.parse_ours("lean:softmax", ["fp8"])
    with pytest.raises(ValueError, match="dtype"):
        bench.parse_ours("dtype=fp16", ["fp8"])


def test_plan_rejects_bad_forced_configs_before_measuring():
    shapes = bench.shapes_from(128, None, "1024")
    with pytest.raises(ConfigError, match="--ours bad"):
        bench.BenchPlan(shapes=shapes, ours=tuple(bench.parse_ours("bad:block_m=7", ["fp8"])), peers=())
    with pytest.raises(ValueError, match="reps"):
        bench.BenchPlan(shapes=shapes, ours=(), peers=(), reps=2)
    with pytest.raises(ValueError, match="peers"):
        bench.BenchPlan(shapes=shapes, ours=(), peers=("fa2",))


# ---- measuring on the CPU ----------------------------------------------------------------------

def test_measure_shape_on_cpu_rows_errors_and_flops():
    shape = bench.BenchShape(head_dim_qk=64, head_dim_v=64, batch=1, seqlen=256, heads=4, kv_heads=2)
    systems = [bench.System("sdpa-math-bf16", "peer", "bf16", bench._sdpa("MATH")),
               bench.System("dequant-fp8", "peer", "fp8", dequantised_sdpa),
               bench.System("missing", "peer", "fp8", broken),
               bench.ours_system(bench.OursSpec("ours-bf16", "bf16"), shape)]  # CUDA only: fails cleanly
    seen = []
    rows = bench.measure_shape(shape, systems, seed=0, reps=5, rotate=2, device="cpu", timer=fake_timer,
                               on_row=seen.append)
    assert seen == rows and [r.system for r in rows] == ["sdpa-math-bf16", "dequant-fp8", "missing", "ours-bf16"]
    sdpa, fp8, missing, ours = rows
    assert fake_timer.calls == 2  # both input sets timed
    assert 1e-4 < sdpa.rel_l2 < 1e-2 and sdpa.max_err > 0  # bf16 output vs float64
    assert fp8.rel_l2 < 1e-5  # the fp8 reference is on exactly the dequantised e4m3 inputs
    assert sdpa.tflops == pytest.approx(shape.flops / 2e-3 / 1e12)
    assert shape.flops == 2 * 1 * 4 * 256 * 256 * 128 / 2
    assert sdpa.tflop_per_j == pytest.approx(shape.flops / 1e12) and sdpa.sm_clock_mhz == 1755.0
    assert (sdpa.shape, sdpa.hk, sdpa.kind, sdpa.dtype) == ("64/64 B=1 S=256 H=4/2", 2, "peer", "bf16")
    assert missing.error.startswith("ImportError") and missing.tflops is None
    assert ours.error and "cuda" in ours.error.lower() and ours.kind == "ours"


def test_inputs_share_one_quantisation():
    x = bench.Inputs.random(bench.BenchShape(head_dim_qk=64, head_dim_v=64, batch=2, seqlen=128, heads=4, kv_heads=4),
                            seed=3, device="cpu")
    _, kw = x.args("fp8")
    assert set(kw) == {"q_descale", "k_descale", "v_descale"}
    assert kw["q_descale"].shape == (2, 4) and float(kw["q_descale"][0, 0]) == pytest.approx(x.scales[0])
    assert float(x.q8.float().abs().max()) == 448.0  # per-tensor scale uses the whole e4m3 range
    again = bench.Inputs.random(x.shape, seed=3, device="cpu")
    assert torch.equal(x.q16, again.q16) and not torch.equal(x.q16, bench.Inputs.random(x.shape, 4, "cpu").q16)


def test_native_quantisation_and_input_families():
    """--quant native: FP8 inputs are quantize_fp8 of the float32 originals, per option set (made
    once), and the reference is float64 attention on those originals; families change the inputs."""
    from zyfa_tune import quantize_fp8
    from zyfa_tune.tuning.reference import attention_reference

    shape = bench.BenchShape(head_dim_qk=64, head_dim_v=64, batch=1, seqlen=64, heads=4, kv_heads=2)
    x = bench.Inputs.random(shape, seed=1, device="cpu", family="outliers", quant="native")
    plain = x.args("fp8")
    assert plain is x.args("fp8")  # quantised once
    ref_args = quantize_fp8(*x.raw)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(plain[0], ref_args[:3]))
    smooth = x.args("fp8", (("smooth_k", True),))
    assert not torch.equal(smooth[0][1].view(torch.uint8), plain[0][1].view(torch.uint8))
    k_major = x.args("fp8", (("k_major_v", True),))  # the same codes, V stored keys-fastest
    assert k_major[0][2].stride(1) == 1 and plain[0][2].stride(3) == 1
    assert torch.equal(k_major[0][2].contiguous().view(torch.uint8), plain[0][2].view(torch.uint8))
    balanced = x.args("fp8", (("balanced_v", True),))  # V rounded as quantize_fp8(v_rounding="balanced")
    want = quantize_fp8(*x.raw, v_rounding="balanced")[2]
    assert torch.equal(balanced[0][2].view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(balanced[0][0].view(torch.uint8), plain[0][0].view(torch.uint8))
    kappa0 = x.args("fp8", (("balanced_v", True), ("v_weight", 0.0)))[0][2]   # --ours ...,v_weight=0
    assert torch.equal(kappa0.view(torch.uint8), quantize_fp8(*x.raw, v_rounding="balanced", v_weight=0.0)[2].view(torch.uint8))
    assert not torch.equal(kappa0.view(torch.uint8), balanced[0][2].view(torch.uint8))   # the estimated kappa's differ
    assert torch.equal(x.reference("fp8"), attention_reference(*x.raw, causal=True))
    assert torch.equal(x.reference("bf16"), x.reference("fp8"))
    gauss = bench.Inputs.random(shape, seed=1, device="cpu")
    assert gauss.raw is None and not torch.equal(gauss.q16, x.q16)


def test_end_to_end_mode_quantises_inside_each_call(monkeypatch):
    """--quant end-to-end: an FP8 system's call quantises the bf16 inputs itself, every call (so its timing
    counts the quantiser), with the system's options (FA3: none); bf16 systems get the bf16 tensors; the error
    reference is float64 attention on the unquantised originals, as in native mode."""
    import zyfa_tune.quantize as zq
    from zyfa_tune.tuning.reference import attention_reference

    shape = bench.BenchShape(head_dim_qk=64, head_dim_v=64, batch=1, seqlen=48, heads=4, kv_heads=2)
    x = bench.Inputs.random(shape, seed=2, device="cpu", family="sink", quant="end-to-end")
    calls = []
    real = zq.quantize_fp8
    monkeypatch.setattr(zq, "quantize_fp8", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    seen = []
    run = x.call("fp8", (("balanced_v", True),), lambda *a, **kw: seen.append((a, kw)))
    assert calls == []          # nothing quantised until the call
    run()
    run()
    assert len(calls) == 2 and calls[0]["v_rounding"] == "balanced"
    want = real(x.q16, x.k16, x.v16, v_rounding="balanced")
    (q8, k8, v8), kw = seen[-1]
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip((q8, k8, v8), want[:3]))
    assert torch.equal(kw["v_descale"], want[5])
    x.call("fp8", (), lambda *a, **kw: None)()
    assert calls[-1]["v_rounding"] == "nearest" and calls[-1]["v_layout"] == "natural"
    x.call("bf16", (), lambda *a, **kw: seen.append((a, kw)))()
    assert seen[-1][0][0] is x.q16 and len(calls) == 3
    assert torch.equal(x.reference("fp8"), attention_reference(*x.raw, causal=True))
    shapes = (shape,)
    bench.BenchPlan(shapes=shapes, ours=bench.parse_ours("b:balanced_v=true", ["fp8"]), peers=("fa3-fp8",),
                    quant="end-to-end")
    with pytest.raises(ValueError, match="cudnn-fp8"):
        bench.BenchPlan(shapes=shapes, ours=(), peers=("cudnn-fp8",), quant="end-to-end")


def test_quantisation_options_parse_and_need_native_mode():
    (smooth,) = bench.parse_ours("sk:smooth_k=true", ["fp8"])
    assert smooth.overrides is None and smooth.quant == (("smooth_k", True),)  # the dispatcher's kernel
    (bal,) = bench.parse_ours("b:balanced_v=true,k_major_v=true", ["fp8"])
    assert dict(bal.quant) == {"balanced_v": True, "k_major_v": True}
    (kappa,) = bench.parse_ours("b:balanced_v=true,v_weight=0", ["fp8"])   # kappa 0: session 44-47's balanced V
    assert dict(kappa.quant) == {"balanced_v": True, "v_weight": 0.0}
    for bad, match in (("v_weight=1", "add balanced_v=true"), ("balanced_v=true,v_weight=-2", "a number >= 0"),
                       ("balanced_v=true,v_weight=nan", "a number >= 0"), ("balanced_v=true,v_weight=yes", "a number")):
        with pytest.raises(ValueError, match=match):
            bench.parse_ours(bad, ["fp8"])
    (both,) = bench.parse_ours("dtype=fp8,num_stages=2,hadamard=true", ["fp8", "bf16"])
    assert dict(both.overrides) == {"num_stages": 2} and both.quant == (("hadamard", True),)
    with pytest.raises(ValueError, match="dtype=fp8"):
        bench.parse_ours("smooth_k=true", ["fp8", "bf16"])
    with pytest.raises(ValueError, match="true or false"):
        bench.parse_ours("smooth_k=2", ["fp8"])
    shape = (bench.BenchShape(head_dim_qk=128, head_dim_v=128, batch=1, seqlen=1024, heads=8, kv_heads=8),)
    with pytest.raises(ValueError, match="--quant native or end-to-end"):
        bench.BenchPlan(shapes=shape, ours=(smooth,), peers=())
    bench.BenchPlan(shapes=shape, ours=(smooth,), peers=(), quant="native", input_family="llm")
    with pytest.raises(ValueError, match="quant"):
        bench.BenchPlan(shapes=shape, ours=(), peers=(), quant="per-head")
    with pytest.raises(ValueError, match="input_family"):
        bench.BenchPlan(shapes=shape, ours=(), peers=(), input_family="weird")


# ---- results, table, plot ----------------------------------------------------------------------

def test_json_round_trip(tmp_path):
    res = sample_result()
    res.save(tmp_path / "r.json")
    assert bench.BenchResult.load(tmp_path / "r.json") == res


def test_old_peers_json_loads():
    res = bench.BenchResult.load(OLD_JSON)
    first = res.rows[0]
    assert (first.system, first.kind, first.dtype, first.hk) == ("ours-fp8", "ours", "fp8", 32)
    assert {r.dtype for r in res.rows if r.system.startswith("sdpa")} == {"bf16"}
    assert res.gpu["name"] == "NVIDIA H200"


def test_load_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"date": "x"}')
    with pytest.raises(ValueError, match="--from.*rows"):
        bench.BenchResult.load(bad)
    with pytest.raises(ValueError, match="--from"):
        bench.BenchResult.load(tmp_path / "missing.json")


def test_table_ratios_to_the_best_peer():
    from rich.console import Console

    console = Console(width=250, record=True)
    console.print(bench_report.results_table(sample_result()))
    text = console.export_text()
    assert "0.71x" in text  # ours 500 vs FA3 700
    assert "ImportError: no cudnn" in text
    assert bench_report.best_peer(sample_result().rows)[("128/128 B=1 S=4096 H=32", "fp8", None)] == 700


def test_a_borrowed_kernel_says_whose_in_the_row_and_the_table(tmp_path):
    """A row whose dispatcher kernel was tuned for another problem class (nearest) or GPU says which,
    in the JSON and in the kernel column; the shape's own entry adds nothing."""
    from rich.console import Console

    from zyfa_tune.db import ProblemKey
    from zyfa_tune.generator.defaults import default_config
    from zyfa_tune.kernels.dispatch import Choice

    def key(s, bh, gqa=1):
        return ProblemKey(dtype="fp8", head_dim_qk=192, head_dim_v=128, causal=True, gqa_group=gqa,
                          seqlen_bucket=s, bh_bucket=bh)
    cfg = default_config("fp8", 192, 128, "gluon")
    own = key(32768, 16)
    assert bench.borrowed_from(Choice(cfg, "exact", own, tuned_key=own)) is None
    assert bench.borrowed_from(Choice(cfg, "default", own)) is None
    near = bench.borrowed_from(Choice(cfg, "nearest", own, tuned_key=key(16384, 16)))
    assert near == "tuned at seqlen<=16384 B*H<=16"
    other = Choice(cfg, "other-device", own, tuned_key=key(32768, 16, gqa=2), tuned_on="NVIDIA H100 80GB HBM3")
    assert bench.borrowed_from(other) == "tuned at seqlen<=32768 B*H<=16 gqa=2 on NVIDIA H100 80GB HBM3"
    row = bench.BenchRow(shape="192/128 B=1 S=32768 H=16", system="ours-fp8", kind="ours", dtype="fp8", dqk=192,
                         dv=128, b=1, s=32768, h=16, hk=16, tflops=1023.2, median_ms=5.4, rel_l2=0.02,
                         config=cfg.to_json(), source="nearest", entry=near)
    res = bench.BenchResult(date="2026-12-02T10:00:00+00:00", gpu={"name": "NVIDIA H200"}, gpu_after={},
                            environment={}, settings={}, rows=(row,))
    res.save(tmp_path / "r.json")
    assert bench.BenchResult.load(tmp_path / "r.json").rows[0].entry == near
    console = Console(width=300, record=True)
    console.print(bench_report.results_table(res))
    assert "nearest (tuned at seqlen<=16384 B*H<=16)" in console.export_text()


def test_several_input_families_in_one_run(tmp_path):
    """--input-family a,b measures every shape on each family; rows carry their family, each family's
    rows are compared with that family's peers, the plot gets a panel per family, and the saved
    JSON keeps it all."""
    from rich.console import Console

    shape = bench.BenchShape(head_dim_qk=64, head_dim_v=64, batch=1, seqlen=128, heads=2, kv_heads=2)
    plan = bench.BenchPlan(shapes=(shape,), ours=(), peers=(), input_family="gaussian,outliers")
    assert plan.families == ("gaussian", "outliers")
    for bad in ("gaussian,gaussian", "gaussian,weird", ""):
        with pytest.raises(ValueError, match="input_family"):
            bench.BenchPlan(shapes=(shape,), ours=(), peers=(), input_family=bad)
    systems = [bench.System("sdpa-math-bf16", "peer", "bf16", bench._sdpa("MATH"))]
    rows = [r for fam in plan.families
            for r in bench.measure_shape(shape, systems, seed=0, reps=5, device="cpu", timer=fake_timer,
                                         input_family=fam)]
    assert [r.family for r in rows] == ["gaussian", "outliers"]
    assert rows[0].rel_l2 != rows[1].rel_l2  # different inputs
    slow = dataclasses.replace(rows[1], system="ours-bf16", kind="ours", tflops=rows[1].tflops / 2)
    result = bench.BenchResult(date="2026-12-01T10:00:00+00:00", gpu={"name": "NVIDIA H200"}, gpu_after={},
                               environment={}, settings={"input_family": plan.input_family}, rows=(*rows, slow))
    assert set(bench_report.best_peer(result.rows)) == {(shape.label, "bf16", "gaussian"), (shape.label, "bf16", "outliers")}
    console = Console(width=250, record=True)
    console.print(bench_report.results_table(result))
    text = console.export_text()
    assert "gaussian, outliers inputs" in text and f"{shape.label} · outliers" in text and "0.50x" in text
    assert "outliers" in bench_report.row_line(rows[1])
    path = tmp_path / "fam.json"
    result.save(path)
    assert bench.BenchResult.load(path).rows == result.rows
    assert len(bench_report._panels(result.rows)) == 2


def test_plot_from_saved_json_via_cli(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    saved, png = tmp_path / "r.json", tmp_path / "r.png"
    sample_result().save(saved)
    assert cli.main(["bench", "--from", str(saved), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 10_000
    assert "fa3-fp8" in capsys.readouterr().out
    many = tmp_path / "old.png"  # several panels (head dims) from the old peers.py JSON
    assert cli.main(["bench", "--from", str(OLD_JSON), "--plot", str(many)]) == 0
    assert many.read_bytes()[:8] == PNG_MAGIC


def test_plot_lines_per_system_and_batch():
    rows = sample_result().rows
    panels = bench_report._panels(rows)
    assert list(panels) == [(128, 128, 32, 32, "")]  # (dims, heads, input family: none saved)
    lines = bench_report._lines(panels[(128, 128, 32, 32, "")])
    assert list(lines) == ["ours-fp8", "lean", "fa3-fp8"]  # ours first; the failed peer has no line
    assert [p.s for p in lines["ours-fp8"]] == [4096, 8192, 16384]
    extra = [*rows, bench.BenchRow(shape="128/128 B=2 S=4096 H=32", system="fa3-fp8", kind="peer", dtype="fp8",
                                   dqk=128, dv=128, b=2, s=4096, h=32, hk=32, tflops=800.0)]
    assert "fa3-fp8 B=2" in bench_report._lines(bench_report._panels(extra)[(128, 128, 32, 32, "")])
    assert "NVIDIA H200 · fp8 · hd · causal · 2026-12-01" == bench_report._title(sample_result(), "hd")


def test_plot_without_matplotlib_says_what_to_install(tmp_path, monkeypatch, capsys):
    saved, png = tmp_path / "r.json", tmp_path / "r.png"
    sample_result().save(saved)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    assert cli.main(["bench", "--from", str(saved), "--plot", str(png)]) == 2
    assert "zyfa-tune[plot]" in capsys.readouterr().out
    assert not png.exists()
    with pytest.raises(RuntimeError, match="pip install"):
        bench_report.plot(sample_result(), png)


def test_bench_without_gpu_exits_with_a_message(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["bench", "--head-dim", "128", "--seqlens", "4096"]) == 2
    out = capsys.readouterr().out
    assert "no CUDA device" in out and "--from" in out and "Traceback" not in out
    with pytest.raises(RuntimeError, match="no CUDA device"):
        bench.run(bench.BenchPlan(shapes=bench.shapes_from(128, None, "1024"), ours=(), peers=()))


@pytest.mark.parametrize("argv,systems", [
    ([], ["ours-fp8"]),
    (["--no-dispatch", "--ours", "w:backend=gluon,block_n=256"], ["w"]),
    (["--no-dispatch", "--peers", "fa3-fp8"], []),
])
def test_bench_plan_has_the_dispatcher_pick_unless_no_dispatch(monkeypatch, argv, systems):
    """What `zyfa-tune bench` would measure (its plan, caught before measuring): --no-dispatch leaves
    flash_attn_func's own pick out, so that one system can run alone (under ncu)."""
    plans = []

    def fake_run(plan, on_row=None):
        plans.append(plan)
        return sample_result()

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "run", fake_run)
    cli.main(["bench", "--seqlens", "4096", "--peers", "none", *argv])
    (plan,) = plans
    assert [o.label for o in plan.ours] == systems


def test_bench_bad_arguments_exit_2(tmp_path, capsys):
    assert cli.main(["bench", "--from", str(tmp_path / "none.json")]) == 2
    assert "--from" in capsys.readouterr().out


# ---- GPU ---------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_bench_on_gpu(tmp_path, dtype):
    out = tmp_path / "r.json"
    peers = "sdpa-flash-bf16" if dtype == "bf16" else "none"
    rc = cli.main(["bench", "--dtype", dtype, "--head-dim", "128", "--seqlens", "1024,2048", "--batch-heads", "1x8",
                   "--peers", peers, "--ours", "fwd:q_order=forward", "--reps", "5", "--warm", "0.2",
                   "--json", str(out), *(["--energy-s", "1", "--ceiling"] if dtype == "fp8" else [])])
    assert rc == 0
    res = bench.BenchResult.load(out)
    ours = [r for r in res.rows if r.kind != "peer"]
    assert len(ours) == 4 and all(r.error is None for r in ours)
    for r in ours:
        assert r.tflops > 0 and r.rel_l2 < (5e-2 if dtype == "fp8" else 1e-2) and r.config
    assert {r.source for r in ours if r.kind == "ours"} <= {"exact", "nearest", "other-device", "default"}
    assert {r.source for r in ours if r.kind == "forced"} == {"forced"}
    assert res.environment.get("gpu_name") and json.loads(out.read_text())["settings"]["reps"] == 5
    if dtype == "fp8":  # the FP8 GEMM ceiling and an energy window per system (where NVML has a counter)
        assert 300 < res.ceiling["tflops"] < 3000 and res.ceiling["m"] == bench.CEILING_N
        from zyfa_tune.tuning.timing import _energy_mj, _nvml_handle

        if _energy_mj(*_nvml_handle(0)) is not None:
            assert all(r.tflop_per_j and 50 < r.power_w < 1500 for r in ours)


def test_rounds_interleave_systems_in_rotated_order_and_pool_their_samples():
    """Timing rounds: every system is timed once per round, each round starting one system later,
    and a row's median is over all its rounds' calls (a drifting clock hits every system alike)."""
    shape = bench.BenchShape(head_dim_qk=64, head_dim_v=64, batch=1, seqlen=64, heads=2, kv_heads=2)
    order: list[str] = []

    def system(name: str, ms: float) -> bench.System:
        def bind(x: bench.Inputs) -> bench.Bound:
            bound = bench._sdpa("MATH")(x)
            return bench.Bound(lambda: (order.append(name), bound.call()), bound.output)
        return bench.System(name, "peer", "bf16", bind)

    def timer(calls, warmup, reps):
        order.clear()
        calls[0]()
        name = order[0]
        timer.seen.append(name)
        base = {"a": 1.0, "b": 2.0, "c": 3.0}[name] + len(timer.seen) * 0.01  # slower each block
        return Timing(median_ms=base, p20_ms=base, p80_ms=base, min_ms=base, reps=reps, samples_ms=(base,) * reps)
    timer.seen = []

    rows = bench.measure_shape(shape, [system(n, 0) for n in "abc"], seed=0, reps=30, rounds=3, device="cpu",
                               timer=timer)
    assert timer.seen == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert [r.reps for r in rows] == [30, 30, 30]
    assert rows[0].median_ms == pytest.approx(1.0 + 0.06)  # its blocks are the 1st, 6th and 8th: the median is the 6th's
    assert rows[0].min_ms == pytest.approx(1.01) and rows[2].median_ms == pytest.approx(3.05)


def test_pooled_timing():
    from zyfa_tune.tuning.timing import pooled

    a = Timing(median_ms=1.0, p20_ms=1.0, p80_ms=1.0, min_ms=1.0, reps=2, sm_clock_mhz=1800.0, power_w=None,
               energy_j_per_call=2.0, samples_ms=(1.0, 1.0))
    b = Timing(median_ms=3.0, p20_ms=3.0, p80_ms=3.0, min_ms=3.0, reps=6, sm_clock_mhz=1600.0, power_w=500.0,
               energy_j_per_call=None, samples_ms=(2.0, 3.0, 3.0, 3.0, 3.0, 4.0))
    t = pooled([a, b])
    assert t.reps == 8 and t.median_ms == 3.0 and t.min_ms == 1.0 and len(t.samples_ms) == 8
    assert t.sm_clock_mhz == pytest.approx((1800 * 2 + 1600 * 6) / 8)
    assert t.power_w == 500.0 and t.energy_j_per_call == 2.0
    assert pooled([dataclasses.replace(a, samples_ms=()), dataclasses.replace(b, samples_ms=())]).median_ms == 2.0
    with pytest.raises(ValueError):
        pooled([])


# ---- energy windows and the FP8 GEMM ceiling ---------------------------------------------------

class FakeEvent:
    def __init__(self, log):
        self.log, self.done = log, False

    def synchronize(self):
        self.done = True
        self.log.append("sync")


def test_sustain_keeps_batches_queued_until_the_window_ends():
    """`sustain` launches until its window has passed, never waits on the batch just queued (the GPU
    always has the next one) and returns only when every batch is done."""
    clock, log, events = [0.0], [], []

    def now():
        return clock[0]

    def launch():
        clock[0] += 0.25   # each batch's launch + the waits take a quarter second of host time here
        log.append("launch")
        events.append(FakeEvent(log))
        return events[-1]

    from zyfa_tune.tuning.timing import sustain

    batches, elapsed = sustain(launch, 1.0, now=now, depth=2)
    assert batches == 4 and elapsed == pytest.approx(1.0) and all(e.done for e in events)
    assert log[:4] == ["launch"] * 3 + ["sync"]   # the first wait comes once 3 batches are queued
    with pytest.raises(ValueError):
        sustain(launch, 0.0)


def test_energy_window_is_reported_only_when_long_enough():
    from zyfa_tune.tuning import timing

    e = timing._window(1000.0, 3000.0, 2.0, 400)      # 2 J over 2 s, 400 calls
    assert e.joules == pytest.approx(2.0) and e.power_w == pytest.approx(1.0) and e.joules_per_call == pytest.approx(5e-3)
    assert timing._window(1000.0, 1600.0, 0.04, 20) is None            # a 40 ms timing block: noise
    assert timing._window(1000.0, 1000.0, 2.0, 20) is None             # the counter did not move
    assert timing._window(None, 1000.0, 2.0, 20) is None               # no NVML
    with pytest.raises(ValueError, match="1.0 s"):
        timing.sustained_energy([lambda: None], seconds=0.5)


def test_sustained_energy_without_nvml_is_none(monkeypatch):
    from zyfa_tune.tuning import timing

    monkeypatch.setattr(timing, "_nvml_handle", lambda device: (None, None))
    assert timing.sustained_energy([lambda: None], seconds=1.0) is None


def test_energy_windows_give_tflop_per_j_and_power():
    """With energy_s, each system gets one window after its timing; its joules per call make TFLOP/J
    and its mean power the W column; a failing window is that system's error, not the run's."""
    from zyfa_tune.tuning.timing import Energy

    shape = bench.BenchShape(head_dim_qk=64, head_dim_v=64, batch=1, seqlen=128, heads=2, kv_heads=2)
    seen = []

    def energy(calls, seconds, call_ms):
        seen.append((len(calls), seconds, call_ms))
        if len(seen) == 2:
            raise RuntimeError("NVML went away")
        return Energy(calls=1000, seconds=seconds, joules=500.0, sm_clock_mhz=1700.0)

    systems = [bench.System(n, "peer", "bf16", bench._sdpa("MATH")) for n in ("a", "b")]
    a, b = bench.measure_shape(shape, systems, seed=0, reps=5, device="cpu", timer=fake_timer, energy_s=2.0,
                               energy=energy)
    assert seen == [(1, 2.0, 2.0), (1, 2.0, 2.0)]  # the window is told the timed median
    assert a.energy_j_per_call == pytest.approx(0.5) and a.power_w == pytest.approx(250.0)
    assert a.tflop_per_j == pytest.approx(shape.flops / 0.5 / 1e12)
    assert a.sustained_tflops == pytest.approx(shape.flops * 500 / 1e12) and a.sustained_clock_mhz == 1700.0
    assert "sustained" in bench_report.row_line(a) and "sustained" not in bench_report.row_line(b)
    assert b.error == "RuntimeError: NVML went away" and b.tflops is None
    plain = bench.measure_shape(shape, systems[:1], seed=0, reps=5, device="cpu", timer=fake_timer, energy=energy)
    assert len(seen) == 2 and plain[0].power_w == 500.0  # energy_s=0: no window


def test_energy_window_length_is_validated():
    shapes = bench.shapes_from(128, None, "1024")
    for bad in (0.5, -1.0, 61.0):
        with pytest.raises(ValueError, match="energy_s"):
            bench.BenchPlan(shapes=shapes, ours=(), peers=(), energy_s=bad)
    assert bench.BenchPlan(shapes=shapes, ours=(), peers=(), energy_s=2.0).energy_s == 2.0


def test_gemm_ceiling_record_and_table_share():
    """The ceiling is pooled over its blocks (start and end of the run); FP8 rows show their share of
    it, bf16 rows none; it survives the JSON round trip, and a run without one has no such column."""
    from rich.console import Console

    blocks = [Timing(median_ms=1.0, p20_ms=1.0, p80_ms=1.0, min_ms=1.0, reps=5, samples_ms=(1.0,) * 5),
              Timing(median_ms=1.2, p20_ms=1.2, p80_ms=1.2, min_ms=1.2, reps=5, samples_ms=(1.2,) * 5)]
    c = bench.gemm_ceiling(blocks, n=1000)
    assert c["tflops"] == pytest.approx(2e9 / 1.1e-3 / 1e12) and c["m"] == 1000 and c["reps"] == 10
    res = dataclasses.replace(sample_result(), ceiling=dict(c, tflops=1000.0))

    def text(r):
        console = Console(width=300, record=True)
        console.print(bench_report.results_table(r))
        return console.export_text()

    out = text(res)
    assert "of FP8 GEMM" in out and "FP8 GEMM ceiling: 1000.0 TFLOP/s" in out
    assert "50%" in out and "91%" in out  # ours 500 at 4K; FA3 700 x 1.3 at 16K
    assert "of FP8 GEMM" not in text(sample_result())
    assert "per clock" not in out  # the ceiling's clock unknown
    # with both clocks: the share per MHz (GEMM 1000 at 1600 MHz; ours 500 at 4K read at 2000 MHz: 40%)
    clocked = [dataclasses.replace(r, sm_clock_mhz=2000.0) for r in sample_result().rows]
    out = text(dataclasses.replace(sample_result(clocked), ceiling=dict(c, tflops=1000.0, sm_clock_mhz=1600.0)))
    assert "per clock" in out and "40%" in out and "50%" in out


def test_ceiling_json_round_trip_and_old_runs(tmp_path):
    res = dataclasses.replace(sample_result(), ceiling={"tflops": 1270.0, "m": 8192})
    res.save(tmp_path / "r.json")
    assert bench.BenchResult.load(tmp_path / "r.json") == res
    assert bench.BenchResult.load(OLD_JSON).ceiling == {}


def test_cli_energy_and_ceiling_reach_the_plan(monkeypatch):
    plans = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "run", lambda plan, on_row=None: plans.append(plan) or sample_result())
    cli.main(["bench", "--seqlens", "4096", "--peers", "none", "--energy-s", "2", "--ceiling"])
    cli.main(["bench", "--seqlens", "4096", "--peers", "none"])
    assert [(p.energy_s, p.ceiling) for p in plans] == [(2.0, True), (0.0, False)]
