"""Gluon Q/K widths that are not multiples of FP8 wgmma's 32-column reduction (48, 80, 112, 144, ...): Q and K
zero-padded to one inside the kernel (rules.gluon_qk_width, config.gluon_qk_parts) through (rows, heads, dims)
TMA views, what the emitter and the launcher build for them, and that they compile for sm_90a with 3-D Q/K
loads, QGMMA and no spills, the static checks passing them."""

from __future__ import annotations

import pytest
import torch
from gluon_compile import check_usable, compile_each_once

from zyfa_tune.generator import HEAD_DIMS, ConfigError, KernelConfig, emit, gluon_qk_padded, gluon_qk_parts
from zyfa_tune.generator.defaults import default_config
from zyfa_tune.generator.gluon_sm90.emit import descriptor_blocks, schedule_constants
from zyfa_tune.kernels import launch
from zyfa_tune.search_spaces import get_space
from zyfa_tune.search_spaces.seeds import gluon_lean_max_config, gluon_smem2_chunked_config
from zyfa_tune.tuning.warm_start import study_seeds

FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16

compiled_fixture = pytest.fixture(scope="module", name="compiled")(compile_each_once)


@pytest.mark.parametrize("dqk", HEAD_DIMS)
def test_q_k_parts_cover_the_head_dim_within_one_wgmma_step(dqk):
    """Any multiple of 16 is emitted: its parts are powers of two (the largest dividing their total) that cover
    the head dim and stop short of 32 more columns, padded exactly where the head dim is not of 32s; other
    widths are refused, naming the 16-byte TMA rows."""
    if dqk % 16:
        with pytest.raises(ConfigError, match=rf"^head_dim_qk={dqk}: .*multiple of 16"):
            default_config("fp8", dqk, 128, "gluon")
        return
    cfg = default_config("fp8", dqk, 128, "gluon")
    part, parts = gluon_qk_parts(cfg)
    width = part * parts
    assert part & (part - 1) == 0 and part == width & -width
    assert width % 32 == 0 and dqk <= width < dqk + 32
    assert gluon_qk_padded(cfg) == (width != dqk) == (dqk % 32 != 0)


def test_padded_widths_split_like_their_padded_width():
    parts = {d: gluon_qk_parts(default_config("fp8", d, 128, "gluon")) for d in (48, 80, 96, 112, 176, 192, 240)}
    assert parts == {48: (64, 1), 80: (32, 3), 96: (32, 3), 112: (128, 1), 176: (64, 3), 192: (64, 3), 240: (256, 1)}


def test_emitted_kernel_of_a_padded_width():
    """The true head dim in HEAD_QK, the padded parts in QK_W / QK_PARTS, 3-D Q/K boxes of one head and the
    Q / K rings in the 2-D layout wgmma reads (the 3-D descriptors' own layouts have rank 3)."""
    cfg = default_config("fp8", 80, 64, "gluon")
    c = schedule_constants(cfg)
    assert (c["HEAD_QK"], c["QK_W"], c["QK_PARTS"], c["HEAD_D"]) == (80, 32, 3, 64)
    blocks = descriptor_blocks(cfg)
    assert blocks["desc_q"] == ("fp8", [128, 1, 32]) and blocks["desc_k"] == ("fp8", [128, 1, 32])
    src = emit(cfg).source
    assert "get_default_for([BLOCK_M // Q_BOXES, QK_W], dtype))" in src and "desc_q.layout" not in src
    assert "get_default_for([BN_A, QK_W], dtype))" in src and "desc_k.layout" not in src
    # three consumers (64-row Q boxes) and a 192-key block (a second K box)
    assert descriptor_blocks(cfg.replace(block_m=192, ping_pong=False))["desc_q"] == ("fp8", [64, 1, 32])
    assert descriptor_blocks(cfg.replace(block_n=192))["desc_kb"] == ("fp8", [64, 1, 32])
    plain = default_config("fp8", 96, 64, "gluon")
    assert descriptor_blocks(plain)["desc_q"] == ("fp8", [128, 32]) and "desc_q.layout" in emit(plain).source


