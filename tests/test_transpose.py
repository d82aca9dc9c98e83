"""The V^T kernel (kernels/transpose.py): compiles for sm_90a (CPU), its key permutation and
padding (CPU reference), the no-copy K-major path, and on the GPU bitwise equality with the torch
reference and the fast-launch path."""

from __future__ import annotations

import pytest
import torch

from zyfa_tune.generator.defaults import default_config
from zyfa_tune.kernels.launch import for_v_layout
from zyfa_tune.kernels.transpose import (
    BLOCK_D,
    BLOCK_K,
    NUM_WARPS,
    _transpose_v_kernel,
    bind_transpose,
    key_permutation,
    padded_keys,
    transpose_v,
    transpose_v_reference,
)
from zyfa_tune.quantize import quantize_fp8
from zyfa_tune.search_spaces.seeds import gluon_natural_config

FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("dim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("permute", [False, True])
def test_kernel_compiles_for_sm90(dim, permute):
    """The tile goes through shared memory between the coalesced load and the coalesced store."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from zyfa_tune.generator.build import _disassemble

    sig = {
        "V": "*fp8e4nv",
        "VT": "*fp8e4nv",
        "stride_vb": "i32",
        "stride_vs": "i32",
        "stride_vh": "i32",
        "stride_vd": "constexpr",
        "SEQ_K": "i32",
        "SEQ_KP": "i32",
        "HKV": "i32",
        "DIM": "constexpr",
        "PERMUTE": "constexpr",
        "BLOCK_K": "constexpr",
        "BLOCK_D": "constexpr",
    }
    constexprs = {"stride_vd": 1, "DIM": dim, "PERMUTE": permute, "BLOCK_K": BLOCK_K, "BLOCK_D": BLOCK_D}
    attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 7)}
    ck = triton.compile(
        ASTSource(_transpose_v_kernel, sig, constexprs, attrs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": NUM_WARPS},
    )
    sass, usage = _disassemble(ck.asm["cubin"])
    assert usage["LOCAL"] == 0 and usage["STACK"] == 0
    assert ck.metadata.shared > 0 and "STS" in sass and "LDS" in sass


def test_key_permutation_is_the_accumulator_order():
    perm = key_permutation(64)
    assert sorted(perm.tolist()) == list(range(64))  # a permutation, within 32-key chunks
    assert all(perm[s] // 32 == s // 32 for s in range(64))
    for slot in range(32):  # slot 16h + 4q + 2s + b holds key 16h + 8s + 2q + b
        h, q, s, b = slot // 16, (slot // 4) % 4, (slot // 2) % 2, slot % 2
        assert perm[slot] == 16 * h + 8 * s + 2 * q + b


@pytest.mark.parametrize("sk", [1, 17, 32, 45, 128, 1000])
def test_reference_layout_padding_and_permutation(sk):
    g = torch.Generator().manual_seed(sk)
    v = torch.randn(2, sk, 3, 96, generator=g).to(FP8)
    ref = v.permute(0, 2, 3, 1).view(torch.uint8)
    plain = transpose_v(v)  # CPU: the torch reference
    assert plain.shape == (2, 3, 96, sk) and plain.stride(3) == 1 and plain.stride(2) == padded_keys(sk, False)
    assert torch.equal(plain.view(torch.uint8), ref)
    perm = transpose_v(v, permute=True)
    skp = padded_keys(sk, True)
    assert perm.shape == (2, 3, 96, skp) and skp % 32 == 0 and perm.is_contiguous()
    keys = key_permutation(skp)
    bits = perm.view(torch.uint8)
    for slot in range(skp):
        if keys[slot] < sk:
            assert torch.equal(bits[..., slot], ref[..., keys[slot]])
        else:
            assert not bits[..., slot].any()  # padding keys are zeros


def test_k_major_v_is_not_copied_unless_permuted():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 40, 2, 128, generator=g) for _ in range(3))
    v8 = quantize_fp8(q, k, v, v_layout="k_major")[2]
    assert transpose_v(v8).data_ptr() == v8.data_ptr()
    assert bind_transpose(v8, False)(v8).data_ptr() == v8.data_ptr()
    permuted = transpose_v(v8, permute=True)
    assert permuted.data_ptr() != v8.data_ptr()
    assert torch.equal(permuted.view(torch.uint8), transpose_v_reference(v8, True).view(torch.uint8))


def test_natural_config_given_k_major_v_runs_its_transposed_twin():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 64, 2, 128, generator=g) for _ in range(3))
    v_km, v_rows = quantize_fp8(q, k, v, v_layout="k_major")[2], quantize_fp8(q, k, v)[2]
    natural = gluon_natural_config("fp8", 128, 128)
    assert for_v_layout(natural, v_km) == natural.replace(v_layout="transposed")
    assert for_v_layout(natural, v_rows) is natural  # V as given: the natural kernel
    permuted = default_config("fp8", 128, 128, "gluon")  # relabels keys: on K, given this V
    assert for_v_layout(permuted, v_km) == permuted.replace(k_perm=True)  # (tests/test_k_perm.py)
    assert for_v_layout(permuted, v_rows) is permuted
    triton = default_config("fp8", 128, 128).replace(v_layout="natural")
    assert for_v_layout(triton, v_km) == triton.replace(v_layout="transposed")
    bf16 = default_config("bf16", 128, 128)
    assert bf16.v_layout == "natural" and for_v_layout(bf16, v_km) is bf16  # FP8 only


# ---- GPU ----------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4, 1024, 16, 128), (1, 1, 2, 128), (2, 17, 3, 96), (1, 4100, 2, 256)])
@pytest.mark.parametrize("permute", [False, True])
@pytest.mark.parametrize("dtype", [FP8])
def test_kernel_equals_reference_bitwise(shape, permute, dtype):
    g = torch.Generator(device="cuda").manual_seed(sum(shape))
    v = torch.randn(*shape, device="cuda", generator=g).to(dtype)
    got = transpose_v(v, permute)
    want = transpose_v_reference(v, permute)
    if not permute:
        want = want[..., : shape[1]]
    assert got.shape == want.shape and got.stride() == want.stride()
    assert torch.equal(
        got.view(torch.uint8 if dtype == FP8 else torch.int16), want.view(torch.uint8 if dtype == FP8 else torch.int16)
    )
    strided = v.transpose(1, 2).contiguous().transpose(1, 2)  # other strides: the same result
    assert torch.equal(
        transpose_v(strided, permute).view(torch.uint8 if dtype == FP8 else torch.int16),
        got.view(torch.uint8 if dtype == FP8 else torch.int16),
    )
    bound = bind_transpose(v, permute)  # the fast path of a BoundLaunch
    v2 = torch.randn(*shape, device="cuda", generator=g).to(dtype)
    again = transpose_v_reference(v2, permute)
    out = bound(v2)
    assert torch.equal(
        out.view(torch.uint8 if dtype == FP8 else torch.int16),
        (again if permute else again[..., : shape[1]]).view(torch.uint8 if dtype == FP8 else torch.int16),
    )
