"""GPU tests of the Gluon backend at run time: the balanced schedule and the L2 grouping only reorder
tiles, CUDA graph capture, the dispatcher running a Gluon winner from a database, K-major V read as
stored (k_perm)."""

from __future__ import annotations

import pytest
import torch
from gpu_gluon import CONFIGS, FP8_BOUND, GLUON, LEAN_BOUNDS, PACKED, dispatch_from, fa3_error

from zyfa_tune import api, explain, flash_attn_func
from zyfa_tune.generator.defaults import default_config
from zyfa_tune.search_spaces.seeds import (
    gluon_defer_config,
    gluon_lean_smem2_config,
    gluon_smem2_chunked_config,
    gluon_smem2_config,
    gluon_wide_config,
)
from zyfa_tune.tuning.reference import attention_reference, rel_l2
from zyfa_tune.tuning.verify import make_inputs

pytestmark = pytest.mark.gpu

#: (batch, seqlen_q, seqlen_k, heads, kv_heads, causal): ragged, GQA, non-causal, fewer tiles than SMs
BALANCE_SHAPES = [
    (2, 1000, 1000, 8, 8, True),
    (1, 777, 1500, 8, 2, True),
    (3, 4096, 4096, 4, 4, True),
    (2, 600, 900, 4, 4, False),
    (1, 130, 130, 2, 1, True),
]


@pytest.mark.parametrize("name", ["seed", "wide", "256-defer"])
@pytest.mark.parametrize("shape", BALANCE_SHAPES)
def test_balanced_schedule_is_round_robin_reordered(name, shape):
    """q_order="balanced" only changes which program runs a tile and when: every tile is computed by
    the same code, so the output is bitwise that of round robin (heavy first)."""
    cfg = {"seed": GLUON, "wide": gluon_wide_config("fp8", 128, 128), "256-defer": gluon_defer_config("fp8", 256, 256)}[
        name
    ]
    assert cfg.q_order == "balanced"
    b, sq, sk, h, hk, causal = shape
    args, kw = make_inputs(
        "fp8", cfg.head_dim_qk, cfg.head_dim_v, batch=b, heads=h, kv_heads=hk, seqlen=sq, seqlen_k=sk, seed=5
    )
    balanced = flash_attn_func(*args, causal=causal, config=cfg, **kw)
    assert torch.equal(balanced, flash_attn_func(*args, causal=causal, config=cfg.replace(q_order="heavy_first"), **kw))


@pytest.mark.parametrize("name", ["seed", "192/128"])
def test_l2_group_only_moves_tiles(name):
    """l2_group_mib (a launch field) hands the tiles to other programs in another order: the output is
    bitwise that of the default group, at a shape where every group size makes another table."""
    from zyfa_tune.kernels import gluon_launch

    cfg = GLUON if name == "seed" else gluon_smem2_chunked_config("fp8", 192, 128)
    assert cfg.q_order == "balanced"
    args, kw = make_inputs("fp8", cfg.head_dim_qk, cfg.head_dim_v, batch=1, heads=16, kv_heads=16, seqlen=8192, seed=6)
    base = flash_attn_func(*args, causal=True, config=cfg, **kw)
    for mib in (8, 32, 64):
        assert torch.equal(flash_attn_func(*args, causal=True, config=cfg.replace(l2_group_mib=mib), **kw), base)
    tables = {
        gluon_launch.schedule(
            1,
            16,
            1,
            8192 // cfg.block_m,
            8192,
            8192,
            cfg.block_m,
            cfg.block_n,
            True,
            cfg.head_dim_qk + cfg.head_dim_v,
            132,
            mib << 20,
        )
        for mib in (8, 16, 32)
    }
    assert len(tables) == 3  # K and V 2-2.5 MiB a head: groups of 3-4, 6-8 and 12-16 heads


