"""`zyfa-tune bench --lengths`: packed sequences on the CPU (shapes, inputs with per-sequence descales
and a float64 varlen reference, the registry's varlen peers and which systems run which shapes, the
plan), and on the GPU ours against FA3's varlen on the same inputs."""

from __future__ import annotations

import pytest
import torch
from bench_cases import System, fake_timer, sample_result
from test_bench import dequantised_sdpa

from zyfa_tune import cli
from zyfa_tune.bench import run as bench_run
from zyfa_tune.bench.inputs import Inputs
from zyfa_tune.bench.measure import measure_shape
from zyfa_tune.bench.peers import PEERS, parse_peers, systems_for
from zyfa_tune.bench.peers.base import Bound, boxed
from zyfa_tune.bench.peers.ours import OursSpec, parse_ours
from zyfa_tune.bench.peers.paged import ContiguousTwin, FA3Paged, PagedOurs
from zyfa_tune.bench.peers.varlen import FA3Varlen, VarlenOurs
from zyfa_tune.bench.results import BenchResult
from zyfa_tune.bench.run import BenchPlan
from zyfa_tune.bench.shape import BenchShape, packed_shape
from zyfa_tune.tuning.lengths import MIXES
from zyfa_tune.tuning.reference import attention_reference
from zyfa_tune.tuning.timing import attention_flops

LENGTHS = (5, 64, 1, 130)


def small(heads=4, kv_heads=2) -> BenchShape:
    return BenchShape.packed(LENGTHS, heads, kv_heads, head_dim_qk=64, head_dim_v=64)


def test_packed_bench_shapes():
    s = small()
    assert (s.batch, s.seqlen, s.tokens) == (4, 130, 200) and s.label == "64/64 varlen N=4 T=200 max=130 H=4/2"
    assert s.flops == sum(attention_flops(1, 4, n, n, 64, 64, True) for n in LENGTHS)
    chat = packed_shape("chat", 128, None, 32, 8)
    assert chat.lengths == MIXES["chat"].lengths and (chat.head_dim_v, chat.heads, chat.kv_heads) == (128, 32, 8)
    with pytest.raises(ValueError, match="^--lengths"):
        packed_shape("chatty", 128, None, 32, 8)


def test_varlen_peers_are_registered_and_run_only_packed_shapes():
    assert isinstance(PEERS["fa3-varlen-fp8"], FA3Varlen) and PEERS["fa3-varlen-bf16"].dtype == "bf16"
    assert parse_peers(None, ["fp8"], packed=True) == ("fa3-varlen-fp8",)
    assert "fa3-varlen-fp8" not in parse_peers(None, ["fp8"])  # the default peers of rectangular shapes
    assert parse_peers(None, ["fp8"], "native", packed=True) == ()  # packed inputs are per-tensor only
    ours = [OursSpec("ours-fp8", "fp8"), *parse_ours("w:block_n=64", ["fp8"])]
    peers = parse_peers("fa3-fp8,cudnn-fp8,fa3-varlen-fp8", ["fp8"])
    packed = systems_for(small(), ours, peers)
    assert [(s.name, s.kind) for s in packed] == [("ours-fp8", "ours"), ("w", "forced"), ("fa3-varlen-fp8", "peer")]
    assert all(isinstance(s, VarlenOurs) for s in packed[:2])
    rect = BenchShape(head_dim_qk=128, head_dim_v=128, batch=1, seqlen=1024, heads=8, kv_heads=8)
    assert "fa3-varlen-fp8" not in [s.name for s in systems_for(rect, ours, peers)]
    assert not any(isinstance(s, VarlenOurs) for s in systems_for(rect, ours, peers))


