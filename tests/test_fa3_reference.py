"""The tuner's error gate calls FA3 as the bench's FA3 peer does: a width FA3 has no kernel for (or refuses,
as FP8 widths not of 16s) runs zero-padded to FA3's next head dim at the true width's softmax scale. A fake
`fa3_fwd_interface` that refuses such widths and otherwise computes the float64 reference stands in for FA3."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from zyfa_tune.generator.config import COMMON_HEAD_DIMS
from zyfa_tune.tuning.fa3 import fa3_width
from zyfa_tune.tuning.packed import packed_reference_error
from zyfa_tune.tuning.reference import attention_reference, attention_reference_varlen
from zyfa_tune.tuning.verify import reference_error


def _refuse(width: int) -> None:
    if width not in COMMON_HEAD_DIMS:
        raise RuntimeError(f"head_size {width}: no kernel")


def _fa3_func(q, k, v, causal=True, softmax_scale=None, **descales):
    _refuse(q.shape[-1]), _refuse(v.shape[-1])
    return attention_reference(q, k, v, causal=causal, softmax_scale=softmax_scale, **descales).float(), None


def _fa3_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, softmax_scale=None, **descales):
    _refuse(q.shape[-1]), _refuse(v.shape[-1])
    out = attention_reference_varlen(q, k, v, cu_q, cu_k, causal=causal, softmax_scale=softmax_scale, **descales)
    return out.float(), None


@pytest.fixture
def fake_fa3(monkeypatch):
    module = types.ModuleType("fa3_fwd_interface")
    module.flash_attn_func, module.flash_attn_varlen_func = _fa3_func, _fa3_varlen
    monkeypatch.setitem(sys.modules, "fa3_fwd_interface", module)


def test_fa3_width_is_the_smallest_shipped_width_that_holds_the_columns():
    assert [fa3_width(d) for d in (32, 64, 72, 80, 112, 128, 160, 200, 256)] == [
        64,
        64,
        96,
        96,
        128,
        128,
        192,
        256,
        256,
    ]


@pytest.mark.parametrize("dqk,dv", [(72, 72), (112, 112), (160, 128), (128, 128)])
def test_dense_reference_error_runs_fa3_padded_at_the_true_scale(fake_fa3, dqk, dv):
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 40, 2, dqk, generator=g) for _ in range(2))
    v = torch.randn(1, 40, 2, dv, generator=g)
    reference = attention_reference(q, k, v, causal=True)
    assert reference_error("fp8", (q, k, v), {}, True, reference, fa3=True) < 1e-6


def test_packed_reference_error_runs_fa3_padded_at_the_true_scale(fake_fa3):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(50, 2, 72, generator=g) for _ in range(3))
    cu = torch.tensor([0, 20, 50], dtype=torch.int32)
    reference = attention_reference_varlen(q, k, v, cu, cu, causal=True)
    assert packed_reference_error("fp8", (q, k, v), {}, cu, 30, True, reference, True) < 1e-6
