"""`zyfa_tune.attention` without a GPU: argument errors name the argument, the custom op's fake
implementation gives the output's shape and dtype, and torch.compile traces a model through it."""

from __future__ import annotations

import math

import pytest
import torch

from zyfa_tune.attention import attention, attention_varlen, explain_attention, recipe_for
from zyfa_tune.generator.config import ConfigError
from zyfa_tune.generator.recipe import PLAIN, RECIPE_CHOICES, Recipe


def _qkv(dtype=torch.bfloat16, device="meta", b=2, s=64, h=8, hk=8, d=128, dv=None):
    q = torch.empty(b, s, h, d, dtype=dtype, device=device)
    k = torch.empty(b, s, hk, d, dtype=dtype, device=device)
    v = torch.empty(b, s, hk, dv or d, dtype=dtype, device=device)
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fake_impl_gives_the_output_shape_and_input_dtype(dtype):
    q, k, v = _qkv(dtype, h=8, hk=2, d=192, dv=128)
    out = attention(q, k, v)
    assert out.shape == (2, 64, 8, 128) and out.dtype == dtype and out.device.type == "meta"


def test_torch_compile_fullgraph_traces_a_block_through_the_op():
    from torch._dynamo.testing import CompileCounterWithBackend

    def block(x, wqkv, wo):
        b, s, d = x.shape
        q, k, v = (x @ wqkv).view(b, s, 3, 4, 64).unbind(2)
        return attention(q, k, v, causal=True).reshape(b, s, d) @ wo

    x = torch.empty(2, 128, 256, dtype=torch.bfloat16, device="meta")
    wqkv = torch.empty(256, 768, dtype=torch.bfloat16, device="meta")
    wo = torch.empty(256, 256, dtype=torch.bfloat16, device="meta")
    counter = CompileCounterWithBackend("eager")
    torch._dynamo.reset()
    out = torch.compile(block, backend=counter, fullgraph=True)(x, wqkv, wo)
    assert out.shape == (2, 128, 256) and counter.frame_count == 1
    targets = [str(n.target) for g in counter.graphs for n in g.graph.nodes if n.op == "call_function"]
    assert any("zyfa_tune.attention" in t for t in targets), targets


