"""GPU tests of `zyfa_tune.attention`: bf16 / fp16 in, against float64 and SDPA, compiled into a model
with torch.compile(fullgraph=True), captured in a CUDA graph, and with NaN / inf in an input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from zyfa_tune.api import flash_attn_func
from zyfa_tune.attention import attention
from zyfa_tune.quantize import quantize_fp8
from zyfa_tune.tuning.reference import attention_reference, rel_l2

pytestmark = pytest.mark.gpu

#: rel. L2 of FP8 attention against float64 on unquantised Gaussian inputs (input rounding included)
FP8_BOUND = 0.06


def _inputs(b, s, h, hk, dqk, dv, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda hh, d: torch.randn(b, s, hh, d, device="cuda", dtype=torch.float32, generator=g).to(dtype)
    return mk(h, dqk), mk(hk, dqk), mk(hk, dv)


@pytest.mark.parametrize("dqk, dv", [(64, 64), (128, 128), (192, 128), (256, 256)])
@pytest.mark.parametrize("s, h, hk", [(1, 4, 4), (77, 8, 2), (1000, 4, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_attention_against_float64(dqk, dv, s, h, hk, dtype):
    q, k, v = _inputs(2, s, h, hk, dqk, dv, dtype)
    out = attention(q, k, v, causal=True)
    assert out.dtype == dtype and out.shape == (2, s, h, dv)
    assert rel_l2(out, attention_reference(q, k, v, causal=True)) < FP8_BOUND


def test_attention_is_flash_attn_func_on_plainly_quantised_codes():
    """With the plain recipe the call is exactly quantise-then-FP8-kernel: bitwise the FP8 API's output."""
    q, k, v = _inputs(2, 2048, 8, 8, 128, 128)
    q8, k8, v8, qd, kd, vd = quantize_fp8(q, k, v)
    want = flash_attn_func(q8, k8, v8, None, True, qd, kd, vd)
    assert torch.equal(attention(q, k, v), want)


class _Block(torch.nn.Module):
    """A pre-norm transformer block (attention + MLP) whose attention is a function argument."""

    def __init__(self, dim=512, heads=8, kv_heads=2, attn=None):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.norm1, self.norm2 = torch.nn.RMSNorm(dim), torch.nn.RMSNorm(dim)
        self.qkv = torch.nn.Linear(dim, (heads + 2 * kv_heads) * self.hd, bias=False)
        self.o = torch.nn.Linear(dim, dim, bias=False)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))
        self.attn = attn

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(
            [self.heads * self.hd, self.kv_heads * self.hd, self.kv_heads * self.hd], dim=-1
        )
        a = self.attn(
            q.view(b, s, self.heads, self.hd),
            k.view(b, s, self.kv_heads, self.hd),
            v.view(b, s, self.kv_heads, self.hd),
        )
        x = x + self.o(a.reshape(b, s, -1))
        return x + self.mlp(self.norm2(x))


def _sdpa(q, k, v):
    g = q.shape[2] // k.shape[2]
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.repeat_interleave(g, 2).transpose(1, 2),
        v.repeat_interleave(g, 2).transpose(1, 2),
        is_causal=True,
    )
    return o.transpose(1, 2)


def test_compiled_block_matches_sdpa():
    torch.manual_seed(0)
    block = _Block(attn=lambda q, k, v: attention(q, k, v, causal=True)).cuda().to(torch.bfloat16)
    ref_block = _Block(attn=_sdpa).cuda().to(torch.bfloat16)
    ref_block.load_state_dict(block.state_dict())
    x = torch.randn(2, 1024, 512, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(block, fullgraph=True)
    with torch.no_grad():
        got, eager, want = compiled(x), block(x), ref_block(x)
    assert torch.equal(got, eager) or rel_l2(got, eager) < 1e-2  # the compiled graph runs the same op
    assert rel_l2(got - x, want - x) < FP8_BOUND  # the block's update, FP8 attention against bf16 SDPA


def test_cuda_graph_capture_and_replay():
    q, k, v = _inputs(2, 4096, 8, 8, 128, 128)
    attention(q, k, v)  # the eager call that makes this shape's plan
    static = [t.clone() for t in (q, k, v)]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attention(*static)
    for seed in (1, 2):
        fresh = _inputs(2, 4096, 8, 8, 128, 128, seed=seed)
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, attention(*fresh))


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("which", [0, 1, 2])
def test_non_finite_input_poisons_only_its_batch_element(poison, which):
    clean = _inputs(2, 1024, 4, 4, 128, 128)
    dirty = [t.clone() for t in clean]
    dirty[which][0, 100, 0, 5] = poison
    want, got = attention(*clean), attention(*dirty)
    torch.cuda.synchronize()
    assert not torch.isfinite(got[0]).all()
    assert torch.equal(got[1], want[1])
