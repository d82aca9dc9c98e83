"""`zyfa-tune bench` on the CPU: argument parsing, the measuring loop with a CPU system and a fake
timer, JSON round trip (including the first JSON format), the table, the plot from saved JSON, and
the clear errors without a GPU or without matplotlib. One GPU test runs the real thing."""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest
import torch
from bench_cases import PNG_MAGIC, System, fake_timer, sample_result, write_first_format

from zyfa_tune import cli
from zyfa_tune.bench import report as bench_report
from zyfa_tune.bench import run as bench_run
from zyfa_tune.bench.inputs import DTYPES, QUANT_MODES, Inputs
from zyfa_tune.bench.measure import measure_shape
from zyfa_tune.bench.peers import PEERS, parse_peers, systems_for
from zyfa_tune.bench.peers.base import Bound, boxed
from zyfa_tune.bench.peers.ours import Ours, OursSpec, borrowed_from, parse_ours
from zyfa_tune.bench.peers.sdpa import TorchSDPA
from zyfa_tune.bench.results import BenchResult, BenchRow
from zyfa_tune.bench.run import BenchPlan
from zyfa_tune.bench.shape import BenchShape, parse_shape, shapes_from
from zyfa_tune.generator import ConfigError

#: a bf16 peer that runs on the CPU
MATH = TorchSDPA("sdpa-math-bf16", "MATH")


def dequantised_sdpa(x: Inputs) -> Bound:
    """An 'fp8 system' for the CPU: SDPA on the e4m3 inputs times their scales."""
    args, kw = x.args("fp8")
    q, k, v = (a.float() * x.scales[i] for i, a in enumerate(args))
    assert all(torch.all(kw[f"{n}_descale"] == float(kw[f"{n}_descale"][0, 0])) for n in "qkv")
    return Bound(
        *boxed(
            lambda: torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                is_causal=True,
                enable_gqa=q.shape[2] != k.shape[2],
            ).transpose(1, 2)
        )
    )


def broken(x: Inputs) -> Bound:
    raise ImportError("no module named fa3_fwd_interface")


# ---- parsing -----------------------------------------------------------------------------------


def test_shapes_from_flags():
    shapes = shapes_from(128, None, "4096,8192,16384")
    assert [(s.batch, s.seqlen, s.heads, s.kv_heads) for s in shapes] == [
        (4, 4096, 32, 32),
        (2, 8192, 32, 32),
        (1, 16384, 32, 32),
    ]
    one = shapes_from(192, 128, "1024,2048", "2x16", kv_heads=4)
    assert [(s.head_dim_v, s.batch, s.heads, s.kv_heads) for s in one] == [(128, 2, 16, 4)] * 2
    per = shapes_from(64, None, "1024,2048", "3x8,1x8")
    assert [s.batch for s in per] == [3, 1]
    with pytest.raises(ValueError, match="--batch-heads"):
        shapes_from(128, None, "1024,2048,4096", "1x8,1x8")
    with pytest.raises(ValueError, match="--seqlens"):
        shapes_from(128, None, "4k")
    with pytest.raises(ValueError, match="head_dim_qk"):
        shapes_from(84, None, "1024")
    with pytest.raises(ValueError, match="kv_heads"):
        shapes_from(128, None, "1024", "1x8", kv_heads=3)


def test_parse_shape_and_peers():
    assert parse_shape("192,128,2,8192,16") == BenchShape(
        head_dim_qk=192, head_dim_v=128, batch=2, seqlen=8192, heads=16, kv_heads=16
    )
    assert parse_shape("128,128,1,4096,32,8").kv_heads == 8
    assert parse_shape("128,128,1,4096,32").label == "128/128 B=1 S=4096 H=32"
    with pytest.raises(ValueError, match="--shape"):
        parse_shape("128,128,4096")
    assert parse_peers(None, ["fp8"]) == ("fa3-fp8", "cudnn-fp8")
    assert set(parse_peers(None, ["bf16"])) == {"fa3-bf16", "sdpa-cudnn-bf16", "sdpa-flash-bf16"}
    assert parse_peers("none", ["fp8"]) == ()
    with pytest.raises(ValueError, match="--peers.*fa4"):
        parse_peers("fa3-fp8,fa4", ["fp8"])


