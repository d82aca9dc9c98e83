"""Packed sequences, windows and LSE on the CPU: argument checks of flash_attn_varlen_func and the new
options of flash_attn_func, what reaches the launcher (the launch replaced by a recorder), the
launcher's arguments, and the serving variant of the Triton kernel compiled for sm_90a.

GPU runs against float64 are in tests/test_gpu_varlen.py."""

from __future__ import annotations

import contextlib

import pytest
import torch

import zyfa_tune.varlen as varlen
from zyfa_tune import api, flash_attn_func, flash_attn_varlen_func
from zyfa_tune.generator import HOPPER, emit
from zyfa_tune.generator.build import compile_for_target
from zyfa_tune.generator.defaults import default_config
from zyfa_tune.kernels import launch
from zyfa_tune.kernels.launch import Serving

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
CFG = default_config("bf16", 64, 64)
GLUON = default_config("fp8", 128, 128, "gluon")


def cu(*lengths: int) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def packed(lq=(3, 0, 5), lk=(4, 1, 5), h=4, hk=2, d=64, dtype=BF16):
    q = torch.randn(sum(lq), h, d).to(dtype)
    k = torch.randn(sum(lk), hk, d).to(dtype)
    v = torch.randn(sum(lk), hk, d).to(dtype)
    return q, k, v, cu(*lq), cu(*lk), max(lq), max(lk)


def call(*args, **kw):
    return flash_attn_varlen_func(*args, **kw)


# ---- argument checks (CPU tensors reach every one; the device is checked last) ---------------------


def test_valid_packed_arguments_reach_the_device_check():
    with pytest.raises(ValueError, match="^q: tensor is on cpu"):
        call(*packed())


@pytest.mark.parametrize(
    "which,bad,exc,match",
    [
        (3, cu(3, 0, 5).long(), TypeError, "cu_seqlens_q: expected dtype torch.int32, got torch.int64"),
        (4, cu(4, 1, 5).view(1, 4), ValueError, r"cu_seqlens_k: expected 1 dim \(batch \+ 1,\)"),
        (3, [0, 3, 3, 8], TypeError, "cu_seqlens_q: expected an int32 torch.Tensor"),
        (3, torch.tensor([1, 3, 3, 8], dtype=torch.int32), ValueError, "cu_seqlens_q: must start at 0, got 1"),
        (
            4,
            torch.tensor([0, 4, 2, 10], dtype=torch.int32),
            ValueError,
            r"cu_seqlens_k: decreases at index 2 \(4 then 2\)",
        ),
        (3, torch.tensor([0, 3, 3, 7], dtype=torch.int32), ValueError, "cu_seqlens_q: ends at 7, but q holds 8 tokens"),
        (4, cu(4, 6), ValueError, "cu_seqlens_k: 3 entries, but cu_seqlens_q has 4"),
        (5, 4, ValueError, "max_seqlen_q: 4 is less than sequence 2's length 5"),
        (6, 1, ValueError, "max_seqlen_k: 3 sequences of at most 1 tokens cannot hold k's 10 tokens"),
        (5, 5.0, TypeError, r"max_seqlen_q: expected an int >= 0, got 5.0"),
        (6, -1, TypeError, "max_seqlen_k: expected an int >= 0"),
    ],
)
def test_bad_cumulative_lengths_and_max_seqlens_are_named(which, bad, exc, match):
    args = list(packed())
    args[which] = bad
    with pytest.raises(exc, match=f"^{match}"):
        call(*args)


def test_packed_tensors_are_3d_and_related():
    q, k, v, *rest = packed()
    with pytest.raises(ValueError, match=r"^q: expected 3 dims \(total_tokens, heads, head_dim\)"):
        call(q[None], k, v, *rest)
    with pytest.raises(ValueError, match=r"^v: shape \(9, 2, 64\) must match k's \(total_k, kv_heads\) = \(10, 2\)"):
        call(q, k, v[1:], *rest)
    with pytest.raises(ValueError, match="^k: kv_heads=3 must divide q's heads=4"):
        call(q, torch.randn(10, 3, 64).to(BF16), torch.randn(10, 3, 64).to(BF16), *rest)


def test_descales_are_per_sequence_and_kv_head():
    q, k, v, *rest = packed(dtype=FP8)
    with pytest.raises(ValueError, match=r"^k_descale: expected shape \(batch, kv_heads\) = \(3, 2\), got \(4, 2\) "):
        call(q, k, v, *rest, k_descale=torch.ones(4, 2))
    bad = torch.ones(3, 2)
    bad[2, 1] = 0.0
    with pytest.raises(ValueError, match=r"^v_descale: descales must be finite and positive.*\(2, 1\)"):
        call(q, k, v, *rest, v_descale=bad)
    with pytest.raises(ValueError, match="^q: tensor is on cpu"):
        call(q, k, v, *rest, q_descale=torch.ones(3, 2))


