"""GPU: flash_attn_func picks kernels from a database, falls back, and works in CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from zyfa_tune import explain, flash_attn_func
from zyfa_tune.db import ProblemKey, TrialResult, current_fingerprint, open_store
from zyfa_tune.generator import emit
from zyfa_tune.generator.defaults import default_config
from zyfa_tune.kernels import dispatch
from zyfa_tune.tuning.reference import attention_reference, rel_l2
from zyfa_tune.tuning.verify import make_inputs

pytestmark = pytest.mark.gpu


@pytest.fixture
def tuned_db(tmp_path, monkeypatch):
    """A database holding one tuned fp8 hd128 entry for this GPU, installed as the only layer."""
    cfg = default_config("fp8", 128, 128).replace(softmax="lean", rowsum="rounded", num_stages=2)
    key = ProblemKey.from_shape(
        dtype="fp8", head_dim_qk=128, head_dim_v=128, causal=True, batch=2, heads=8, kv_heads=8, seqlen=2048
    )
    with open_store(tmp_path / "t.db") as store:
        store.record_trial(
            current_fingerprint(),
            key,
            cfg,
            TrialResult(status="ok", median_ms=0.1, tflops=100.0, error_rel_l2=0.03, batch=2, heads=8, seqlen=2048),
            source_hash=emit(cfg).source_hash,
            study="gpu-test",
        )
    monkeypatch.setattr(dispatch, "_dispatcher", dispatch.Dispatcher([str(tmp_path / "t.db")]))
    return cfg


def test_tuned_entry_is_used_then_nearest_then_default(tuned_db):
    args, kw = make_inputs("fp8", 128, 128, batch=2, heads=8, kv_heads=8, seqlen=2000, seed=1)
    choice = explain(*args, **kw)
    assert choice.source == "exact" and choice.config == tuned_db
    out = flash_attn_func(*args, **kw)
    assert rel_l2(out, attention_reference(*args, **kw)) < 0.05
    assert torch.equal(out, flash_attn_func(*args, config=tuned_db, **kw))
    args, kw = make_inputs("fp8", 128, 128, batch=1, heads=4, kv_heads=4, seqlen=9000, seed=2)
    assert explain(*args, **kw).source == "nearest"
    args, kw = make_inputs("fp8", 64, 64, batch=1, heads=4, kv_heads=4, seqlen=300, seed=3)
    choice = explain(*args, **kw)
    assert choice.source == "default"
    assert rel_l2(flash_attn_func(*args, **kw), attention_reference(*args, **kw)) < 0.03


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_cuda_graph_capture(dtype):
    args, kw = make_inputs(dtype, 128, 128, batch=1, heads=8, kv_heads=2, seqlen=777, seed=4)
    eager = flash_attn_func(*args, **kw)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        flash_attn_func(*args, **kw)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        static = flash_attn_func(*args, **kw)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static, eager)


def test_launch_fast_path_matches_first_launch():
    """The second and later launches of a specialisation skip Triton's JIT path: same bits, and a
    change in a specialised property (seqlen 1, odd strides) gets its own compiled kernel."""
    cfg = default_config("fp8", 128, 128)
    for seqlen in (1, 16, 17, 1000, 1, 17):
        args, kw = make_inputs("fp8", 128, 128, batch=2, heads=4, kv_heads=2, seqlen=seqlen, seed=seqlen)
        first = flash_attn_func(*args, config=cfg, **kw)
        again = flash_attn_func(*args, config=cfg, **kw)
        assert torch.equal(first, again)
        assert rel_l2(again, attention_reference(*args, **kw)) < 0.03


@pytest.mark.parametrize(
    "dtype,dqk,dv,variant",
    [
        ("fp8", 128, 128, {}),
        ("fp8", 128, 128, dict(loads="pointer")),
        ("fp8", 64, 64, dict(v_layout="natural")),
        ("bf16", 128, 128, {}),
        ("bf16", 192, 128, {}),
        ("fp8", 256, 256, dict(loads="pointer", v_layout="natural")),
    ],
)
def test_fast_path_equals_checked_path(dtype, dqk, dv, variant, monkeypatch):
    """Later calls with one layout take the bound launch; they must equal a fresh checked call bitwise,
    for new data, for the descales passed, and for a view with an unaligned pointer (checked path)."""
    from zyfa_tune import api

    cfg = default_config(dtype, dqk, dv).replace(**variant)
    monkeypatch.setattr(api, "_plans", {})
    shape = dict(batch=2, heads=8, kv_heads=2, seqlen=1000)
    args, kw = make_inputs(dtype, dqk, dv, seed=100, **shape)
    flash_attn_func(*args, config=cfg, **kw)  # checked: leaves the plan
    assert len(api._plans) == 1
    for seed in range(3):
        args, kw = make_inputs(dtype, dqk, dv, seed=seed, **shape)
        fast = flash_attn_func(*args, config=cfg, **kw)
        api._plans.clear()
        checked = flash_attn_func(*args, config=cfg, **kw)
        assert len(api._plans) == 1
        assert torch.equal(fast, checked), seed
        assert rel_l2(fast, attention_reference(*args, **kw)) < (0.05 if dtype == "fp8" else 0.01)
    q, k, v = args
    buf = torch.empty(q.numel() * q.element_size() + 16, dtype=torch.uint8, device=q.device)
    q_odd = buf[8 : 8 + q.numel() * q.element_size()].view(q.dtype).view(q.shape)
    q_odd.copy_(q)
    assert q_odd.data_ptr() % 16 and q_odd.stride() == q.stride()
    assert torch.equal(flash_attn_func(q_odd, k, v, config=cfg, **kw), checked)


@pytest.mark.parametrize("variant", [{}, dict(loads="pointer"), dict(v_layout="natural")])
def test_k_major_v_equals_natural_v(variant):
    """quantize_fp8(..., v_layout="k_major") gives the same output bitwise, on the checked path and
    on the fast path (the transposed-V kernels then read it without the V^T copy)."""
    cfg = default_config("fp8", 128, 128).replace(**variant)
    shape = dict(batch=2, heads=8, kv_heads=2, seqlen=1000)
    for seed in range(2):
        args, kw = make_inputs("fp8", 128, 128, seed=seed, **shape)
        args_k, kw_k = make_inputs("fp8", 128, 128, seed=seed, v_layout="k_major", **shape)
        assert args_k[2].stride(1) == 1
        natural = flash_attn_func(*args, config=cfg, **kw)
        for _ in range(2):  # checked path, then the fast path
            assert torch.equal(natural, flash_attn_func(*args_k, config=cfg, **kw_k)), seed
