"""`zyfa_tune.attention` without a GPU: argument errors name the argument, the custom op's fake
implementation gives the output's shape and dtype, and torch.compile traces a model through it."""

from __future__ import annotations

import math

import pytest
import torch

from zyfa_tune.attention import attention, explain_attention, recipe_for
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
    assert choice.recipe == PLAIN and choice.kernel.config.dtype == "fp8"
    assert "recipe plain" in str(choice)
