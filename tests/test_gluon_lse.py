"""The Gluon kernels' LSE twin (emit(config, lse=True)) on the CPU: it compiles for sm_90a without
spills in each softmax and row-sum mode, schedule and head dim (rectangular and varlen), its code and
parameters exist only in the twin, and its launch arguments (kernels/gluon_launch.py,
kernels/gluon_varlen.py) put the LSE where the kernel reads it. GPU runs against float64:
tests/test_gpu_varlen.py (dense), tests/test_gpu_gluon_varlen.py (packed), tests/test_gpu_attention_serving.py
(the bf16 API)."""

from __future__ import annotations

import pytest
import torch

from zyfa_tune.generator import HOPPER, emit
from zyfa_tune.generator.build import compile_for_target
from zyfa_tune.generator.defaults import default_config
from zyfa_tune.generator.gluon_sm90 import emit as emit_gluon
from zyfa_tune.kernels import gluon_launch, gluon_varlen, launch
from zyfa_tune.search_spaces.seeds import gluon_lean_max_config

FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16
GLUON = default_config("fp8", 128, 128, "gluon")  # (two consumers, ping-pong, overlapped)

CONFIGS = [
    ("128", GLUON),
    ("128-lean-max", gluon_lean_max_config("fp8", 128, 128)),
    ("128-rowsum-mma", GLUON.replace(rowsum="mma", skip_rescale=True)),
    ("128-plain", GLUON.replace(overlap=False, ping_pong=False)),
    ("64", default_config("fp8", 64, 64, "gluon")),
    ("256", default_config("fp8", 256, 256, "gluon")),
    ("192-128", default_config("fp8", 192, 128, "gluon")),
]


#: every config on the rectangular schedule; the ragged (varlen) one with an exact and a lean P config
CASES = [(name, cfg, False) for name, cfg in CONFIGS] + [(name, cfg, True) for name, cfg in CONFIGS[:2]]


@pytest.mark.parametrize("name,cfg,varlen", CASES, ids=[f"{n}-{'varlen' if v else 'rect'}" for n, _, v in CASES])
def test_lse_twin_compiles_clean_and_alone_computes_the_lse(name, cfg, varlen):
    """No spills (causal), QGMMA only, within shared memory; the twin has the LSE's log2 and stores
    beyond the kernel's own (which, rectangular, stores by TMA only)."""
    art = compile_for_target(emit(cfg, serving=varlen, lse=True), causal=True)
    plain = compile_for_target(emit(cfg, serving=varlen), causal=True)
    assert art.spill_bytes == 0, f"{name}: spills {art.spill_bytes} bytes"
    assert art.count("QGMMA") > 0 and art.count("HGMMA") == 0 and art.serialised_wgmma is None
    # (the LSE goes from registers to global memory; at most a row vector's layout exchange in between)
    assert plain.shared_bytes <= art.shared_bytes <= min(plain.shared_bytes + 256, HOPPER.shared_memory_bytes)
    assert art.ttgir.count("math.log2") > plain.ttgir.count("math.log2")
    assert art.count("STG") > plain.count("STG")
    if not varlen:
        assert "tt.store" in art.ttgir and "tt.store" not in plain.ttgir


@pytest.mark.parametrize("name,cfg", CONFIGS[:3], ids=[n for n, _ in CONFIGS[:3]])
def test_the_lse_parameters_exist_only_in_the_twin(name, cfg):
    for varlen in (False, True):
        plain, twin = emit(cfg, serving=varlen).source, emit(cfg, serving=varlen, lse=True).source
        assert "LSE_STRIDE" not in plain and "LSE, LSE_STRIDE)" in twin and plain != twin
        assert emit(cfg, serving=varlen, lse=False).source == plain
        params = emit_gluon.kernel_params(cfg, varlen, lse=True)
        assert params[3] == "LSE" and params[-1] == "LSE_STRIDE"
        assert emit_gluon.kernel_params(cfg, varlen) == emit_gluon.SCALAR_PARAMS + emit_gluon.tile_params(cfg, varlen)
    with pytest.raises(ValueError, match="^lse: backend='triton'"):
        emit(default_config("fp8", 128, 128), lse=True)


def _tensors(b=2, sq=1000, sk=1000, h=8, hk=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, h, 128, generator=g).to(FP8)
    k, v = (torch.randn(b, sk, hk, 128, generator=g).to(FP8) for _ in range(2))
    ds = tuple(torch.rand(b, hk, generator=g) + 0.5 for _ in range(3))
    return q, k, v, torch.empty(b, sq, h, 128, dtype=BF16), ds