def test_balanced_first_call_in_capture_is_a_clear_error():
    """A new shape's tile table is a host copy: inside CUDA graph capture its first call says so."""
    args, kw = make_inputs("fp8", 128, 128, batch=1, heads=2, kv_heads=2, seqlen=333, seed=6)
    flash_attn_func(*args, config=GLUON, **kw)  # compiled, and this shape's table made
    other, okw = make_inputs("fp8", 128, 128, batch=1, heads=2, kv_heads=2, seqlen=4444, seed=6)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="make one call of this shape before CUDA graph capture"):
        with torch.cuda.graph(graph):
            flash_attn_func(*other, config=GLUON, **okw)


def test_cuda_graph_capture():
    args, kw = make_inputs("fp8", 128, 128, batch=1, heads=8, kv_heads=2, seqlen=777, seed=4)
    eager = flash_attn_func(*args, config=GLUON, **kw)  # compile outside the capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        flash_attn_func(*args, config=GLUON, **kw)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = flash_attn_func(*args, config=GLUON, **kw)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static, eager)


def test_dispatcher_runs_a_gluon_winner(tmp_path, monkeypatch):
    """A database whose fastest entry for the shape is a Gluon kernel: flash_attn_func runs it (no
    code chooses backends; the faster stored entry wins)."""
    dispatch_from(tmp_path, monkeypatch, ((default_config("fp8", 128, 128), 0.2), (GLUON, 0.1)), 2, 2048)
    args, kw = make_inputs("fp8", 128, 128, batch=2, heads=8, kv_heads=8, seqlen=2000, seed=9)
    choice = explain(*args, **kw)
    assert choice.source == "exact" and choice.config == GLUON
    assert torch.equal(flash_attn_func(*args, **kw), flash_attn_func(*args, config=GLUON, **kw))


def test_dispatcher_natural_winner_with_k_major_v(tmp_path, monkeypatch):
    """A natural-V winner (one launch: what short sequences pick) given a K-major V runs its transposed
    twin, which reads V as stored: explain says so, no V copy is made, and the output is bitwise
    the natural kernel's on V as given."""
    natural = CONFIGS["natural"]
    dispatch_from(tmp_path, monkeypatch, ((natural, 0.01),), 1, 512)
    args, kw = make_inputs("fp8", 128, 128, batch=1, heads=8, kv_heads=8, seqlen=500, seed=10)
    km_args, km_kw = make_inputs("fp8", 128, 128, batch=1, heads=8, kv_heads=8, seqlen=500, seed=10, v_layout="k_major")
    assert explain(*args, **kw).config == natural
    twin = explain(*km_args, **km_kw)
    assert twin.config == natural.replace(v_layout="transposed") and "K-major" in twin.detail
    expected = flash_attn_func(*args, **kw)
    api._plans.clear()
    assert torch.equal(flash_attn_func(*km_args, **km_kw), expected)
    plans = list(api._plans.values())
    assert len(plans) == 1 and plans[0].launch.transpose is None  # V's own bytes: no copy per call
    assert torch.equal(flash_attn_func(*km_args, **km_kw), expected)  # and through the plan


#: key-relabelling kernels whose relabelling can move to K (k_perm): the dispatcher's 16K exact pick (256
#: keys, two P tiles, ping-pong, producer 56), the same with a halved first block, the seed (float32 carry,
#: 128 keys), 192-key blocks (two K boxes), lean P on f16 scores, and hd64 / 192-128 / 256
K_PERM = {
    "256-pick": gluon_smem2_config("fp8", 128, 128).replace(
        half_block=False, ping_pong=True, producer_regs=56, skip_rescale=True, p_scale_log2=7, lane_sums=False
    ),
    "smem2-half": gluon_smem2_config("fp8", 128, 128),
    "seed": GLUON,
    "split": CONFIGS["split-mma-skip"],
    "lean-f16": gluon_lean_smem2_config("fp8", 128, 128).replace(qk_acc="f16", p_scale_log2=8),
    "hd64": PACKED["64-three"],
    "192/128": PACKED["192/128"],
    "hd256": gluon_defer_config("fp8", 256, 256),
}


