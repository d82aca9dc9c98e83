"""flash_attn_func argument validation, and quantize_fp8 / hadamard_matrix, on the CPU.

flash_attn_func checks every argument before it checks the device, and reports every problem in one
error (each line naming its argument, the first problem's exception type, the device last). So on a
machine without a GPU, plain CPU tensors reach every argument check; the fixture `cpu_ok` (CPU
tensors accepted as if on a CUDA device, the launch replaced by a failure) is needed only by the tests
that go past validation.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest
import torch

import zyfa_tune.api as api
from zyfa_tune import dequantize_fp8, flash_attn_func, hadamard_matrix, quantize_fp8
from zyfa_tune.generator import KernelConfig
from zyfa_tune.tuning.reference import rel_l2

FP8 = torch.float8_e4m3fn
BF16 = torch.bfloat16


def qkv(b=2, sq=16, sk=16, h=4, hk=2, dqk=64, dv=64, dtype=BF16):
    q = torch.randn(b, sq, h, dqk).to(dtype)
    k = torch.randn(b, sk, hk, dqk).to(dtype)
    v = torch.randn(b, sk, hk, dv).to(dtype)
    return q, k, v


# ---- 1. reachable with CPU tensors: q's own checks, in order ---------------------------------


def test_q_not_a_tensor():
    _, k, v = qkv()
    for bad in (None, [[1.0]], np.zeros((1, 16, 4, 64), dtype=np.float32), 1.0):
        with pytest.raises(TypeError, match="^q: expected a torch.Tensor"):
            flash_attn_func(bad, k, v)


@pytest.mark.parametrize("shape", [(16, 4, 64), (1, 1, 16, 4, 64), (64,), ()])
def test_q_wrong_rank(shape):
    _, k, v = qkv()
    with pytest.raises(ValueError, match=r"^q: expected 4 dims"):
        flash_attn_func(torch.zeros(shape, dtype=BF16), k, v)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.float64, torch.int8, torch.float8_e5m2, torch.uint8]
)
def test_q_unsupported_dtype(dtype):
    _, k, v = qkv()
    with pytest.raises(TypeError, match=r"^q: dtype .* is not supported"):
        flash_attn_func(torch.zeros(1, 16, 4, 64, dtype=dtype), k, v)


@pytest.mark.parametrize("dtype", [BF16, FP8])
def test_cpu_tensors_rejected(dtype):
    q, k, v = qkv(dtype=dtype)
    with pytest.raises(ValueError, match=r"^q: tensor is on cpu; .*CUDA") as info:
        flash_attn_func(q, k, v)
    assert "\n" not in str(info.value)  # valid arguments: the device is the only problem
    meta = [torch.empty(t.shape, dtype=dtype, device="meta") for t in (q, k, v)]
    with pytest.raises(ValueError, match=r"^q: tensor is on meta"):
        flash_attn_func(*meta)


def test_all_problems_in_one_error_device_last():
    """A CPU user sees every problem with the arguments, in order, the device last (the first
    problem's exception type)."""
    q, k, v = qkv()
    with pytest.raises(TypeError) as info:
        flash_attn_func(q, k, v.to(FP8), softmax_scale=-1.0, causal=1)
    assert str(info.value).split("\n") == [
        "v: dtype torch.float8_e4m3fn differs from q's torch.bfloat16",
        "softmax_scale: expected a positive finite number, got -1.0",
        "causal: expected bool, got int",
        "q: tensor is on cpu; zyfa_tune kernels run on CUDA devices",
    ]
    with pytest.raises(TypeError, match="^k: expected a torch.Tensor, got str\nq: tensor is on cpu"):
        flash_attn_func(q, "not a tensor", v)
    with pytest.raises(ValueError, match="^q: expected 4 dims") as info:  # also a bad dtype: rank first
        flash_attn_func(torch.zeros(2, 3, dtype=torch.float32), k, v)
    assert "dtype" not in str(info.value) and "cpu" not in str(info.value)  # q's device is not looked at


# ---- 2. checks that relate the arguments (CPU tensors as they are), and past validation (cpu_ok) ----


@pytest.fixture
def cpu_ok(monkeypatch):
    """Accept CPU tensors as if they were on a CUDA device; the launch must never be reached."""
    monkeypatch.setattr(api, "_on_cuda", lambda name, t: None)

    def no_launch(*args, **kwargs):
        raise AssertionError("validation let bad arguments through to the launch")

    monkeypatch.setattr(api, "bind", no_launch)


def test_empty_query_returns_before_launch(cpu_ok):
    q, k, v = qkv(sq=0)
    out = flash_attn_func(q, k, v)
    assert out.shape == (2, 0, 4, 64) and out.dtype == BF16


def test_empty_keys_give_zeros(cpu_ok):
    q, k, v = qkv(sk=0, dv=128)
    out = flash_attn_func(q, k, v)
    assert out.shape == (2, 16, 4, 128) and out.dtype == BF16
    assert torch.count_nonzero(out) == 0


@pytest.mark.parametrize("which", ["k", "v"])
def test_dtype_mismatch(which):
    q, k, v = qkv()
    args = {"k": k, "v": v}
    args[which] = args[which].to(FP8)
    with pytest.raises(TypeError, match=rf"^{which}: dtype torch.float8_e4m3fn differs from q's torch.bfloat16"):
        flash_attn_func(q, **args)


def test_batch_mismatch():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"^k: batch 1 differs from q's 2"):
        flash_attn_func(q, k[:1], v[:1])
    with pytest.raises(ValueError, match=r"^v: batch 1 differs from q's 2"):
        flash_attn_func(q, k, v[:1])