def test_parse_ours_labels_and_dtypes():
    (lean,) = parse_ours("lean:softmax=lean,rowsum=rounded", ["fp8"])
    assert (lean.label, lean.dtype, lean.overrides) == ("lean", "fp8", (("softmax", "lean"), ("rowsum", "rounded")))
    cfg = lean.config_for(128, 128)
    assert (cfg.softmax, cfg.rowsum, cfg.head_dim_qk) == ("lean", "rounded", 128)
    both = parse_ours("fwd:q_order=forward", ["fp8", "bf16"])
    assert [(o.label, o.dtype) for o in both] == [("fwd-fp8", "fp8"), ("fwd-bf16", "bf16")]
    (named,) = parse_ours("block_m=128,dtype=bf16", ["fp8", "bf16"])
    assert (named.label, named.dtype, dict(named.overrides)) == ("ours-block_m=128", "bf16", {"block_m": 128})
    assert OursSpec("ours-fp8", "fp8").config_for(128, 128) is None  # the dispatcher chooses
    with pytest.raises(ValueError, match="--ours"):
        parse_ours("lean:softmax", ["fp8"])
    with pytest.raises(ValueError, match="dtype"):
        parse_ours("dtype=fp16", ["fp8"])


def test_systems_come_from_the_registry_ours_first_and_only_where_they_run():
    """Every registered system answers to its --peers name and says where it runs; systems_for puts
    ours first and leaves out a peer whose supports() refuses the shape (SDPA at unequal head dims)."""
    for name, peer in PEERS.items():
        assert peer.name == name and peer.kind in ("peer", "ours") and peer.dtype in DTYPES
        assert peer.quant_modes and set(peer.quant_modes) <= set(QUANT_MODES)
    ours = [OursSpec("ours-bf16", "bf16"), *parse_ours("w:block_n=64", ["bf16"])]
    bf16 = parse_peers(None, ["bf16"])
    square = BenchShape(head_dim_qk=128, head_dim_v=128, batch=1, seqlen=1024, heads=8, kv_heads=8)
    wide = BenchShape(head_dim_qk=192, head_dim_v=128, batch=1, seqlen=1024, heads=8, kv_heads=8)
    assert [(s.name, s.kind) for s in systems_for(square, ours, bf16)] == [
        ("ours-bf16", "ours"),
        ("w", "forced"),
        ("fa3-bf16", "peer"),
        ("sdpa-cudnn-bf16", "peer"),
        ("sdpa-flash-bf16", "peer"),
    ]
    assert [s.name for s in systems_for(wide, ours, bf16)] == ["ours-bf16", "w", "fa3-bf16"]


def test_plan_rejects_bad_forced_configs_before_measuring():
    shapes = shapes_from(128, None, "1024")
    with pytest.raises(ConfigError, match="--ours bad"):
        BenchPlan(shapes=shapes, ours=tuple(parse_ours("bad:block_m=7", ["fp8"])), peers=())
    with pytest.raises(ValueError, match="reps"):
        BenchPlan(shapes=shapes, ours=(), peers=(), reps=2)
    with pytest.raises(ValueError, match="peers"):
        BenchPlan(shapes=shapes, ours=(), peers=("fa2",))


# ---- measuring on the CPU ----------------------------------------------------------------------


def test_measure_shape_on_cpu_rows_errors_and_flops():
    shape = BenchShape(head_dim_qk=64, head_dim_v=64, batch=1, seqlen=256, heads=4, kv_heads=2)
    systems = [
        MATH,
        System("dequant-fp8", "peer", "fp8", dequantised_sdpa),
        System("missing", "peer", "fp8", broken),
        Ours(OursSpec("ours-bf16", "bf16")),
    ]  # CUDA only: fails cleanly
    seen = []
    rows = measure_shape(shape, systems, seed=0, reps=5, rotate=2, device="cpu", timer=fake_timer, on_row=seen.append)
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
    x = Inputs.random(
        BenchShape(head_dim_qk=64, head_dim_v=64, batch=2, seqlen=128, heads=4, kv_heads=4), seed=3, device="cpu"
    )
    _, kw = x.args("fp8")
    assert set(kw) == {"q_descale", "k_descale", "v_descale"}
    assert kw["q_descale"].shape == (2, 4) and float(kw["q_descale"][0, 0]) == pytest.approx(x.scales[0])
    assert float(x.q8.float().abs().max()) == 448.0  # per-tensor scale uses the whole e4m3 range
    again = Inputs.random(x.shape, seed=3, device="cpu")
    assert torch.equal(x.q16, again.q16) and not torch.equal(x.q16, Inputs.random(x.shape, 4, "cpu").q16)