def test_packed_inputs_descales_and_reference():
    x = Inputs.random(small(), seed=1, device="cpu")
    assert x.q16.shape == (1, 200, 4, 64) and x.k16.shape == (1, 200, 2, 64)
    _, kw = x.args("fp8")
    assert kw["q_descale"].shape == (4, 2)  # one per sequence and kv head
    cu, most = x.packed_bounds()
    assert cu.tolist() == [0, 5, 69, 70, 200] and cu.dtype == torch.int32 and most == 130
    ref = x.reference("bf16")
    assert ref.shape == (1, 200, 4, 64) and ref.dtype == torch.float64
    lo, hi = 5, 69  # each sequence attends only to itself: its rows are its own attention
    own = attention_reference(x.q16[:, lo:hi], x.k16[:, lo:hi], x.v16[:, lo:hi], causal=True)
    assert torch.allclose(ref[:, lo:hi], own)
    with pytest.raises(ValueError, match="per-tensor"):
        Inputs.random(small(), seed=1, device="cpu", quant="native")
    with pytest.raises(ValueError, match="not of packed sequences"):
        Inputs.random(
            BenchShape(head_dim_qk=64, head_dim_v=64, batch=1, seqlen=8, heads=4, kv_heads=2), 0, "cpu"
        ).packed_bounds()


def per_sequence_sdpa(x: Inputs) -> Bound:
    """A packed 'system' for the CPU: SDPA per sequence of the bf16 inputs, packed again."""
    cu, _ = x.packed_bounds()
    bounds = cu.tolist()

    def run():
        outs = []
        for lo, hi in zip(bounds, bounds[1:]):
            q, k, v = (t[:, lo:hi].float().transpose(1, 2) for t in (x.q16, x.k16, x.v16))
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            outs.append(o.transpose(1, 2))
        return torch.cat(outs, dim=1)

    return Bound(*boxed(run))


def test_measure_packed_shape_on_cpu_counts_flops_per_sequence():
    s = small()
    systems = [
        System("packed-sdpa", "peer", "bf16", per_sequence_sdpa),
        System("whole", "peer", "fp8", dequantised_sdpa),
    ]
    row, whole = measure_shape(s, systems, seed=0, reps=5, device="cpu", timer=fake_timer)
    assert row.error is None and row.rel_l2 < 1e-5  # per-sequence attention is the packed reference
    assert row.tflops == pytest.approx(s.flops / 2e-3 / 1e12)
    assert whole.rel_l2 > 1e-2  # one causal mask over every token is not packed attention
    assert (row.shape, row.b, row.s) == (s.label, 4, 130)


def test_plan_and_cli_of_packed_sequences(monkeypatch, capsys):
    with pytest.raises(ValueError, match="per-tensor only"):
        BenchPlan(shapes=(small(),), ours=(), peers=(), quant="native")
    plans = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench_run, "run", lambda plan, on_row=None: plans.append(plan) or sample_result())
    cli.main(["bench", "--lengths", "long-doc", "--heads", "16", "--kv-heads", "4", "--dtype", "both"])
    (plan,) = plans
    (shape,) = plan.shapes
    assert shape.lengths == MIXES["long-doc"].lengths and (shape.heads, shape.kv_heads) == (16, 4)
    assert plan.peers == ("fa3-varlen-fp8", "fa3-varlen-bf16")
    assert [o.label for o in plan.ours] == ["ours-fp8", "ours-bf16"]
    assert cli.main(["bench", "--lengths", "0,5"]) == 2
    assert "--lengths: entry 0 is 0" in capsys.readouterr().out