@pytest.mark.parametrize("h,hk", [(4, 3), (3, 2), (5, 4), (2, 4)])
def test_kv_heads_must_divide_heads(h, hk):
    q, k, v = qkv(h=h, hk=hk)
    with pytest.raises(ValueError, match=rf"^k: kv_heads={hk} must divide q's heads={h}"):
        flash_attn_func(q, k, v)


def test_zero_kv_heads():
    q, k, v = qkv(hk=0)
    with pytest.raises(ValueError, match="^k: kv_heads=0"):
        flash_attn_func(q, k, v)


@pytest.mark.parametrize("dqk,dv,name", [(24, 24, "q"), (36, 36, "q"), (512, 64, "q"), (64, 20, "v"), (128, 264, "v")])
def test_unsupported_head_dim(dqk, dv, name):
    q, k, v = qkv(dqk=dqk, dv=dv)
    with pytest.raises(ValueError, match=rf"^{name}: head_dim: \d+ is not a head dim .* multiple of 8 from 32 to 256"):
        flash_attn_func(q, k, v)


def test_k_head_dim_mismatch():
    q, _, v = qkv(dqk=128)
    k = torch.zeros(2, 16, 2, 64, dtype=BF16)
    with pytest.raises(ValueError, match=r"^k: head_dim 64 differs from q's 128"):
        flash_attn_func(q, k, v)


@pytest.mark.parametrize("vshape", [(2, 15, 2, 64), (2, 16, 1, 64), (2, 16, 4, 64)])
def test_v_shape_mismatch(vshape):
    q, k, _ = qkv()
    with pytest.raises(ValueError, match=r"^v: shape .* must match k's \(batch, seqlen_k, kv_heads\)"):
        flash_attn_func(q, k, torch.zeros(vshape, dtype=BF16))


@pytest.mark.parametrize("scale", [0, 0.0, -1, -0.125, math.nan, math.inf, -math.inf, "x", True, False, [0.125]])
def test_bad_softmax_scale(scale):
    q, k, v = qkv()
    with pytest.raises((TypeError, ValueError), match="^softmax_scale: expected a positive finite number"):
        flash_attn_func(q, k, v, softmax_scale=scale)