def test_native_quantisation_and_input_families():
    """--quant native: FP8 inputs are quantize_fp8 of the float32 originals, per option set (made
    once), and the reference is float64 attention on those originals; families change the inputs."""
    from zyfa_tune import quantize_fp8
    from zyfa_tune.tuning.reference import attention_reference

    shape = BenchShape(head_dim_qk=64, head_dim_v=64, batch=1, seqlen=64, heads=4, kv_heads=2)
    x = Inputs.random(shape, seed=1, device="cpu", family="outliers", quant="native")
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
    kappa0 = x.args("fp8", (("balanced_v", True), ("v_weight", 0.0)))[0][2]  # --ours ...,v_weight=0
    assert torch.equal(
        kappa0.view(torch.uint8), quantize_fp8(*x.raw, v_rounding="balanced", v_weight=0.0)[2].view(torch.uint8)
    )
    assert not torch.equal(kappa0.view(torch.uint8), balanced[0][2].view(torch.uint8))  # the estimated kappa's differ
    assert torch.equal(x.reference("fp8"), attention_reference(*x.raw, causal=True))
    assert torch.equal(x.reference("bf16"), x.reference("fp8"))
    gauss = Inputs.random(shape, seed=1, device="cpu")
    assert gauss.raw is None and not torch.equal(gauss.q16, x.q16)


def test_end_to_end_mode_quantises_inside_each_call(monkeypatch):
    """--quant end-to-end: an FP8 system's call quantises the bf16 inputs itself, every call (so its timing
    counts the quantiser), with the system's options (FA3: none); bf16 systems get the bf16 tensors; the error
    reference is float64 attention on the unquantised originals, as in native mode."""
    import zyfa_tune.quantize as zq
    from zyfa_tune.tuning.reference import attention_reference

    shape = BenchShape(head_dim_qk=64, head_dim_v=64, batch=1, seqlen=48, heads=4, kv_heads=2)
    x = Inputs.random(shape, seed=2, device="cpu", family="sink", quant="end-to-end")
    calls = []
    real = zq.quantize_fp8
    monkeypatch.setattr(zq, "quantize_fp8", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    seen = []
    run = x.call("fp8", (("balanced_v", True),), lambda *a, **kw: seen.append((a, kw)))
    assert calls == []  # nothing quantised until the call
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
    BenchPlan(shapes=shapes, ours=parse_ours("b:balanced_v=true", ["fp8"]), peers=("fa3-fp8",), quant="end-to-end")
    with pytest.raises(ValueError, match="cudnn-fp8"):
        BenchPlan(shapes=shapes, ours=(), peers=("cudnn-fp8",), quant="end-to-end")


def test_quantisation_options_parse_and_need_native_mode():
    (smooth,) = parse_ours("sk:smooth_k=true", ["fp8"])
    assert smooth.overrides is None and smooth.quant == (("smooth_k", True),)  # the dispatcher's kernel
    (bal,) = parse_ours("b:balanced_v=true,k_major_v=true", ["fp8"])
    assert dict(bal.quant) == {"balanced_v": True, "k_major_v": True}
    (kappa,) = parse_ours("b:balanced_v=true,v_weight=0", ["fp8"])  # kappa 0: balanced V without the kappa weighting
    assert dict(kappa.quant) == {"balanced_v": True, "v_weight": 0.0}
    for bad, match in (
        ("v_weight=1", "add balanced_v=true"),
        ("balanced_v=true,v_weight=-2", "a number >= 0"),
        ("balanced_v=true,v_weight=nan", "a number >= 0"),
        ("balanced_v=true,v_weight=yes", "a number"),
    ):
        with pytest.raises(ValueError, match=match):
            parse_ours(bad, ["fp8"])
    (both,) = parse_ours("dtype=fp8,num_stages=2,hadamard=true", ["fp8", "bf16"])
    assert dict(both.overrides) == {"num_stages": 2} and both.quant == (("hadamard", True),)
    with pytest.raises(ValueError, match="dtype=fp8"):
        parse_ours("smooth_k=true", ["fp8", "bf16"])
    with pytest.raises(ValueError, match="true or false"):
        parse_ours("smooth_k=2", ["fp8"])
    shape = (BenchShape(head_dim_qk=128, head_dim_v=128, batch=1, seqlen=1024, heads=8, kv_heads=8),)
    with pytest.raises(ValueError, match="--quant native or end-to-end"):
        BenchPlan(shapes=shape, ours=(smooth,), peers=())
    BenchPlan(shapes=shape, ours=(smooth,), peers=(), quant="native", input_family="llm")
    with pytest.raises(ValueError, match="quant"):
        BenchPlan(shapes=shape, ours=(), peers=(), quant="per-head")
    with pytest.raises(ValueError, match="input_family"):
        BenchPlan(shapes=shape, ours=(), peers=(), input_family="weird")


# ---- results, table, plot ----------------------------------------------------------------------


def test_json_round_trip(tmp_path):
    res = sample_result()
    res.save(tmp_path / "r.json")
    assert BenchResult.load(tmp_path / "r.json") == res


def test_first_format_json_loads(tmp_path):
    res = BenchResult.load(write_first_format(tmp_path / "first.json"))
    first = res.rows[0]
    assert (first.system, first.kind, first.dtype, first.hk) == ("ours-fp8", "ours", "fp8", 32)
    assert {r.dtype for r in res.rows if r.system.startswith("sdpa")} == {"bf16"}
    assert res.gpu["name"] == "NVIDIA H200"


def test_load_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"date": "x"}')
    with pytest.raises(ValueError, match="--from.*rows"):
        BenchResult.load(bad)
    with pytest.raises(ValueError, match="--from"):
        BenchResult.load(tmp_path / "missing.json")


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
        return ProblemKey(
            dtype="fp8", head_dim_qk=192, head_dim_v=128, causal=True, gqa_group=gqa, seqlen_bucket=s, bh_bucket=bh
        )

    cfg = default_config("fp8", 192, 128, "gluon")
    own = key(32768, 16)
    assert borrowed_from(Choice(cfg, "exact", own, tuned_key=own)) is None
    assert borrowed_from(Choice(cfg, "default", own)) is None
    near = borrowed_from(Choice(cfg, "nearest", own, tuned_key=key(16384, 16)))
    assert near == "tuned at seqlen<=16384 B*H<=16"
    other = Choice(cfg, "other-device", own, tuned_key=key(32768, 16, gqa=2), tuned_on="NVIDIA H100 80GB HBM3")
    assert borrowed_from(other) == "tuned at seqlen<=32768 B*H<=16 gqa=2 on NVIDIA H100 80GB HBM3"
    row = BenchRow(
        shape="192/128 B=1 S=32768 H=16",
        system="ours-fp8",
        kind="ours",
        dtype="fp8",
        dqk=192,
        dv=128,
        b=1,
        s=32768,
        h=16,
        hk=16,
        tflops=1023.2,
        median_ms=5.4,
        rel_l2=0.02,
        config=cfg.to_json(),
        source="nearest",
        entry=near,
    )
    res = BenchResult(
        date="2026-12-02T10:00:00+00:00",
        gpu={"name": "NVIDIA H200"},
        gpu_after={},
        environment={},
        settings={},
        rows=(row,),
    )
    res.save(tmp_path / "r.json")
    assert BenchResult.load(tmp_path / "r.json").rows[0].entry == near
    console = Console(width=300, record=True)
    console.print(bench_report.results_table(res))
    assert "nearest (tuned at seqlen<=16384 B*H<=16)" in console.export_text()