def _inputs(b: int, sq: int, h: int, hk: int, dqk: int, dv: int):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, sq, h, dqk, generator=g).to(FP8)
    k, v = (torch.randn(b, sq, hk, d, generator=g).to(FP8) for d in (dqk, dv))
    return q, k, v, torch.empty(b, sq, h, dv, dtype=BF16)


def test_launcher_reads_padded_q_and_k_through_views_of_one_head():
    """Q and K as (rows, heads, dims) with the true head dim innermost (TMA clips the boxes there: zeros past
    it, no bytes read), V^T and O at the true V width, the softmax scale as given (the caller's, from the true
    head dim)."""
    cfg = default_config("fp8", 80, 64, "gluon")
    b, sq, h, hk = 2, 1000, 8, 2
    q, k, v, out = _inputs(b, sq, h, hk, 80, 64)
    _, args, _ = launch.prepare(cfg, q, k, v, out, 80**-0.5, True, sms=132)
    a = dict(zip(descriptor_blocks(cfg), args))
    assert a["desc_q"].base is q and a["desc_k"].base is k
    assert a["desc_q"].shape == [b * sq, h, 80] and a["desc_q"].strides == [h * 80, 80, 1]
    assert a["desc_k"].shape == [b * sq, hk, 80] and a["desc_k"].strides == [hk * 80, 80, 1]
    assert list(a["desc_q"].block_shape) == [128, 1, 32] and list(a["desc_k"].block_shape) == [128, 1, 32]
    assert a["desc_v"].shape[0] == b * hk * 64 and a["desc_o"].shape == [b, sq, h * 64]
    assert args[len(a) + 12] == pytest.approx(80**-0.5 * 1.4426950408889634)  # sm_scale_log2


def test_k_perm_needs_q_k_of_32s():
    """k_perm's 5-D K box leaves TMA no dimension for the heads of the padded view: refused, and the launcher
    keeps a zero-padded kernel off it for a keys-fastest V (reading V^T through the copy instead)."""
    with pytest.raises(ConfigError, match=r"^head_dim_qk=80: k_perm=True"):
        default_config("fp8", 80, 80, "gluon").replace(k_perm=True)
    v = torch.empty(1, 2, 80, 256, dtype=FP8).permute(0, 3, 1, 2)  # (B, Sk, Hkv, D), keys fastest
    assert launch.for_v_layout(default_config("fp8", 80, 80, "gluon"), v).k_perm is False
    v96 = torch.empty(1, 2, 96, 256, dtype=FP8).permute(0, 3, 1, 2)
    assert launch.for_v_layout(default_config("fp8", 96, 96, "gluon"), v96).k_perm is True


#: the default config of each zero-padded width (and pairs with other V widths), and lean P's max seed
PADDED_CASES = [default_config("fp8", d, d, "gluon") for d in (48, 80, 112, 144, 176, 208, 240)]
PADDED_CASES += [default_config("fp8", dqk, dv, "gluon") for dqk, dv in ((80, 64), (112, 128), (176, 128), (48, 40))]
PADDED_CASES += [gluon_lean_max_config("fp8", d, d) for d in (80, 112, 144)]  # (144: one Q stage to fit)


@pytest.mark.parametrize(
    "cfg",
    PADDED_CASES,
    ids=lambda c: f"{c.softmax}-{c.head_dim_qk}-{c.head_dim_v}" if isinstance(c, KernelConfig) else c,
)
def test_padded_widths_compile_with_3d_q_k_loads(cfg, compiled):
    """Each compiles clean (no spills, QGMMA, setmaxnreg, shared memory as estimated), loads Q and K by 3-D TMA
    boxes (V and the output stay on their own views), and the search space's static checks pass it."""
    assert get_space("fp8").feasible(cfg) is None, get_space("fp8").feasible(cfg)
    art = compiled(cfg)
    check_usable(art, cfg)
    assert "cp.async.bulk.tensor.3d.shared::cluster.global" in art.ptx
    assert "cp.async.bulk.tensor.2d.shared::cluster.global" in art.ptx  # V^T