@pytest.mark.parametrize("causal", [1, 0, "yes", None])
def test_causal_must_be_bool(causal):
    q, k, v = qkv()
    with pytest.raises(TypeError, match="^causal: expected bool"):
        flash_attn_func(q, k, v, causal=causal)


@pytest.mark.parametrize("which", ["q_descale", "k_descale", "v_descale"])
def test_descales_with_bf16(which):
    q, k, v = qkv()
    with pytest.raises(ValueError, match="descale.* apply to float8_e4m3fn inputs only"):
        flash_attn_func(q, k, v, **{which: torch.ones(2, 2)})


@pytest.mark.parametrize(
    "bad,exc,match",
    [
        (torch.ones(2, 4), ValueError, r"expected shape \(batch, kv_heads\) = \(2, 2\), got \(2, 4\)"),
        (torch.ones(2), ValueError, r"expected shape \(batch, kv_heads\)"),
        (torch.ones(2, 2, dtype=torch.int32), TypeError, "expected a floating dtype"),
        ([[1.0, 1.0], [1.0, 1.0]], TypeError, "expected a torch.Tensor of shape"),
        (torch.ones(2, 2, device="meta"), ValueError, "on meta, but q is on cpu"),
    ],
)
@pytest.mark.parametrize("which", ["q_descale", "k_descale", "v_descale"])
def test_bad_fp8_descales(which, bad, exc, match):
    q, k, v = qkv(dtype=FP8)
    with pytest.raises(exc, match=rf"^{which}: {match}"):
        flash_attn_func(q, k, v, **{which: bad})


def test_config_checks():
    q, k, v = qkv(dqk=128, dv=128, dtype=FP8)
    with pytest.raises(TypeError, match="^config: expected a KernelConfig"):
        flash_attn_func(q, k, v, config=KernelConfig().to_dict())
    with pytest.raises(ValueError, match="^config: built for bf16 128/128, inputs are fp8 128/128"):
        flash_attn_func(q, k, v, config=KernelConfig(dtype="bf16", p_scale_log2=0))
    with pytest.raises(ValueError, match="^config: built for fp8 64/64, inputs are fp8 128/128"):
        flash_attn_func(q, k, v, config=KernelConfig(head_dim_qk=64, head_dim_v=64))


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 0.0, -1.0, 1e-60])
@pytest.mark.parametrize("which", ["q_descale", "k_descale", "v_descale"])
def test_descale_values_are_checked_on_the_host(which, value):
    """Host descales are read as they are (no device to wait for): NaN, inf, zero and negative
    values are refused, and so is a float64 value that float32, what the kernels read, makes zero."""
    q, k, v = qkv(dtype=FP8)
    bad = torch.ones(2, 2, dtype=torch.float64)
    bad[1, 0] = value
    with pytest.raises(
        ValueError,
        match=rf"^{which}: descales must be finite and positive; 1 of 4 are not "
        rf"\(the first: .* at \(batch, kv_head\) = \(1, 0\)\)",
    ):
        flash_attn_func(q, k, v, **{which: bad})
    with pytest.raises(ValueError, match="^q: tensor is on cpu"):  # finite positive ones pass
        flash_attn_func(q, k, v, **{which: torch.full((2, 2), 1e-3)})


# ---- quantize_fp8 ----------------------------------------------------------------------------


def scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """(b, h, sq, sk) float64 QK^T with the GQA head mapping."""
    group = q.shape[2] // k.shape[2]
    kk = k.double().repeat_interleave(group, dim=2)
    return torch.einsum("bqhd,bkhd->bhqk", q.double(), kk)


@pytest.fixture
def inputs():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 64, 4, 128, generator=g)
    k = torch.randn(2, 48, 2, 128, generator=g) * 3.0
    v = torch.randn(2, 48, 2, 96, generator=g) * 0.01
    return q, k, v