def test_several_input_families_in_one_run(tmp_path):
    """--input-family a,b measures every shape on each family; rows carry their family, each family's
    rows are compared with that family's peers, the plot gets a panel per family, and the saved
    JSON keeps it all."""
    from rich.console import Console

    shape = BenchShape(head_dim_qk=64, head_dim_v=64, batch=1, seqlen=128, heads=2, kv_heads=2)
    plan = BenchPlan(shapes=(shape,), ours=(), peers=(), input_family="gaussian,outliers")
    assert plan.families == ("gaussian", "outliers")
    for bad in ("gaussian,gaussian", "gaussian,weird", ""):
        with pytest.raises(ValueError, match="input_family"):
            BenchPlan(shapes=(shape,), ours=(), peers=(), input_family=bad)
    systems = [MATH]
    rows = [
        r
        for fam in plan.families
        for r in measure_shape(shape, systems, seed=0, reps=5, device="cpu", timer=fake_timer, input_family=fam)
    ]
    assert [r.family for r in rows] == ["gaussian", "outliers"]
    assert rows[0].rel_l2 != rows[1].rel_l2  # different inputs
    slow = dataclasses.replace(rows[1], system="ours-bf16", kind="ours", tflops=rows[1].tflops / 2)
    result = BenchResult(
        date="2026-12-01T10:00:00+00:00",
        gpu={"name": "NVIDIA H200"},
        gpu_after={},
        environment={},
        settings={"input_family": plan.input_family},
        rows=(*rows, slow),
    )
    assert set(bench_report.best_peer(result.rows)) == {
        (shape.label, "bf16", "gaussian"),
        (shape.label, "bf16", "outliers"),
    }
    console = Console(width=250, record=True)
    console.print(bench_report.results_table(result))
    text = console.export_text()
    assert "gaussian, outliers inputs" in text and f"{shape.label} · outliers" in text and "0.50x" in text
    assert "outliers" in bench_report.row_line(rows[1])
    path = tmp_path / "fam.json"
    result.save(path)
    assert BenchResult.load(path).rows == result.rows
    assert len(bench_report._panels(result.rows)) == 2