@pytest.mark.parametrize("fn", ["dense", "varlen"])
@pytest.mark.parametrize(
    "kw,exc,match",
    [
        (
            dict(window_size=(-2, 0)),
            ValueError,
            r"window_size: each side must be >= 0, or -1 for unbounded; got \(-2, 0\)",
        ),
        (dict(window_size=(4, -3)), ValueError, "window_size: each side must be >= 0"),
        (dict(window_size=(4.0, 0)), TypeError, r"window_size: expected a pair of ints \(left, right\)"),
        (dict(window_size=4), TypeError, "window_size: expected a pair of ints"),
        (dict(window_size=(True, 0)), TypeError, "window_size: expected a pair of ints"),
        (dict(return_lse=1), TypeError, "return_lse: expected bool, got int"),
    ],
)
def test_option_checks_name_the_argument(fn, kw, exc, match):
    if fn == "dense":
        q, k, v = (torch.randn(2, 16, 2, 128).to(FP8) for _ in range(3))
        call_it = lambda: flash_attn_func(q, k, v, **kw)  # noqa: E731
    else:
        args = packed(d=128, dtype=FP8)
        call_it = lambda: call(*args, **kw)  # noqa: E731
    with pytest.raises(exc, match=f"^{match}" if fn == "dense" else match):
        call_it()


def test_a_gluon_config_runs_packed_sequences_an_lse_and_windows():
    for lse in (False, True):  # (no refusal of the Gluon config: its kernels write the LSE)
        with pytest.raises(ValueError, match="^q: tensor is on cpu"):
            call(*packed(d=128, dtype=FP8), config=GLUON, return_lse=lse)
        with pytest.raises(ValueError, match="^q: tensor is on cpu"):
            flash_attn_func(*(torch.randn(2, 16, 2, 128).to(FP8) for _ in range(3)), config=GLUON, return_lse=lse)
    q, k, v = (torch.randn(2, 16, 2, 128).to(FP8) for _ in range(3))
    for window in ((-1, -1), (-1, 5), (8, 0), (3, 4)):  # (its window twin takes any window)
        with pytest.raises(ValueError, match="^q: tensor is on cpu"):
            flash_attn_func(q, k, v, window_size=window, config=GLUON)
        with pytest.raises(ValueError, match="q: tensor is on cpu"):
            call(*packed(d=128, dtype=FP8), config=GLUON, window_size=window)


# ---- what reaches the launcher ------------------------------------------------------------------


class Recorder:
    """Stands in for `launch.bind` and the BoundLaunch it returns, recording both."""

    def __init__(self):
        self.checked: list[dict] = []
        self.fast: list[tuple] = []

    def bind(self, config, q, k, v, out, scale, causal, qd, kd, vd, serving=None):
        self.checked.append(dict(config=config, q=q, out=out, causal=causal, descales=(qd, kd, vd), serving=serving))
        return self.launch

    def launch(self, q, k, v, out, qd, kd, vd, extra=()):
        self.fast.append((q, k, v, out, qd, kd, vd, extra))
        return out

    def bind_packed(self, config, q, k, v, out, scale, causal, descales, cu, maxes, lse=None, window=None):
        self.checked.append(
            dict(config=config, q=q, out=out, causal=causal, descales=descales, cu=cu, maxes=maxes, lse=lse)
            | dict(window=window)
        )
        return self.packed_launch

    def packed_launch(self, q, k, v, out, qd, kd, vd, cu_q=None, cu_k=None):
        self.fast.append((q, k, v, out, qd, kd, vd, (cu_q, cu_k)))
        return out


