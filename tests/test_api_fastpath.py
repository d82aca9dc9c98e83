"""The per-layout fast path of `flash_attn_func` (CPU: the launch is replaced by a recorder).

The fast path skips validation and dispatch for a call whose argument layout was already checked.
These tests pin what makes two calls "the same layout" (and so what can never skip a check), with
CPU tensors standing in for CUDA ones; the GPU tests (tests/test_gpu_dispatch.py) run it for real.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from zyfa_tune import api
from zyfa_tune.generator.defaults import default_config
from zyfa_tune.kernels import dispatch

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn


class Recorder:
    """Stands in for `launch.bind` (counts checked calls) and for the BoundLaunch it returns
    (counts fast calls); `bindable=False` makes bind report a layout with no fast path."""

    def __init__(self, bindable: bool = True):
        self.bindable = bindable
        self.checked: list[tuple] = []
        self.fast: list[tuple] = []

    def bind(self, config, q, k, v, out, scale, causal, qd, kd, vd):
        self.checked.append((config, q, k, v, scale, causal, qd, kd, vd))
        return self.launch if self.bindable else None

    def launch(self, q, k, v, out, qd, kd, vd):
        self.fast.append((q, k, v, out, qd, kd, vd))
        return out


@pytest.fixture
def rec(monkeypatch):
    r = Recorder()
    monkeypatch.setattr(api, "_on_cuda", lambda name, t: None)  # CPU tensors stand in for CUDA ones
    monkeypatch.setattr(api, "bind", r.bind)
    monkeypatch.setattr(api.torch.cuda, "current_device", lambda: None)  # a CPU device's index
    monkeypatch.setattr(api.torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(api, "_plans", {})
    monkeypatch.setattr(api, "_values_checked", set())
    return r


def qkv(b=2, s=16, h=4, hk=2, d=64, dtype=BF16):
    return (torch.randn(b, s, h, d).to(dtype), torch.randn(b, s, hk, d).to(dtype), torch.randn(b, s, hk, d).to(dtype))


CFG = default_config("bf16", 64, 64)
CFG8 = default_config("fp8", 64, 64)


def test_second_call_with_same_layout_skips_the_checks(rec):
    q, k, v = qkv()
    out1 = api.flash_attn_func(q, k, v, config=CFG)
    assert len(rec.checked) == 1 and rec.fast == []
    q2, k2, v2 = qkv()  # new data, same layout
    out2 = api.flash_attn_func(q2, k2, v2, config=CFG)
    assert len(rec.checked) == 1 and len(rec.fast) == 1
    fq, fk, fv, fout, *ds = rec.fast[0]
    assert fq is q2 and fk is k2 and fv is v2 and ds == [None, None, None]
    assert fout is out2 and out2.shape == out1.shape == (2, 16, 4, 64) and out2.dtype == BF16


@pytest.mark.parametrize("change", ["shape", "stride", "dtype", "scale", "causal", "config", "kv_heads"])
def test_any_layout_change_takes_the_checked_path(rec, change):
    q, k, v = qkv()
    api.flash_attn_func(q, k, v, config=CFG)
    kw: dict = dict(config=CFG)
    if change == "shape":
        q, k, v = qkv(s=32)
    elif change == "stride":  # last dim contiguous, heads strided: a valid, different layout
        q = torch.randn(2, 16, 8, 64).to(BF16)[:, :, ::2]
    elif change == "dtype":
        q, k, v = qkv(dtype=FP8)
        kw["config"] = CFG8
    elif change == "scale":
        kw["softmax_scale"] = 0.5
    elif change == "causal":
        kw["causal"] = False
    elif change == "config":
        kw["config"] = CFG.replace(num_stages=3)
    elif change == "kv_heads":
        q, k, v = qkv(hk=4)
    api.flash_attn_func(q, k, v, **kw)
    assert len(rec.checked) == 2 and rec.fast == []


def test_values_equal_to_a_planned_one_are_still_type_checked(rec):
    q, k, v = qkv()
    api.flash_attn_func(q, k, v, softmax_scale=1.0, causal=True, config=CFG)
    with pytest.raises(TypeError, match="^causal: expected bool"):
        api.flash_attn_func(q, k, v, softmax_scale=1.0, causal=1, config=CFG)  # 1 == True, hash equal
    with pytest.raises(ValueError, match="^softmax_scale"):
        api.flash_attn_func(q, k, v, softmax_scale=True, causal=True, config=CFG)  # True == 1.0
    assert rec.fast == []


def test_unaligned_pointer_takes_the_checked_path(rec):
    q, k, v = qkv(dtype=FP8)
    api.flash_attn_func(q, k, v, config=CFG8)
    flat = torch.empty(q.numel() + 1, dtype=torch.uint8).view(FP8)
    q_odd = flat[1:].view(q.shape)  # same shape and strides, pointer off by one byte
    assert q_odd.stride() == q.stride() and q_odd.data_ptr() % 16
    api.flash_attn_func(q_odd, k, v, config=CFG8)
    assert len(rec.checked) == 2 and rec.fast == []


def test_descales_are_part_of_the_layout(rec):
    q, k, v = qkv(dtype=FP8)
    d = torch.ones(2, 2)
    api.flash_attn_func(q, k, v, q_descale=d, config=CFG8)  # k, v descales stand in as ones
    _, _, _, _, _, _, qd, kd, vd = rec.checked[0]
    assert qd is d and kd is vd and torch.equal(kd, torch.ones(2, 2))
    d2 = torch.full((2, 2), 2.0)
    api.flash_attn_func(q, k, v, q_descale=d2, config=CFG8)
    assert len(rec.fast) == 1
    assert rec.fast[0][4] is d2 and rec.fast[0][5] is kd and rec.fast[0][6] is vd  # the plan's ones
    api.flash_attn_func(q, k, v, config=CFG8)  # no descales: another layout
    api.flash_attn_func(q, k, v, q_descale=d.double(), config=CFG8)  # converted: never planned
    api.flash_attn_func(q, k, v, q_descale=d.double(), config=CFG8)
    assert len(rec.checked) == 4 and len(rec.fast) == 1


def test_no_plan_when_bind_declines(rec):
    rec.bindable = False
    q, k, v = qkv()
    for _ in range(3):
        api.flash_attn_func(q, k, v, config=CFG)
    assert len(rec.checked) == 3 and rec.fast == []


def test_non_contiguous_last_dim_is_copied_and_never_planned(rec):
    q, k, v = qkv()
    qt = q.transpose(-1, -2).contiguous().transpose(-1, -2)  # same values, last dim strided
    for _ in range(2):
        api.flash_attn_func(qt, k, v, config=CFG)
    assert len(rec.checked) == 2 and rec.fast == []
    assert rec.checked[0][1] is not qt and torch.equal(rec.checked[0][1], qt)


def test_new_database_layers_invalidate_plans(rec, monkeypatch):
    q, k, v = qkv()
    api.flash_attn_func(q, k, v, config=CFG)
    monkeypatch.setattr(dispatch, "_dispatcher", None)  # what set_databases does
    api.flash_attn_func(q, k, v, config=CFG)
    assert len(rec.checked) == 2 and rec.fast == []


def test_bad_arguments_never_reach_a_plan(rec):
    q, k, v = qkv()
    api.flash_attn_func(q, k, v, config=CFG)
    with pytest.raises(TypeError, match="^k: expected a torch.Tensor"):
        api.flash_attn_func(q, [1], v, config=CFG)
    with pytest.raises(TypeError, match="^config: expected a KernelConfig"):
        api.flash_attn_func(q, k, v, config="bm64")
    assert rec.fast == []


def test_plan_cache_is_bounded(rec, monkeypatch):
    monkeypatch.setattr(api, "_PLAN_LIMIT", 3)
    for s in range(1, 6):
        api.flash_attn_func(*qkv(s=s), config=CFG)
    assert len(api._plans) <= 3


def test_descale_values_are_read_on_a_layouts_first_call_and_under_validate(rec, monkeypatch):
    """Reading CUDA descales costs a device synchronisation: only the first checked call of a layout
    and calls with validate=True read them; the fast path never does (a NaN then goes to the kernel,
    as documented), nor do later checked calls of a layout without a plan."""
    reads = []
    real = api._check_descale_values

    def recording(named, on_cuda, problems):
        reads.append(on_cuda)
        real(named, on_cuda, problems)

    monkeypatch.setattr(api, "_check_descale_values", recording)
    q, k, v = qkv(dtype=FP8)
    d = torch.ones(2, 2)
    api.flash_attn_func(q, k, v, q_descale=d, config=CFG8)
    api.flash_attn_func(q, k, v, q_descale=torch.full((2, 2), float("nan")), config=CFG8)
    assert reads == [True] and len(rec.checked) == 1 and len(rec.fast) == 1
    api.flash_attn_func(q, k, v, q_descale=d, config=CFG8, validate=True)
    assert reads == [True, True] and len(rec.checked) == 2 and len(rec.fast) == 1
    with pytest.raises(ValueError, match="^q_descale: descales must be finite and positive"):
        api.flash_attn_func(q, k, v, q_descale=torch.full((2, 2), -1.0), config=CFG8, validate=True)
    rec.bindable = False
    for _ in range(3):  # another layout (k's descale given), no plan: the checked path each call
        api.flash_attn_func(q, k, v, k_descale=d, config=CFG8)
    assert reads[3:] == [True, False, False] and len(rec.fast) == 1


@pytest.mark.parametrize("validate", [1, 0, None, "yes"])
def test_validate_must_be_bool(rec, validate):
    q, k, v = qkv()
    api.flash_attn_func(q, k, v, config=CFG)
    with pytest.raises(TypeError, match="^validate: expected bool"):
        api.flash_attn_func(q, k, v, config=CFG, validate=validate)