def test_quantize_shapes_and_dtypes(inputs):
    q, k, v = inputs
    q8, k8, v8, qd, kd, vd = quantize_fp8(q, k, v)
    for x8, x in ((q8, q), (k8, k), (v8, v)):
        assert x8.shape == x.shape and x8.dtype == FP8
    for d in (qd, kd, vd):
        assert d.shape == (2, 2) and d.dtype == torch.float32 and d.is_contiguous()
        assert torch.all(d > 0)


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_quantize_round_trip(inputs, src_dtype):
    q, k, v = (x.to(src_dtype) for x in inputs)
    q8, k8, v8, qd, kd, vd = quantize_fp8(q, k, v)
    for x8, d, x in ((q8, qd, q), (k8, kd, k), (v8, vd, v)):
        deq, ref = dequantize_fp8(x8, d), x.double()
        assert rel_l2(deq, ref) < 0.07
        # elementwise: half an e4m3 ulp (2^-4 relative), or half the smallest subnormal (2^-10)
        scaled = ref / d.double().repeat_interleave(x.shape[2] // d.shape[1], dim=1).view(2, 1, -1, 1)
        err = (x8.double() - scaled).abs()
        assert torch.all(err <= torch.maximum(scaled.abs() * 2.0**-4, torch.full_like(err, 2.0**-10)) * (1 + 1e-6))
        # the largest magnitude of each (batch, kv head) group maps to the top of the e4m3 range
        group = x.shape[2] // d.shape[1]
        amax8 = x8.double().abs().view(2, x.shape[1], d.shape[1], group, -1).amax(dim=(1, 3, 4))
        assert torch.all(amax8 == 448.0)


def test_dequantize_rejects_a_descale_of_another_shape(inputs):
    q8, _, _, qd, _, _ = quantize_fp8(*inputs)
    with pytest.raises(ValueError, match=r"^descale: expected \(batch=2, kv_heads dividing heads=4\), got \(2,\)"):
        dequantize_fp8(q8, qd[:, 0])
    with pytest.raises(ValueError, match=r"^descale: expected .* got \(2, 3\)"):
        dequantize_fp8(q8, torch.ones(2, 3))


def test_quantize_descale_is_per_kv_head_group(inputs):
    q, k, v = inputs
    _, _, _, qd, _, _ = quantize_fp8(q, k, v)
    q2 = q.clone()
    q2[1, :, 3] *= 100.0  # batch 1, q head 3 -> kv head 1 (heads 2, 3 share kv head 1)
    _, _, _, qd2, _, _ = quantize_fp8(q2, k, v)
    assert torch.equal(qd2[0], qd[0]) and qd2[1, 0] == qd[1, 0]
    assert torch.allclose(qd2[1, 1], q2[1, :, 2:4].abs().max() / 448.0)


def test_quantize_non_contiguous_inputs(inputs):
    q, k, v = inputs
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # (b, h, s, d) memory, (b, s, h, d) view
    kt = k.transpose(1, 2).contiguous().transpose(1, 2)
    assert not qt.is_contiguous()
    a = quantize_fp8(q, k, v)
    b = quantize_fp8(qt, kt, v)
    for x, y in zip(a, b):
        assert torch.equal(
            x.view(torch.uint8) if x.dtype == FP8 else x, y.contiguous().view(torch.uint8) if y.dtype == FP8 else y
        )


@pytest.mark.parametrize("outlier", [False, True])
def test_quantize_hadamard_preserves_qk(inputs, outlier):
    q, k, v = inputs
    if outlier:  # an outlier channel, which the rotation spreads out
        q[..., 5] *= 20.0
        k[..., 5] *= 20.0
    exact = scores(q, k)
    q8, k8, _, qd, kd, _ = quantize_fp8(q, k, v, hadamard=True)
    rot = hadamard_matrix(128, dtype=torch.float64)
    deq_q, deq_k = dequantize_fp8(q8, qd), dequantize_fp8(k8, kd)
    # the stored values are the rotated inputs ...
    assert rel_l2(deq_q, q.double() @ rot) < 0.07
    assert rel_l2(deq_q, q.double()) > 0.5
    # ... whose QK^T is the original QK^T
    err_had = rel_l2(scores(deq_q, deq_k), exact)
    q8p, k8p, _, qdp, kdp, _ = quantize_fp8(q, k, v, hadamard=False)
    err_plain = rel_l2(scores(dequantize_fp8(q8p, qdp), dequantize_fp8(k8p, kdp)), exact)
    print(f"\nQK^T rel. L2 after fp8 (outlier={outlier}): hadamard {err_had:.4f}, plain {err_plain:.4f}")
    assert err_had < 0.05 and err_plain < 0.1
    if outlier:  # the rotation helps
        assert err_had < err_plain / 2


@pytest.mark.parametrize("dim", [64, 96, 128, 192, 256])
def test_hadamard_matrix_orthonormal(dim):
    h = hadamard_matrix(dim, dtype=torch.float64)
    assert h.shape == (dim, dim) and h.dtype == torch.float64
    torch.testing.assert_close(h @ h.T, torch.eye(dim, dtype=torch.float64), rtol=0, atol=1e-12)
    block = dim & -dim  # entries are +-1/sqrt(block) inside the diagonal blocks, 0 outside
    nonzero = h.abs() > 0
    assert torch.allclose(h.abs()[nonzero], torch.tensor(block**-0.5, dtype=torch.float64))
    assert int(nonzero.sum()) == block * dim
    h32 = hadamard_matrix(dim)
    assert h32.dtype == torch.float32
    torch.testing.assert_close(h32 @ h32.T, torch.eye(dim), rtol=0, atol=1e-5)


@pytest.mark.parametrize("dim", [0, -64])
def test_hadamard_matrix_bad_dim(dim):
    with pytest.raises(ValueError, match="^dim:"):
        hadamard_matrix(dim)


def test_quantize_bad_arguments(inputs):
    q, k, v = inputs
    with pytest.raises(TypeError, match="^q: expected a torch.Tensor"):
        quantize_fp8(q.numpy(), k, v)
    with pytest.raises(ValueError, match="^k: expected 4 dims"):
        quantize_fp8(q, k[0], v)
    with pytest.raises(TypeError, match="^v: expected a floating dtype"):
        quantize_fp8(q, k, v.to(torch.int32))
    with pytest.raises(ValueError, match=r"^k: expected a non-empty tensor .*\(2, 0, 2, 128\)"):
        quantize_fp8(q, k[:, :0], v)
    with pytest.raises(ValueError, match="kv_heads=2 .*must divide q's heads=3"):
        quantize_fp8(q[:, :, :3], k, v)
    with pytest.raises(ValueError, match="kv_heads"):
        quantize_fp8(q, k, v[:, :, :1])
    with pytest.raises(ValueError, match="^k: head_dim 64 differs from q's 128"):
        quantize_fp8(q, k[..., :64], v)
    with pytest.raises(ValueError, match="^v_layout: expected 'natural' or 'k_major'"):
        quantize_fp8(q, k, v, v_layout="transposed")
    with pytest.raises(ValueError, match=r"^q/k/v: expected one batch size, got 2, 1, 2"):
        quantize_fp8(q, k[:1], v)
    with pytest.raises(ValueError, match=r"^q/k/v: expected tensors on one device, got cpu, meta, cpu"):
        quantize_fp8(q, k.to("meta"), v)


@pytest.mark.parametrize("which", ["k", "v"])
def test_quantize_refuses_mixed_dtypes(inputs, which):
    """q, k and v of one dtype (as flash_attn_func takes them): a mix is a mistake upstream."""
    q, k, v = inputs
    args = {"q": q.to(BF16), "k": k.to(BF16), "v": v.to(BF16)}
    args[which] = args[which].float()
    with pytest.raises(TypeError, match=rf"^{which}: dtype torch.float32 differs from q's torch.bfloat16"):
        quantize_fp8(**args)


@pytest.mark.parametrize("sk", [48, 45, 1])
def test_quantize_k_major_v(sk):
    """v_layout="k_major": the same codes, stored keys-fastest with 16-byte rows, which transpose_v
    then reads as the kernels' V^T without a copy (a natural V is copied)."""
    from zyfa_tune.kernels.launch import transpose_v

    g = torch.Generator().manual_seed(1)
    q, k, v = (
        torch.randn(2, sk, 4, 64, generator=g),
        torch.randn(2, sk, 2, 64, generator=g),
        torch.randn(2, sk, 2, 96, generator=g),
    )
    nat = quantize_fp8(q, k, v)
    km = quantize_fp8(q, k, v, v_layout="k_major")
    v8, v8k = nat[2], km[2]
    assert v8k.shape == v8.shape and v8k.dtype == FP8 and v8k.stride(1) == 1
    assert torch.equal(v8k.view(torch.uint8), v8.view(torch.uint8)) and torch.equal(km[5], nat[5])
    vt = transpose_v(v8k)
    assert vt.data_ptr() == v8k.data_ptr() and vt.shape == (2, 2, 96, sk)  # a view: no copy
    assert vt.stride(3) == 1 and vt.stride(2) % 16 == 0
    vt_copy = transpose_v(v8)
    assert vt_copy.data_ptr() != v8.data_ptr()
    assert torch.equal(vt_copy.view(torch.uint8), vt.view(torch.uint8))


def test_k_major_v_passes_validation_uncopied(monkeypatch):
    """An FP8 V stored keys-fastest reaches the launch as given; a BF16 one is made contiguous."""
    seen = {}

    def record_bind(config, q, k, v, *rest):
        seen["v"] = v
        return None

    monkeypatch.setattr(api, "_on_cuda", lambda name, t: None)
    monkeypatch.setattr(api, "bind", record_bind)
    monkeypatch.setattr(api.torch.cuda, "device", lambda d: contextlib.nullcontext())
    from zyfa_tune.generator.defaults import default_config

    g = torch.Generator().manual_seed(2)
    q, k, v = (
        torch.randn(1, 32, 2, 64, generator=g),
        torch.randn(1, 32, 2, 64, generator=g),
        torch.randn(1, 32, 2, 64, generator=g),
    )
    q8, k8, v8, qd, kd, vd = quantize_fp8(q, k, v, v_layout="k_major")
    flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, config=default_config("fp8", 64, 64))
    assert seen["v"] is v8
    vb = v.to(BF16).permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)  # keys-fastest bf16
    flash_attn_func(q.to(BF16), k.to(BF16), vb, config=default_config("bf16", 64, 64))
    assert seen["v"] is not vb and seen["v"].is_contiguous() and torch.equal(seen["v"], vb)