@pytest.mark.parametrize(
    "args, kwargs, exc, match",
    [
        (lambda: _qkv(device="cpu"), {}, ValueError, "q: tensor is on cpu"),
        (lambda: (_qkv()[0], _qkv(torch.float16)[1], _qkv()[2]), {}, TypeError, "k: dtype torch.float16 differs"),
        (lambda: (*_qkv()[:2], _qkv(torch.float16)[2]), {}, TypeError, "v: dtype torch.float16 differs"),
        (lambda: _qkv(torch.float8_e4m3fn), {}, TypeError, "q: dtype .*flash_attn_func"),
        (lambda: _qkv(torch.float32), {}, TypeError, "q: dtype torch.float32 is not supported"),
        (lambda: _qkv(d=84), {}, ValueError, "q: head_dim: 84 is not a head dim"),
        (lambda: _qkv(h=6, hk=4), {}, ValueError, "k: kv_heads=4 must divide"),
        (lambda: (_qkv()[0], _qkv(s=32)[1], _qkv()[2]), {}, ValueError, "v: shape"),
        (lambda: (_qkv()[0][0], *_qkv()[1:]), {}, ValueError, "q: expected 4 dims"),
        (lambda: ("q", *_qkv()[1:]), {}, TypeError, "q: expected a torch.Tensor"),
        (lambda: _qkv(), {"causal": 1}, TypeError, "causal: expected bool"),
        (lambda: _qkv(), {"softmax_scale": -1.0}, ValueError, "softmax_scale"),
        (lambda: _qkv(), {"error_budget": 0.0}, ValueError, "error_budget"),
        (lambda: _qkv(), {"error_budget": -1}, ValueError, "error_budget"),
        (lambda: _qkv(), {"error_budget": math.nan}, ValueError, "error_budget"),
        (lambda: _qkv(), {"error_budget": math.inf}, ValueError, "error_budget"),
        (lambda: _qkv(), {"error_budget": True}, ValueError, "error_budget"),
        (lambda: _qkv(), {"error_budget": "1"}, ValueError, "error_budget"),
    ],
)
def test_bad_arguments_name_the_argument(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        attention(*args(), **kwargs)


def test_a_cpu_user_sees_the_argument_error_before_the_device_error():
    q, k, v = _qkv(device="cpu")
    with pytest.raises(ValueError, match="error_budget"):
        attention(q, k, v, error_budget=-2.0)


def test_recipes_validate_and_round_trip():
    for name, choices in RECIPE_CHOICES.items():
        for value in choices:
            r = Recipe(**{name: value})
            assert Recipe.from_json(r.to_json()) == r
            assert set(r.quantize_kwargs()) == set(RECIPE_CHOICES)
    assert PLAIN.summary() == "plain"
    assert Recipe(hadamard=True, v_rounding="balanced").summary() == "hadamard v_rounding=balanced"
    for bad in ('{"v_rounding": "up"}', '{"hadamard": 1}', '{"other": true}', "[]", "not json"):
        with pytest.raises(ConfigError, match="recipe"):
            Recipe.from_json(bad)


def test_the_recipe_without_bf16_api_entries_is_the_plain_one(monkeypatch):
    from zyfa_tune.kernels import dispatch

    monkeypatch.setattr(dispatch, "_dispatcher", dispatch.Dispatcher([dispatch.TUNED_DIR / "h200.db"]))
    monkeypatch.setattr(dispatch, "device_key", lambda index: ("NVIDIA H200", "9.0", dispatch.GENERATOR_VERSION))
    q, k, v = _qkv()
    assert recipe_for(q, k, v, True, 1.0) == (PLAIN, None)  # the FP8 API's kernel on plain codes


def test_explain_attention_names_recipe_and_kernel_on_meta_tensors():
    q, k, v = _qkv()
    choice = explain_attention(q, k, v, gpu="NVIDIA H200")
    assert choice.kernel.config.dtype == "fp8"
    assert f"recipe {choice.recipe.summary()}; kernel {choice.kernel.config.summary()}" in str(choice)


@pytest.mark.parametrize("seqlen", [16384, 32768])
def test_the_shipped_h100_database_runs_lean_p_with_balanced_v(seqlen):
    """What `attention()` runs by default on an H100 at hd128 16K / 32K (B=1, 32 heads): the shipped bf16-API
    entries' lean P kernel on balanced, K-major V codes, within FA3's error budget (docs/results.md)."""
    q, k, v = (torch.empty(1, seqlen, 32, 128, dtype=torch.bfloat16, device="meta") for _ in range(3))
    choice = explain_attention(q, k, v, gpu="NVIDIA H100 80GB HBM3")
    assert choice.kernel.config.softmax == "lean" and choice.kernel.config.backend == "gluon"
    assert (choice.recipe.v_rounding, choice.recipe.v_layout) == ("balanced", "k_major")


# ---- window_size, return_lse, and packed sequences (attention_varlen) ---------------------------------


def _packed(dtype=torch.bfloat16, device="meta", tq=100, tk=120, h=8, hk=2, d=128, dv=None, batch=3):
    q = torch.empty(tq, h, d, dtype=dtype, device=device)
    k = torch.empty(tk, hk, d, dtype=dtype, device=device)
    v = torch.empty(tk, hk, dv or d, dtype=dtype, device=device)
    cu = torch.empty(batch + 1, dtype=torch.int32, device=device)
    return q, k, v, cu, cu, 50, 60


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fake_impls_give_the_output_and_lse_shapes(dtype):
    q, k, v = _qkv(dtype, s=64, h=8, hk=2, d=192, dv=128)
    out, lse = attention(q, k[:, :40], v[:, :40], window_size=(16, 0), return_lse=True)
    assert out.shape == (2, 64, 8, 128) and out.dtype == dtype
    assert lse.shape == (2, 8, 64) and lse.dtype == torch.float32 and lse.device.type == "meta"
    assert attention(q, k, v, window_size=(8, 8), causal=False).shape == (2, 64, 8, 128)
    args = _packed(dtype, dv=64)
    out = attention_varlen(*args)
    assert out.shape == (100, 8, 64) and out.dtype == dtype and out.device.type == "meta"
    out, lse = attention_varlen(*args, causal=False, window_size=(4, 4), return_lse=True)
    assert out.shape == (100, 8, 64) and lse.shape == (8, 100) and lse.dtype == torch.float32


def test_torch_compile_fullgraph_traces_window_lse_and_packed_calls():
    from torch._dynamo.testing import CompileCounterWithBackend

    def block(x, wqkv):
        b, s, d = x.shape
        q, k, v = (x @ wqkv).view(b, s, 3, 4, 64).unbind(2)
        out, lse = attention(q, k, v, window_size=(32, 0), return_lse=True)
        return out.reshape(b, s, d), lse.exp()

    def packed(x, wqkv, cu):
        q, k, v = (x @ wqkv).view(x.shape[0], 3, 4, 64).unbind(1)
        out, lse = attention_varlen(q, k, v, cu, cu, 64, 64, window_size=(8, -1), return_lse=True)
        return out.reshape(x.shape), lse

    wqkv = torch.empty(256, 768, dtype=torch.bfloat16, device="meta")
    cu = torch.empty(5, dtype=torch.int32, device="meta")
    for fn, args, want, op in (
        (block, (torch.empty(2, 128, 256, dtype=torch.bfloat16, device="meta"), wqkv), (2, 4, 128), "attention"),
        (packed, (torch.empty(200, 256, dtype=torch.bfloat16, device="meta"), wqkv, cu), (4, 200), "attention_varlen"),
    ):
        counter = CompileCounterWithBackend("aot_eager")
        torch._dynamo.reset()
        out, lse = torch.compile(fn, backend=counter, fullgraph=True)(*args)
        assert out.shape == args[0].shape and lse.shape == want and counter.frame_count == 1
        targets = [str(n.target) for g in counter.graphs for n in g.graph.nodes if n.op == "call_function"]
        assert f"zyfa_tune.{op}" in targets, targets


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"window_size": (-2, 0)}, ValueError, "window_size: each side must be >= 0, or -1"),
        ({"window_size": (4,)}, TypeError, "window_size: expected a pair of ints"),
        ({"window_size": (1.5, 0)}, TypeError, "window_size: expected a pair of ints"),
        ({"return_lse": 1}, TypeError, "return_lse: expected bool"),
    ],
)
def test_bad_options_name_the_argument(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        attention(*_qkv(), **kwargs)
    with pytest.raises(exc, match=match):
        attention_varlen(*_packed(), **kwargs)
    with pytest.raises(exc, match=match):
        explain_attention(*_qkv(), gpu="NVIDIA H200", **kwargs)


@pytest.mark.parametrize(
    "change, exc, match",
    [
        ({0: _qkv()[0]}, ValueError, "q: expected 3 dims"),
        ({1: _packed(torch.float16)[1]}, TypeError, "k: dtype torch.float16 differs"),
        ({0: _packed(torch.float8_e4m3fn)[0]}, TypeError, "q: dtype .*flash_attn_func"),
        ({1: _packed(hk=3)[1]}, ValueError, "k: kv_heads=3 must divide"),
        ({3: torch.empty(4, dtype=torch.int64, device="meta")}, TypeError, "cu_seqlens_q: expected dtype torch.int32"),
        ({4: torch.empty(3, dtype=torch.int32, device="meta")}, ValueError, "cu_seqlens_k: 3 entries"),
        ({5: 10}, ValueError, "max_seqlen_q: 3 sequences of at most 10 tokens cannot hold q's 100"),
        ({6: -1}, TypeError, "max_seqlen_k: expected an int >= 0"),
        ({6: 60.0}, TypeError, "max_seqlen_k: expected an int >= 0"),
        ({0: _packed(device="cpu")[0], 1: _packed(device="cpu")[1]}, ValueError, "k: on cpu, but q is on meta|v: on"),
    ],
)
def test_bad_packed_arguments_name_the_argument(change, exc, match):
    args = list(_packed())
    for i, value in change.items():
        args[i] = value
    with pytest.raises(exc, match=match):
        attention_varlen(*args)


def test_packed_problems_are_reported_together_and_the_device_last():
    q, k, v, cu, _, _, _ = _packed(device="cpu")
    with pytest.raises(TypeError) as info:
        attention_varlen(q, k, v, cu.long(), cu, 50, 60, window_size=(-3, 0), error_budget=0)
    text = str(info.value)
    assert all(word in text for word in ("cu_seqlens_q", "window_size", "error_budget", "q: tensor is on cpu"))
    assert text.index("error_budget") < text.index("q: tensor is on cpu")


def test_an_lse_is_served_without_k_smoothing_and_a_window_by_the_kernel_or_the_triton_serving_variant():
    from zyfa_tune.attention import with_options
    from zyfa_tune.generator.defaults import default_config

    gluon = default_config("fp8", 128, 128, "gluon")
    smooth = Recipe(smooth_k=True, v_rounding="balanced")
    assert with_options(smooth, gluon, True, (-1, -1), False) == (smooth, gluon)  # nothing asked: as chosen
    assert with_options(smooth, gluon, True, (-1, 0), False) == (smooth, gluon)  # a causal window bounds nothing
    recipe, config = with_options(smooth, gluon, True, (-1, -1), True)
    assert recipe == Recipe(v_rounding="balanced") and config == gluon  # the Gluon kernel writes the LSE
    recipe, config = with_options(smooth, gluon, False, (64, 64), True)
    assert recipe == Recipe(v_rounding="balanced") and config == gluon  # its window twin
    pointer = default_config("fp8", 128, 128).replace(loads="pointer", block_n=64)
    assert with_options(smooth, pointer, False, (64, 64), False)[1].block_n == 32  # (the serving variant's)
    assert with_options(smooth, pointer, True, (-1, -1), False)[1] == pointer
    recipe, config = with_options(smooth, None, False, (64, 64), False)
    assert recipe == smooth and config is None  # (flash_attn_func then picks the serving variant)
    q, k, v = _qkv()
    choice = explain_attention(q, k, v, gpu="NVIDIA H200", window_size=(64, 0))
    assert choice.kernel.config.backend == "gluon" and "serving variant" not in str(choice)
    assert explain_attention(q, k, v, gpu="NVIDIA H200").kernel.config.backend == "gluon"
    choice = explain_attention(q, k, v, gpu="NVIDIA H200", return_lse=True)
    assert choice.kernel.config.backend == "gluon" and "serving variant" not in str(choice)
