"""`explain` on meta tensors: which kernel a shape would get, with no GPU, no memory and no launch.

The dispatcher reads only the shipped H200 database here (kernels/tuned/h200.db), so the answers
do not depend on the user's own databases.
"""

from __future__ import annotations

import pytest
import torch

from zyfa_tune import api, explain
from zyfa_tune.db import ProblemKey
from zyfa_tune.kernels import dispatch

H200 = "NVIDIA H200"
FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16


@pytest.fixture(autouse=True)
def shipped_only(monkeypatch):
    monkeypatch.setattr(dispatch, "_dispatcher", dispatch.Dispatcher([dispatch.TUNED_DIR / "h200.db"]))

    def no_launch(*args, **kwargs):
        raise AssertionError("explain launched a kernel")

    monkeypatch.setattr(api, "bind", no_launch)


def meta(b=4, s=16384, h=8, hk=8, dqk=128, dv=128, dtype=BF16):
    return tuple(torch.empty(b, s, n, d, dtype=dtype, device="meta") for n, d in ((h, dqk), (hk, dqk), (hk, dv)))


def test_meta_shape_gets_its_tuned_kernel():
    choice = explain(*meta(), gpu=H200)
    assert choice.source == "exact" and choice.database.endswith("h200.db")
    assert choice.key == ProblemKey.from_shape(
        dtype="bf16", head_dim_qk=128, head_dim_v=128, causal=True, batch=4, heads=8, kv_heads=8, seqlen=16384
    )
    assert (choice.config.dtype, choice.config.head_dim_qk, choice.config.head_dim_v) == ("bf16", 128, 128)
    assert choice.tuned_on == H200


def test_another_gpu_and_an_untuned_shape():
    with pytest.warns(RuntimeWarning, match="tuned on NVIDIA H200"):
        assert explain(*meta(), gpu="NVIDIA H100 80GB HBM3").source == "other-device"
    assert explain(*meta(b=8, s=3000), gpu=H200).source == "nearest"  # bucket 4096 at B*H 64: not tuned


def test_meta_k_major_fp8_v_gets_the_k_perm_twin():
    """A keys-fastest FP8 V (as quantize_fp8(..., v_layout="k_major") stores it) is recognised from its
    strides alone: the tuned key-relabelling Gluon kernel runs its k_perm twin, and explain says why."""
    q, k, v = meta(dtype=FP8)
    v_km = torch.empty(4, 8, 128, 16384, dtype=FP8, device="meta").permute(0, 3, 1, 2)
    natural = explain(q, k, v, gpu=H200)
    assert natural.config.backend == "gluon" and natural.config.v_permute and not natural.config.k_perm
    twin = explain(q, k, v_km, gpu=H200)
    assert twin.config == natural.config.replace(k_perm=True) and "k_perm twin" in twin.detail
    odd = explain(q[:, :1000], k[:, :1000], v_km[:, :1000], gpu=H200)  # 1000 keys: not a multiple of 16
    assert not odd.config.k_perm


def test_meta_arguments_are_checked():
    q, k, v = meta()
    with pytest.raises(TypeError, match="^k: dtype torch.float8_e4m3fn differs from q's torch.bfloat16"):
        explain(q, k.to(FP8), v, gpu=H200)
    with pytest.raises(ValueError, match="^q: head_dim: 84 is not a head dim"):
        explain(*meta(dqk=84), gpu=H200)
    with pytest.raises(ValueError, match="^softmax_scale"):
        explain(q, k, v, softmax_scale=-1.0, gpu=H200)
    with pytest.raises(TypeError, match="^gpu: expected a GPU name"):
        explain(q, k, v, gpu=9.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the current GPU answers when there is one")
def test_no_gpu_named_and_none_visible():
    with pytest.raises(ValueError, match="^gpu: tensors on meta name no GPU"):
        explain(*meta())
