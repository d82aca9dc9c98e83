"""GPU tests: head dims FA3 ships no kernel for (and asymmetric Q/K vs V widths) against float64, at odd
sequence lengths and with GQA, FP8 and BF16, each backend's default config where it emits the width and
the Gluon lean P seed `gluon_lean_max_config`, which fits every Gluon width (Q/K widths not of 32s: zero-padded in
the kernel)."""

from __future__ import annotations

import pytest
import torch

from zyfa_tune import attention, flash_attn_func
from zyfa_tune.generator import ConfigError
from zyfa_tune.generator.defaults import default_config
from zyfa_tune.quantize import quantize_fp8
from zyfa_tune.search_spaces import get_space
from zyfa_tune.search_spaces.seeds import gluon_lean_max_config
from zyfa_tune.tuning.reference import attention_reference, rel_l2
from zyfa_tune.tuning.verify import make_inputs

pytestmark = pytest.mark.gpu

#: the widths of tests/test_head_dims.py, which compiles the same configs on the CPU
PAIRS = [(d, d) for d in (32, 40, 48, 72, 80, 112, 160, 200, 256)] + [(160, 128), (128, 64), (128, 80)]
#: and Q/K widths the Gluon backend zero-pads, with tests/test_gluon_widths.py: to 256 (its 128-byte boxes
#: split in two, the second partly past the head), to 192 in three 64-column parts beside another V width and
#: beside a V padded to 256 (the lean seed on 64-key blocks: no chunked output store for such a V)
PAIRS += [(240, 240), (176, 128), (80, 64), (176, 176)]
#: rel. L2 bounds vs float64 on the same (quantised) inputs, as tests/test_gpu_attention.py; lean P's looser
#: bound as tests/test_gpu_gluon_lean.py
FP8_BOUND = 0.03
BF16_BOUND = 0.01
LEAN_BOUND = 0.045


def _configs(dtype: str, dqk: int, dv: int) -> dict:
    """name -> (config, rel. L2 bound) of each kernel to check at these head dims."""
    out = {"triton": (default_config(dtype, dqk, dv), FP8_BOUND if dtype == "fp8" else BF16_BOUND)}
    if dtype == "fp8":
        try:
            out["gluon"] = (default_config(dtype, dqk, dv, "gluon"), FP8_BOUND)
            lean = gluon_lean_max_config(dtype, dqk, dv)
        except ConfigError:  # (head_dim_qk not of 16s: the Triton backend only)
            return out
        assert get_space(dtype).feasible(lean) is None  # (sized by the widths: it fits every Gluon pair)
        out["gluon-lean"] = (lean, LEAN_BOUND)
    return out


def _check(b: int, sq: int, sk: int, h: int, hk: int, dqk: int, dv: int, dtype: str, seed: int = 0) -> None:
    args, kw = make_inputs(dtype, dqk, dv, batch=b, heads=h, kv_heads=hk, seqlen=sq, seqlen_k=sk, seed=seed)
    ref = attention_reference(*args, causal=True, **kw)
    for name, (cfg, bound) in _configs(dtype, dqk, dv).items():
        out = flash_attn_func(*args, causal=True, config=cfg, **kw)
        assert out.dtype == torch.bfloat16 and out.shape == (b, sq, h, dv)
        assert torch.isfinite(out).all(), f"{name} {dtype} {dqk}/{dv}: non-finite output"
        err = rel_l2(out, ref)
        assert err < bound, f"{name} {dtype} {dqk}/{dv} S={sq}/{sk}: rel L2 {err:.3e} >= {bound}"


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
@pytest.mark.parametrize("dqk,dv", PAIRS)
@pytest.mark.parametrize("seqlen", [1, 17, 1000])
def test_widths_at_odd_seqlens(dqk, dv, dtype, seqlen):
    _check(2, seqlen, seqlen, 4, 4, dqk, dv, dtype)


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
@pytest.mark.parametrize("dqk,dv", PAIRS)
def test_widths_with_gqa_and_unequal_lengths(dqk, dv, dtype):
    _check(1, 333, 777, 8, 2, dqk, dv, dtype, seed=1)
    _check(1, 555, 555, 6, 1, dqk, dv, dtype, seed=2)


@pytest.mark.parametrize("dqk,dv", [(80, 80), (40, 40), (160, 128)])
def test_dispatched_call_and_bf16_api(dqk, dv):
    """With no config (the dispatcher's default for the width) and through the bf16-in `attention()`,
    whose quantiser rotates a width that is not a power of two in smaller Hadamard blocks."""
    args, kw = make_inputs("fp8", dqk, dv, batch=1, heads=4, kv_heads=2, seqlen=999, seed=3)
    ref = attention_reference(*args, causal=True, **kw)
    assert rel_l2(flash_attn_func(*args, causal=True, **kw), ref) < FP8_BOUND
    q, k, v = (torch.randn(1, 999, h, d, device="cuda", dtype=torch.bfloat16) for h, d in ((4, dqk), (2, dqk), (2, dv)))
    out = attention(q, k, v)
    ref16 = attention_reference(q, k, v, causal=True)
    # the inputs' rounding to e4m3 is part of this call's error: by the triangle inequality it is at most
    # the error of float64 attention on the plainly quantised inputs plus the kernel's own
    q8, k8, v8, qd, kd, vd = quantize_fp8(q, k, v)
    rounding = rel_l2(attention_reference(q8, k8, v8, causal=True, q_descale=qd, k_descale=kd, v_descale=vd), ref16)
    assert out.shape == (1, 999, 4, dv) and rel_l2(out, ref16) < rounding + FP8_BOUND