@pytest.mark.parametrize("config", [GLUON, GLUON.replace(persistent=False, q_order="heavy_first")])
def test_rectangular_lse_arguments_and_the_fast_path(config, monkeypatch):
    """prepare puts the LSE after the descales and its head stride (Sq) last; a bound LSE launch
    passes a fresh LSE per call and exactly what prepare builds for it."""
    calls = []

    class Recorder:
        function, packed_metadata = "function", "metadata"

        def launch_metadata(self, *args):
            return None

        def run(self, g0, g1, g2, stream, function, packed, meta, enter, exit_, *full):
            calls.append(full)

    monkeypatch.setattr(launch, "run_prepared", lambda *a, **k: Recorder())
    monkeypatch.setattr(launch.fastlaunch, "_stream_getter", lambda: lambda device: "stream")
    monkeypatch.setattr(launch, "bind_transpose", lambda v, permute: lambda x: launch.transpose_v(x, permute))
    q, k, v, out, ds = _tensors()
    lse = torch.empty(2, 8, 1000)
    _, args, options = launch.prepare(config, q, k, v, out, 0.1, True, *ds, serving=launch.Serving(lse=lse))
    names = [*emit_gluon.descriptor_blocks(config), *emit_gluon.kernel_params(config, lse=True)]
    a = dict(zip(names, args))
    assert len(args) == len(names) and a["LSE"] is lse and a["LSE_STRIDE"] == 1000 and a["VD"] is ds[2]
    assert options == {"CAUSAL": True, "num_warps": 4}
    bound = launch.bind(config, q, k, v, out, 0.1, True, *ds, serving=launch.Serving(lse=lse))
    serving = launch.ServingLaunch(bound, (2, 8, 1000), lse_only=True)
    q2, k2, v2, out2, ds2 = _tensors(seed=1)
    got, lse2 = serving(q2, k2, v2, out2, *ds2)
    assert got is out2 and lse2 is not lse and lse2.shape == (2, 8, 1000) and lse2.dtype == torch.float32
    _, want, _ = launch.prepare(config, q2, k2, v2, out2, 0.1, True, *ds2, serving=launch.Serving(lse=lse2))
    (full,) = calls
    assert len(full) == len(want) + 1 and full[-1] is True  # (CAUSAL)
    for i, (x, y) in enumerate(zip(full, want)):
        if isinstance(y, torch.Tensor):
            assert x is y or (x.shape == y.shape and torch.equal(x.view(torch.uint8), y.view(torch.uint8))), i
        elif not hasattr(y, "block_shape"):
            assert x == y, i
    bad = torch.empty(2, 1000, 8).transpose(1, 2)
    with pytest.raises(ValueError, match=r"^lse: expected a contiguous float32 \(2, 8, 1000\)"):
        launch.prepare(config, q, k, v, out, 0.1, True, *ds, serving=launch.Serving(lse=bad))
    with pytest.raises(ValueError, match="^config: backend='gluon' runs packed sequences"):
        launch.prepare(config, q, k, v, out, 0.1, True, *ds, serving=launch.Serving(cu_seqlens_q=lse, lse=lse))


def small_packed_call():
    """(natural-V config, q, k, v, out, cumulative lengths, descales) of three packed sequences (CPU, zeros)."""
    lq, lk = [5, 0, 300], [7, 2, 300]
    q = torch.zeros(sum(lq), 8, 128, dtype=FP8)
    k, v = (torch.zeros(sum(lk), 2, 128, dtype=FP8) for _ in range(2))
    out = torch.empty(sum(lq), 8, 128, dtype=BF16)
    cu = tuple(torch.tensor([0, *torch.tensor(x).cumsum(0).tolist()], dtype=torch.int32) for x in (lq, lk))
    return GLUON.replace(v_layout="natural", v_permute=False), q, k, v, out, cu, torch.ones(3, 2)


def test_varlen_lse_arguments():
    cfg, q, k, v, out, cu, ds = small_packed_call()
    lq = [5, 0, 300]
    lse = torch.empty(8, sum(lq))
    _, args, _ = gluon_varlen.arguments(cfg, q, k, v, out, 0.1, True, (ds, ds, ds), cu, (300, 300), 132, lse)
    n_desc = len(gluon_launch.descriptor_owners(cfg))
    named = dict(zip(emit_gluon.kernel_params(cfg, True, lse=True), args[n_desc:]))
    assert len(args) == n_desc + len(named) and named["LSE"] is lse and named["LSE_STRIDE"] == sum(lq)
    assert named["O_PTR"] is out and named["CU_Q"] is cu[0]
    with pytest.raises(ValueError, match=r"^lse: expected a contiguous float32 \(8, 305\)"):
        gluon_varlen.arguments(cfg, q, k, v, out, 0.1, True, (ds, ds, ds), cu, (300, 300), 132, lse[:, :300])