@pytest.fixture
def rec(monkeypatch):
    r = Recorder()
    monkeypatch.setattr(api, "_on_cuda", lambda name, t: None)  # CPU tensors stand in for CUDA ones
    monkeypatch.setattr(api, "bind", r.bind)
    monkeypatch.setattr(varlen, "bind", r.bind)
    monkeypatch.setattr(varlen, "bind_packed", r.bind_packed)
    monkeypatch.setattr(api.torch.cuda, "current_device", lambda: None)
    monkeypatch.setattr(api.torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(api, "_plans", {})
    monkeypatch.setattr(api, "_values_checked", set())
    return r


def test_varlen_launch_gets_the_packed_view_and_its_options(rec):
    q, k, v, cq, ck, mq, mk = packed()
    out = call(q, k, v, cq, ck, mq, mk, config=CFG)
    (first,) = rec.checked
    s = first["serving"]
    assert first["q"].shape == (1, 8, 4, 64) and first["out"].data_ptr() == out.data_ptr()
    assert s.cu_seqlens_q is cq and s.cu_seqlens_k is ck and s.max_seqlen_q == 5
    assert s.window is None and s.lse is None and first["causal"] is True
    assert out.shape == (8, 4, 64) and out.dtype == BF16


def test_second_varlen_call_takes_the_fast_path_with_new_lengths(rec):
    args = packed()
    call(*args, config=CFG, return_lse=True)
    q, k, v, _, _, mq, mk = packed()
    cq2, ck2 = cu(5, 3, 0), cu(5, 5, 0)  # other lengths, same layout
    out, lse = call(q, k, v, cq2, ck2, mq, mk, config=CFG, return_lse=True)
    assert len(rec.checked) == 1 and len(rec.fast) == 1
    fq, fk, fv, fout, *_, extra = rec.fast[0]
    assert fq is q and fout is out and extra[0] is cq2 and extra[1] is ck2 and extra[2] is lse
    assert lse.shape == (4, 8) and lse.dtype == torch.float32
    call(q, k, v, cq2, ck2, 6, mk, config=CFG, return_lse=True)  # another max_seqlen: another layout
    assert len(rec.checked) == 2


def test_window_bounds_reach_the_kernel_resolved(rec):
    q, k, v, cq, ck, mq, mk = packed()
    call(q, k, v, cq, ck, mq, mk, config=CFG, window_size=(3, 7))  # causal: right becomes 0
    call(q, k, v, cq, ck, mq, mk, config=CFG, causal=False, window_size=(-1, 2))  # left unbounded
    causal_window, right_only = (c["serving"] for c in rec.checked)
    assert causal_window.window == (3, 0) and rec.checked[0]["causal"] is False  # the window bounds it
    assert right_only.window == (10, 2)  # total_k: no key lies further left


def test_dense_options_use_the_serving_variant_only_when_asked(rec):
    q, k, v = (torch.randn(2, 16, 4, 64).to(BF16) for _ in range(3))
    plain = flash_attn_func(q, k, v, config=CFG)
    assert rec.checked[-1]["serving"] is None and isinstance(plain, torch.Tensor)
    out, lse = flash_attn_func(q, k, v, config=CFG, return_lse=True)
    s = rec.checked[-1]["serving"]
    assert s.lse is lse and lse.shape == (2, 4, 16) and s.window is None and s.cu_seqlens_q is None
    out2, lse2 = flash_attn_func(q, k, v, config=CFG, return_lse=True)  # the fast path, a fresh LSE
    assert len(rec.checked) == 2 and rec.fast[-1][-1] == (None, None, lse2, None, None) and lse2 is not lse
    flash_attn_func(q, k, v, config=CFG, causal=False, window_size=(4, 4))
    assert rec.checked[-1]["serving"].window == (4, 4) and rec.checked[-1]["causal"] is False


def test_no_keys_gives_zeros_and_an_lse_of_minus_infinity(rec):
    q = torch.randn(5, 4, 64).to(BF16)
    k = v = torch.randn(0, 2, 64).to(BF16)
    out, lse = call(q, k, v, cu(2, 3), cu(0, 0), 3, 0, config=CFG, return_lse=True)
    assert rec.checked == [] and (out == 0).all() and (lse == float("-inf")).all() and lse.shape == (4, 5)


def test_the_dispatcher_s_gluon_choice_runs_packed_sequences_lses_and_windows(rec, monkeypatch):
    class Gluon:
        def config_for(self, *args):
            return GLUON

        def varlen_config_for(self, *args):
            return GLUON.replace(k_perm=True), True  # a packed-sequence entry: its twin without k_perm runs

    one = Gluon()  # (the dispatcher is part of a layout's key)
    monkeypatch.setattr(api.dispatch, "dispatcher", lambda: one)
    q, k, v, cq, ck, mq, mk = packed(d=128, dtype=FP8)
    out = call(q, k, v, cq, ck, mq, mk)
    _, lse = call(q, k, v, cq, ck, mq, mk, return_lse=True)
    call(q, k, v, cq, ck, mq, mk, window_size=(2, 0))
    q4, k4, v4 = (torch.randn(2, 16, 2, 128).to(FP8) for _ in range(3))
    _, lse4 = flash_attn_func(q4, k4, v4, return_lse=True)
    flash_attn_func(q4, k4, v4, window_size=(8, 0))
    flash_attn_func(q4, k4, v4, causal=False, window_size=(-1, 3))
    gluon, packed_lse, packed_window, dense_lse, dense_window, right_only = rec.checked
    assert gluon["config"] == GLUON and gluon["out"] is out and gluon["q"] is q  # packed (total, heads, dim)
    assert gluon["cu"] == (cq, ck) and gluon["maxes"] == (mq, mk) and gluon["causal"] is True
    assert gluon["lse"] is None and packed_lse["config"] == GLUON and packed_lse["lse"] is lse  # its LSE kernel
    assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32
    assert dense_lse["config"] == GLUON and dense_lse["serving"].lse is lse4 and dense_lse["serving"].window is None
    # windows: the Gluon kernels' window twins, the causal schedule kept (a causal window's right edge is 0)
    assert packed_window["config"] == GLUON and packed_window["window"] == (2, 0) and packed_window["causal"] is True
    assert dense_window["config"] == GLUON and dense_window["serving"].window == (8, 0) and dense_window["causal"]
    assert right_only["config"] == GLUON and right_only["serving"].window == (16, 3) and not right_only["causal"]
    call(q, k, v, cu(5, 3, 0), cu(5, 5, 0), mq, mk)  # the layout's fast path: the new lengths reach the launch
    assert len(rec.checked) == 6 and rec.fast[-1][-1][0].tolist() == [0, 5, 8, 8]


# ---- the launcher's arguments ---------------------------------------------------------------------


def test_prepare_sizes_the_grid_by_sequences_and_places_the_options():
    cfg = default_config("bf16", 64, 64).replace(loads="pointer")
    q, k, v, cq, ck, mq, mk = packed()
    out = torch.empty(1, 8, 4, 64, dtype=BF16)
    lse = torch.empty(4, 8)
    s = Serving(cq, ck, mq, (3, 0), lse)
    grid, args, options = launch.prepare(cfg, q[None], k[None], v[None], out, 0.1, False, serving=s)
    assert grid == (1 * 3 * 4,)  # ceil(5 / 64) query blocks x 3 sequences x 4 heads
    assert args[16] is cq and args[17] is ck and args[18] is lse  # after the descales
    assert args[19] is None and args[20] is None  # no page table, no cache lengths
    assert args[-5:] == (0, lse.stride(0), 3, 0, 0)  # stride_lb, stride_lh, WIN_L, WIN_R, stride_pt
    assert {k: options[k] for k in ("CAUSAL", "VARLEN", "WINDOW", "RETURN_LSE", "PAGED")} == dict(
        CAUSAL=False, VARLEN=True, WINDOW=True, RETURN_LSE=True, PAGED=False
    )
    with pytest.raises(ValueError, match="config: backend='gluon' runs packed sequences through kernels.gluon_varlen"):
        launch.prepare(GLUON, q[None], k[None], v[None], out, 0.1, True, serving=s)


# ---- the serving variant compiles -----------------------------------------------------------------

ALL = {"VARLEN": True, "WINDOW": True, "RETURN_LSE": True}


def test_the_plain_kernel_holds_none_of_the_serving_code():
    for cfg in (default_config("fp8", 128, 128), default_config("bf16", 96, 96), default_config("fp8", 40, 40)):
        plain, serving = emit(cfg).source, emit(cfg, serving=True).source
        assert "VARLEN" not in plain and "WIN_L" not in plain and "LSE" not in plain
        assert "VARLEN: tl.constexpr" in serving and plain != serving


@pytest.mark.parametrize(
    "name,cfg,flags",
    [
        ("fp8-128", default_config("fp8", 128, 128), ALL),
        ("fp8-128-natural", varlen.packed_twin(default_config("fp8", 128, 128)), ALL),
        ("fp8-128-lean", default_config("fp8", 128, 128).replace(softmax="lean", rowsum="rounded"), ALL),
        ("fp8-64-window-only", default_config("fp8", 64, 64), {"WINDOW": True}),
        ("fp8-40-pointer", api.serving_config(default_config("fp8", 40, 40)), ALL),
        ("fp8-104-pointer", api.serving_config(default_config("fp8", 104, 104)), ALL),
        ("fp8-256-natural", varlen.packed_twin(default_config("fp8", 256, 256)), ALL),
        ("bf16-128", default_config("bf16", 128, 128), ALL),
        ("bf16-64-lse-only", default_config("bf16", 64, 64), {"RETURN_LSE": True}),
    ],
)
def test_serving_variant_compiles_clean_for_sm90a(name, cfg, flags):
    """No spills, within shared memory, and the dtype's MMA (QGMMA for FP8, HGMMA for bf16)."""
    art = compile_for_target(emit(cfg, serving=True), causal=not flags.get("WINDOW"), serving=flags)
    assert art.spill_bytes == 0, f"{name}: {art.spill_bytes} bytes spilled"
    assert art.shared_bytes <= HOPPER.shared_memory_bytes
    fp8 = cfg.dtype == "fp8"
    assert art.count("QGMMA" if fp8 else "HGMMA") > 0 and art.count("HGMMA" if fp8 else "QGMMA") == 0
    assert ("math.log2" in art.ttgir) == bool(flags.get("RETURN_LSE"))  # the LSE only where asked