# ---- seeds at any width ------------------------------------------------------------------------

#: widths a study starts from the seeds at: zero-padded Q/K, widths of 32s past 128, asymmetric V widths
SEED_PAIRS = [(d, d) for d in (48, 80, 112, 144, 160, 176, 208, 240)] + [(176, 128), (80, 64), (112, 128)]


def _gluon_seeds(dqk: int, dv: int) -> tuple[list[KernelConfig], list[KernelConfig]]:
    """(exact, lean) Gluon configs of a loose study's seeds at these widths."""
    seeds = [c for c in study_seeds(get_space("fp8"), dqk, dv, loose=True) if c.backend == "gluon"]
    return [c for c in seeds if c.softmax != "lean"], [c for c in seeds if c.softmax == "lean"]


@pytest.mark.parametrize("dqk", range(32, 257, 16))
def test_every_gluon_width_has_the_lean_max_seed_and_exact_seeds(dqk):
    """At every Q/K width of 16s and V width of 8s the Gluon backend emits, the seeds size themselves to fit:
    a loose study starts from the lean seed on the row maximum and at least three exact Gluon kernels, each
    a point of the space (a V width of 8s included, whose Triton default loads by pointer)."""
    space = get_space("fp8")
    for dv in range(32, 257, 8):
        exact, lean = _gluon_seeds(dqk, dv)
        lean_max = gluon_lean_max_config("fp8", dqk, dv)
        assert lean_max in lean, (dqk, dv, space.feasible(lean_max))
        assert len(exact) >= 3, (dqk, dv, exact)
        assert all(space.as_optuna_params(c) for c in exact + lean)


def test_seeds_shrink_where_o_is_not_a_power_of_two():
    """Where V's width is not a power of two the output cannot go out through the P tiles in chunks: past
    128-key blocks' shared memory (176/176 and up) the lean and two-P-tile seeds take 64-key blocks (the
    lean one with its Q ring of two back, the two-tile one with 3 stages and no halved first block), where a
    power-of-two V keeps 128 keys and the chunked store."""
    lean = gluon_lean_max_config("fp8", 176, 176)
    assert (lean.block_n, lean.q_stages, lean.o_through_p) == (64, 2, False)
    assert gluon_lean_max_config("fp8", 256, 256).o_through_p and gluon_lean_max_config("fp8", 256, 256).block_n == 128
    chunked = gluon_smem2_chunked_config("fp8", 240, 240)
    assert (chunked.block_n, chunked.num_stages, chunked.half_block, chunked.o_through_p) == (64, 3, False, False)
    at_160 = gluon_smem2_chunked_config("fp8", 160, 160)
    assert (at_160.block_n, at_160.num_stages, at_160.o_through_p) == (128, 2, False)
    assert gluon_smem2_chunked_config("fp8", 176, 128).o_through_p


#: the two seeds sized by the width (shared memory), at each width a study starts from
SEED_CASES = [gluon_lean_max_config("fp8", *dims) for dims in SEED_PAIRS]
SEED_CASES += [gluon_smem2_chunked_config("fp8", *dims) for dims in SEED_PAIRS]


@pytest.mark.parametrize(
    "cfg", SEED_CASES, ids=lambda c: f"{c.softmax}-{c.head_dim_qk}-{c.head_dim_v}-{c.block_n}-{c.num_stages}"
)
def test_width_sized_seeds_are_study_seeds_and_compile(cfg, compiled):
    """Each is among a loose study's seeds at its widths and compiles clean (no spills, QGMMA, setmaxnreg,
    shared memory as estimated)."""
    assert cfg in _gluon_seeds(cfg.head_dim_qk, cfg.head_dim_v)[cfg.softmax == "lean"]
    check_usable(compiled(cfg), cfg)