def test_plot_from_saved_json_via_cli(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    saved, png = tmp_path / "r.json", tmp_path / "r.png"
    sample_result().save(saved)
    assert cli.main(["bench", "--from", str(saved), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 10_000
    assert "fa3-fp8" in capsys.readouterr().out
    many = tmp_path / "first.png"  # several panels (head dims) from a run in the first JSON format
    first = write_first_format(tmp_path / "first.json")
    assert cli.main(["bench", "--from", str(first), "--plot", str(many)]) == 0
    assert many.read_bytes()[:8] == PNG_MAGIC


def test_plot_lines_per_system_and_batch():
    rows = sample_result().rows
    panels = bench_report._panels(rows)
    assert list(panels) == [(128, 128, 32, 32, "")]  # (dims, heads, input family: none saved)
    lines = bench_report._lines(panels[(128, 128, 32, 32, "")])
    assert list(lines) == ["ours-fp8", "lean", "fa3-fp8"]  # ours first; the failed peer has no line
    assert [p.s for p in lines["ours-fp8"]] == [4096, 8192, 16384]
    extra = [
        *rows,
        BenchRow(
            shape="128/128 B=2 S=4096 H=32",
            system="fa3-fp8",
            kind="peer",
            dtype="fp8",
            dqk=128,
            dv=128,
            b=2,
            s=4096,
            h=32,
            hk=32,
            tflops=800.0,
        ),
    ]
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
        bench_run.run(BenchPlan(shapes=shapes_from(128, None, "1024"), ours=(), peers=()))


@pytest.mark.parametrize(
    "argv,systems",
    [
        ([], ["ours-fp8"]),
        (["--no-dispatch", "--ours", "w:backend=gluon,block_n=256"], ["w"]),
        (["--no-dispatch", "--peers", "fa3-fp8"], []),
    ],
)
def test_bench_plan_has_the_dispatcher_pick_unless_no_dispatch(monkeypatch, argv, systems):
    """What `zyfa-tune bench` would measure (its plan, caught before measuring): --no-dispatch leaves
    flash_attn_func's own pick out, so that one system can run alone (under ncu)."""
    plans = []

    def fake_run(plan, on_row=None):
        plans.append(plan)
        return sample_result()

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench_run, "run", fake_run)
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
    rc = cli.main(
        [
            "bench",
            "--dtype",
            dtype,
            "--head-dim",
            "128",
            "--seqlens",
            "1024,2048",
            "--batch-heads",
            "1x8",
            "--peers",
            peers,
            "--ours",
            "fwd:q_order=forward",
            "--reps",
            "5",
            "--warm",
            "0.2",
            "--json",
            str(out),
            *(["--energy-s", "1", "--ceiling"] if dtype == "fp8" else []),
        ]
    )
    assert rc == 0
    res = BenchResult.load(out)
    ours = [r for r in res.rows if r.kind != "peer"]
    assert len(ours) == 4 and all(r.error is None for r in ours)
    for r in ours:
        assert r.tflops > 0 and r.rel_l2 < (5e-2 if dtype == "fp8" else 1e-2) and r.config
    assert {r.source for r in ours if r.kind == "ours"} <= {"exact", "nearest", "other-device", "default"}
    assert {r.source for r in ours if r.kind == "forced"} == {"forced"}
    assert res.environment.get("gpu_name") and json.loads(out.read_text())["settings"]["reps"] == 5
    if dtype == "fp8":  # the FP8 GEMM ceiling and an energy window per system (where NVML has a counter)
        assert 300 < res.ceiling["tflops"] < 3000 and res.ceiling["m"] == bench_run.CEILING_N
        from zyfa_tune.tuning.timing import _energy_mj, _nvml_handle

        if _energy_mj(*_nvml_handle(0)) is not None:
            assert all(r.tflop_per_j and 50 < r.power_w < 1500 for r in ours)