#: (seqlen_q, seqlen_k, causal) with Sk a multiple of 16: one group, ragged causal, non-causal with more keys, 4K
K_PERM_SHAPES = [(16, 16, True), (1008, 1008, True), (304, 1104, False), (4096, 4096, True)]


@pytest.mark.parametrize("name", K_PERM)
@pytest.mark.parametrize("sq,sk,causal", K_PERM_SHAPES)
def test_k_perm_reads_k_major_v_as_stored(name, sq, sk, causal, monkeypatch):
    """k_perm: the keys relabelled on K's tile rows (a 5-D TMA box) instead of on the V^T copy, so a K-major V
    is read as stored. Checked against float64 (and FA3's error) like its twin, which it matches within the
    order of the row sums' and the PV products' adds; no V^T copy is made."""
    from zyfa_tune.kernels import transpose

    cfg = K_PERM[name]
    lean = cfg.softmax == "lean"
    bound, factor = LEAN_BOUNDS["fma"] if lean else (FP8_BOUND, 1.1)
    d, dv = cfg.head_dim_qk, cfg.head_dim_v
    args, kw = make_inputs(
        "fp8", d, dv, batch=2, heads=4, kv_heads=2, seqlen=sq, seqlen_k=sk, seed=11, v_layout="k_major"
    )
    ref = attention_reference(*args, causal=causal, **kw)
    twin = flash_attn_func(*args, causal=causal, config=cfg, **kw)  # forced: the permuted V^T copy
    copies = []
    real_launch = transpose._launch
    monkeypatch.setattr(transpose, "_launch", lambda *a: copies.append(a) or real_launch(*a))
    api._plans.clear()
    for _ in range(2):  # the checked path, then the plan's fast path
        out = flash_attn_func(*args, causal=causal, config=cfg.replace(k_perm=True), **kw)
        assert torch.isfinite(out).all()
        err = rel_l2(out, ref)
        assert err < bound, f"rel L2 {err:.3e}"
        assert rel_l2(out, twin) < (2e-2 if lean else 5e-3), rel_l2(out, twin)
    assert not copies, "a V^T copy was made for a K-major V"
    plans = list(api._plans.values())
    assert len(plans) == 1 and plans[0].launch.transpose is None  # V's own bytes on the fast path too
    theirs = (
        fa3_error(
            *make_inputs("fp8", d, dv, batch=2, heads=4, kv_heads=2, seqlen=sq, seqlen_k=sk, seed=11), ref, causal
        )
        if min(sq, sk) >= 128 and (d, dv) == (128, 128)
        else None
    )
    print(f" k_perm {err:.4e} twin {rel_l2(twin, ref):.4e}" + (f" FA3 {theirs:.4e}" if theirs else ""), end="")
    if theirs is not None:
        assert err <= factor * theirs


def test_dispatcher_picks_the_k_perm_twin_for_k_major_v(tmp_path, monkeypatch):
    """A key-relabelling winner given a K-major V runs its k_perm twin where Sk % 16 == 0 (explain says so)
    and itself elsewhere; with V as given it runs itself."""
    win = K_PERM["256-pick"]
    dispatch_from(tmp_path, monkeypatch, ((win, 0.05),), 1, 2048)
    for sk, twin in ((2048, True), (2040, False)):
        args, kw = make_inputs("fp8", 128, 128, batch=1, heads=8, kv_heads=8, seqlen=sk, seed=12)
        km_args, km_kw = make_inputs(
            "fp8", 128, 128, batch=1, heads=8, kv_heads=8, seqlen=sk, seed=12, v_layout="k_major"
        )
        assert explain(*args, **kw).config == win
        choice = explain(*km_args, **km_kw)
        assert choice.config == (win.replace(k_perm=True) if twin else win), choice
        out = flash_attn_func(*km_args, **km_kw)
        ref = attention_reference(*km_args, **km_kw)
        assert rel_l2(out, ref) < FP8_BOUND
        assert rel_l2(out, flash_attn_func(*args, **kw)) < 5e-3