def test_smooth_k_is_exact_and_helps_channel_outliers():
    """K smoothing leaves float64 attention unchanged (q.mean(k) is constant per row) and, on the
    channel-outlier family, cuts the input-quantisation error several-fold."""
    from zyfa_tune.tuning.inputs import make_qkv
    from zyfa_tune.tuning.reference import attention_reference

    q, k, v = make_qkv(
        "outliers", batch=1, seqlen=256, heads=4, kv_heads=2, head_dim_qk=128, head_dim_v=64, seed=3, device="cpu"
    )
    ref = attention_reference(q.double(), k.double(), v.double(), causal=True)
    ks = k.double() - k.double().mean(dim=1, keepdim=True)
    assert rel_l2(attention_reference(q.double(), ks, v.double(), causal=True), ref) < 1e-12

    def quant_error(**kw):
        q8, k8, v8, qd, kd, vd = quantize_fp8(q, k, v, **kw)
        return rel_l2(
            attention_reference(dequantize_fp8(q8, qd), dequantize_fp8(k8, kd), dequantize_fp8(v8, vd), causal=True),
            ref,
        )

    plain, smooth = quant_error(), quant_error(smooth_k=True)
    assert smooth < plain / 4, (plain, smooth)
    with pytest.raises(TypeError, match="smooth_k"):
        quantize_fp8(q, k, v, smooth_k=1)
