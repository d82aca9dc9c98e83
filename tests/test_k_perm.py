"""k_perm (CPU): the key relabelling of v_permute made on K's tile rows by a 5-D TMA box instead of on the
V^T copy, so that a V quantised keys-fastest is read as stored. The box's rows are what the relabelling
wants (emulated with the view's own strides), the launcher and the dispatcher pick the twin only where it
applies, the emitted kernel loads K in 5-D boxes (tests/test_gluon_compile.py: its SASS), and bad uses
fail with a clear error. On the GPU: tests/test_gpu_gluon_runtime.py::test_k_perm_*."""

from __future__ import annotations

import pytest
import torch

from zyfa_tune.generator import ConfigError, emit
from zyfa_tune.generator.defaults import default_config
from zyfa_tune.generator.gluon_sm90.emit import descriptor_blocks
from zyfa_tune.kernels.gluon_launch import k_view, v_keys_permuted
from zyfa_tune.kernels.launch import for_v_layout
from zyfa_tune.kernels.transpose import key_permutation
from zyfa_tune.quantize import quantize_fp8
from zyfa_tune.search_spaces.seeds import gluon_lean_f16_config, gluon_smem2_config

PICK = gluon_smem2_config("fp8", 128, 128)


def box_rows(k: torch.Tensor, row0: int, keys: int) -> torch.Tensor:
    """The K tile a k_perm box at row row0 delivers (tile row -> K's row index), read through the view the
    launcher describes to TMA (k_view) exactly as the box walks it: dimensions outermost first."""
    base, shape, strides = k_view(k)
    assert base is k and shape[0] * 16 == k.shape[0] * k.shape[1]
    rows = torch.arange(k.shape[0] * k.shape[1] * k.stride(1), dtype=torch.int64) // k.stride(1)
    view = torch.as_strided(rows, [shape[0], 2, 4, 2], strides[:4])
    return view[row0 // 16 : (row0 + keys) // 16].reshape(-1)


@pytest.mark.parametrize("b,sk,hk,d", [(1, 256, 1, 128), (2, 512, 4, 64), (3, 48, 2, 192)])
def test_the_box_holds_the_keys_the_relabelling_wants(b, sk, hk, d):
    """v_permute relabels accumulator column c as the PV operand's key index j, with c = perm[j]
    (kernels.transpose.key_permutation: the V^T copy's slot j holds key perm[j]). With V^T in key order, tile
    row perm[j] must then hold key j: the box gives exactly that in every 32-key chunk (and in a last
    16-key group, which the relabelling keeps within itself), and never mixes two batch entries' keys."""
    k = torch.zeros(b, sk, hk, d, dtype=torch.uint8)
    perm = key_permutation(32)
    for entry in range(b):
        for n0 in range(0, sk, 16):
            n = 32 if n0 % 32 == 0 and n0 + 32 <= sk else 16
            if n == 16 and n0 % 32:
                continue  # the second half of a chunk already checked
            rows = box_rows(k, entry * sk + n0, n)
            keys = rows - entry * sk - n0
            assert all(int(keys[int(perm[j])]) == j for j in range(n)), (entry, n0, keys.tolist())
            assert bool((rows // sk == entry).all())


def test_k_view_needs_whole_16_key_groups():
    with pytest.raises(ValueError, match="multiple of 16"):
        k_view(torch.zeros(1, 40, 2, 64, dtype=torch.uint8))


def test_k_perm_config_rules_and_boxes():
    assert descriptor_blocks(PICK.replace(k_perm=True))["desc_k"] == ("fp8", [16, 2, 4, 2, 128])
    assert descriptor_blocks(PICK)["desc_k"] == ("fp8", [256, 128])
    split = default_config("fp8", 128, 128, "gluon").replace(block_n=192, num_stages=2, k_perm=True)
    assert descriptor_blocks(split)["desc_kb"] == ("fp8", [4, 2, 4, 2, 128])
    with pytest.raises(ConfigError, match="needs v_permute=True"):
        PICK.replace(v_permute=False, k_perm=True)
    with pytest.raises(ConfigError):
        default_config("fp8", 128, 128).replace(k_perm=True)  # a Triton config
    assert v_keys_permuted(PICK) and not v_keys_permuted(PICK.replace(k_perm=True))
    assert "K_PERM = gl.constexpr(True)" in emit(PICK.replace(k_perm=True)).source
    assert "K_PERM = gl.constexpr(False)" in emit(PICK).source
    assert PICK.replace(k_perm=True).to_dict()["k_perm"] is True and "k_perm" not in PICK.to_dict()


@pytest.mark.parametrize("sk", [64, 48, 40])
def test_the_twin_runs_where_v_is_k_major_and_keys_come_in_16s(sk):
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, sk, 2, 128, generator=g) for _ in range(3))
    natural = quantize_fp8(q, k, v)[2]
    k_major = quantize_fp8(q, k, v, v_layout="k_major")[2]
    lean = gluon_lean_f16_config("fp8", 128, 128)
    for cfg in (PICK, lean):
        assert for_v_layout(cfg, natural) == cfg
        assert for_v_layout(cfg, k_major) == (cfg.replace(k_perm=True) if sk % 16 == 0 else cfg)
        assert for_v_layout(cfg.replace(k_perm=True), natural if sk % 16 == 0 else k_major) == (
            cfg.replace(k_perm=True) if sk % 16 == 0 else cfg
        )  # forced off only where it cannot run
    unpermuted = default_config("fp8", 128, 128, "gluon").replace(v_permute=False)
    assert for_v_layout(unpermuted, k_major) == unpermuted  # no relabelling to move