def test_paged_systems_pair_each_of_ours_with_its_contiguous_twin(monkeypatch):
    ours = [OursSpec("ours-fp8", "fp8"), *parse_ours("w:block_n=64", ["fp8"])]
    names = [(s.name, type(s)) for s in systems_for(small(), ours, ["fa3-varlen-fp8"], paged=128)]
    assert names == [
        ("ours-fp8", VarlenOurs),
        ("w", VarlenOurs),
        ("ours-fp8-paged", PagedOurs),
        ("ours-fp8-paged-contiguous", ContiguousTwin),
        ("w-paged", PagedOurs),
        ("w-paged-contiguous", ContiguousTwin),
        ("fa3-varlen-fp8-paged", FA3Paged),
        ("fa3-varlen-fp8", FA3Varlen),
    ]
    odd = BenchShape.packed((300, 200), 8, 8, head_dim_qk=80, head_dim_v=80)  # (FA3 has no hd80 kernel to page)
    assert "fa3-varlen-fp8-paged" not in [s.name for s in systems_for(odd, ours, ["fa3-varlen-fp8"], paged=128)]
    rect = BenchShape(head_dim_qk=128, head_dim_v=128, batch=1, seqlen=1024, heads=8, kv_heads=8)
    assert not any(isinstance(s, PagedOurs) for s in systems_for(rect, ours, [], paged=128))
    for bad in (48, -32):
        with pytest.raises(ValueError, match="^paged: a page size is a positive multiple of 32"):
            BenchPlan(shapes=(small(),), ours=tuple(ours), peers=(), paged=bad)
    with pytest.raises(ValueError, match="^paged: paged caches are benched on packed sequences"):
        BenchPlan(shapes=(rect,), ours=tuple(ours), peers=(), paged=128)
    plans = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench_run, "run", lambda plan, on_row=None: plans.append(plan) or sample_result())
    cli.main(["bench", "--lengths", "chat", "--paged", "256"])
    assert plans[0].paged == 256
    assert cli.main(["bench", "--lengths", "chat", "--paged", "0"]) == 2 and len(plans) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_bench_lengths_on_gpu(tmp_path, dtype):
    out = tmp_path / "r.json"
    argv = ["bench", "--dtype", dtype, "--head-dim", "128", "--lengths", "1,127,3000,700", "--heads", "8"]
    argv += ["--ours", "fwd:q_order=forward", "--reps", "5", "--warm", "0.2", "--json", str(out)]
    assert cli.main(argv) == 0
    res = BenchResult.load(out)
    ours = [r for r in res.rows if r.kind != "peer"]
    assert len(ours) == 2 and all(r.error is None and r.tflops > 0 and r.config for r in ours)
    bound = 5e-2 if dtype == "fp8" else 1e-2
    assert all(r.rel_l2 < bound for r in ours)
    (fa3,) = [r for r in res.rows if r.system == f"fa3-varlen-{dtype}"]
    assert fa3.error is None or fa3.error.startswith("ImportError")  # the wheel is optional
    if fa3.error is None:
        assert fa3.rel_l2 < bound and fa3.tflops > 0


@pytest.mark.gpu
def test_bench_paged_on_gpu(tmp_path, monkeypatch):
    """The paged cache and its contiguous twin run the config their rows name (the one the paged call
    binds, on the Gluon twin or the Triton serving variant) and both match float64."""
    import zyfa_tune.kvcache as kvcache
    from zyfa_tune.kernels import gluon_paged

    bound = []
    for owner in (kvcache, gluon_paged):
        bind = owner.bind
        monkeypatch.setattr(
            owner, "bind", lambda config, *a, _b=bind, **kw: bound.append(config) or _b(config, *a, **kw)
        )
    out = tmp_path / "r.json"
    argv = ["bench", "--head-dim", "128", "--lengths", "1,127,3000,700", "--heads", "8", "--paged", "128"]
    assert cli.main([*argv, "--peers", "fa3-varlen-fp8", "--reps", "5", "--warm", "0.2", "--json", str(out)]) == 0
    result = BenchResult.load(out)
    rows = {r.system: r for r in result.rows}
    paged, twin = rows["ours-fp8-paged"], rows["ours-fp8-paged-contiguous"]
    assert paged.error is None and twin.error is None and result.settings["paged"] == 128
    assert {c.to_json() for c in bound} == {paged.config} == {twin.config}
    assert paged.tflops > 0 and twin.tflops > 0 and paged.rel_l2 < 5e-2 and twin.rel_l2 < 5e-2
    fa3 = rows["fa3-varlen-fp8-paged"]  # (FA3's KV-cache entry on the same pages; the wheel is optional)
    assert fa3.error is None or fa3.error.startswith("ImportError")
    if fa3.error is None:
        assert fa3.tflops > 0 and abs(fa3.rel_l2 - paged.rel_l2) < 0.2 * paged.rel_l2
