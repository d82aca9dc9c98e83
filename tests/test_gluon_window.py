"""The Gluon kernels' window twin (emit(config, window=True)) on the CPU: the key blocks each tile visits
and masks (the device function itself, run on Python integers) against a brute-force mask; the twin
compiles for sm_90a without spills (exact, lean, rowsum mma, plain schedule, hd64/128/256, 192/128,
varlen; with the LSE too); its parameters exist only in the twin; the launchers pass checked bounds; the
API routes windows to the Gluon kernel. GPU runs against float64: tests/test_gpu_gluon_window.py."""

from __future__ import annotations

import itertools
import types

import pytest
import torch
from test_gluon_lse import BF16, CONFIGS, FP8, GLUON, small_packed_call  # (the configs both twins compile)

from zyfa_tune.generator import HOPPER, emit
from zyfa_tune.generator.build import compile_for_target
from zyfa_tune.generator.defaults import default_config
from zyfa_tune.generator.gluon_sm90 import emit as emit_gluon
from zyfa_tune.generator.gluon_sm90 import schedule
from zyfa_tune.kernels import gluon_launch, gluon_varlen, launch

# ---- the block range, the device function on Python integers -------------------------------------


class _IntGl:
    """What _window_range / _block_range call of `gl`, on Python ints (their divisions all take
    non-negative operands, where Python's floor division is the kernel's truncating one)."""

    minimum, maximum = staticmethod(min), staticmethod(max)

    @staticmethod
    def cdiv(a, b):
        return -(-a // b)


def _on_ints(jitted):
    fn = jitted.fn
    return types.FunctionType(fn.__code__, {**fn.__globals__, "gl": _IntGl}, fn.__name__, fn.__defaults__)


WINDOW_RANGE = _on_ints(schedule._window_range)
BLOCK_RANGE = _on_ints(schedule._block_range)


def _check_tile(m0, sq, sk, left, right, bm, bn):
    """The visits of the tile at m0 against each (row, key) pair's window: every key a stored row sees
    lies in a visited block; a visited block holds a key some row of the tile sees (rows past Sq
    included: the kernel computes them); a block is visited unmasked exactly when every row of the
    tile sees each of its keys."""
    top, n_masked, n_visit, n_open = WINDOW_RANGE(m0, sq, sk, left, right, bm, bn)
    assert 0 <= n_masked <= n_open <= n_visit <= top, (top, n_masked, n_visit, n_open)
    rows = torch.arange(m0, m0 + bm)[:, None]
    keys = torch.arange(0, max(sk, 1))[None, :]
    seen = (keys < sk) & (keys >= rows + (sk - sq) - left) & (keys <= rows + (sk - sq) + right)
    stored = seen[: max(0, min(bm, sq - m0))]
    for blk in range(-(-sk // bn)):
        cols = slice(blk * bn, min(sk, (blk + 1) * bn))
        j = top - 1 - blk  # the visit of block blk
        visited = 0 <= j < n_visit
        if stored[:, cols].any():
            assert visited, (m0, blk)
        if visited:
            assert seen[:, cols].any(), (m0, blk)
            whole = blk * bn + bn <= sk and bool(seen[:, cols].all())
            assert whole == (n_masked <= j < n_open), (m0, blk, j, whole)


def test_the_window_block_range_matches_a_brute_force_mask():
    lengths = [(1, 1), (5, 3), (64, 64), (100, 300), (300, 100), (257, 257), (129, 513), (512, 128)]
    windows = [(0, 0), (1, 0), (5, 7), (63, 0), (64, 0), (127, 0), (128, 0), (200, 1), (0, 65), (1000, 0)]
    blocks = [(64, 64), (128, 64), (128, 128), (192, 128), (128, 32)]
    for (sq, sk), (left, right), (bm, bn) in itertools.product(lengths, windows, blocks):
        # (an unbounded side as api.window_bounds resolves it: sk on the left, sq on the right)
        for lw, rw in ((left, right), (sk, right), (left, sq)):
            for m0 in range(0, sq, bm):
                _check_tile(m0, sq, sk, lw, rw, bm, bn)


def test_a_window_that_bounds_nothing_visits_what_the_plain_schedule_does():
    for sq, sk, bm, bn in itertools.product((1, 70, 256, 300), (1, 70, 256, 300), (64, 128, 192), (64, 128)):
        for m0 in range(0, sq, bm):
            for causal, right in ((True, 0), (False, sq)):
                top, n_masked, n_visit, _ = WINDOW_RANGE(m0, sq, sk, sk, right, bm, bn)
                assert (top, n_masked) == BLOCK_RANGE(m0, sq, sk, bm, bn, causal) and n_visit == top


# ---- compiles ---------------------------------------------------------------------------------------

#: every config on the rectangular schedule, causal; the ragged one and non-causal windows with an exact
#: and a lean P config; the LSE twin's window twin with those and hd64 / 192-128
CASES = (
    [(n, c, False, True, False) for n, c in CONFIGS]
    + [(n, c, True, True, False) for n, c in CONFIGS[:2]]
    + [(n, c, v, False, False) for n, c in CONFIGS[:2] for v in (False, True)]
    + [(n, c, v, True, True) for n, c in CONFIGS[:2] + CONFIGS[4:5] + CONFIGS[6:] for v in (False, True)]
)


@pytest.mark.parametrize(
    "name,cfg,varlen,causal,lse",
    CASES,
    ids=[
        f"{n}-{'varlen' if v else 'rect'}-{'causal' if c else 'full'}{'-lse' if s else ''}" for n, _, v, c, s in CASES
    ],
)
def test_window_twin_compiles_clean(name, cfg, varlen, causal, lse):
    """No spills, QGMMA only (no serialised wgmma), within shared memory."""
    art = compile_for_target(emit(cfg, serving=varlen, lse=lse, window=True), causal=causal)
    assert art.spill_bytes == 0, f"{name}: spills {art.spill_bytes} bytes"
    assert art.count("QGMMA") > 0 and art.count("HGMMA") == 0 and art.serialised_wgmma is None
    assert art.shared_bytes <= HOPPER.shared_memory_bytes


def test_the_hd256_lse_window_twin_spills_at_most_16_bytes():
    """The one twin that spills: hd256's LSE beside the window's bounds and loop ends (its window twin and
    its LSE twin alone do not); a bound, so that more would show."""
    art = compile_for_target(emit(CONFIGS[5][1], lse=True, window=True), causal=True)
    assert art.spill_bytes <= 16 and art.count("QGMMA") > 0


def test_the_window_twin_masks_more_in_the_same_shared_memory():
    art = compile_for_target(emit(GLUON, window=True), causal=True)
    plain = compile_for_target(emit(GLUON), causal=True)
    assert art.shared_bytes == plain.shared_bytes
    assert art.ttgir.count("arith.cmpi") > plain.ttgir.count("arith.cmpi")  # (the window's edges)


@pytest.mark.parametrize("name,cfg", CONFIGS[:3], ids=[n for n, _ in CONFIGS[:3]])
def test_the_window_parameters_exist_only_in_the_twin(name, cfg):
    for varlen, lse in itertools.product((False, True), (False, True)):
        plain, twin = emit(cfg, serving=varlen, lse=lse).source, emit(cfg, serving=varlen, lse=lse, window=True).source
        assert ", WIN_L, WIN_R" not in plain and "WIN_L, WIN_R)" in twin and plain != twin
        assert emit(cfg, serving=varlen, lse=lse, window=False).source == plain
        params = emit_gluon.kernel_params(cfg, varlen, lse, window=True)
        assert params[-2:] == ("WIN_L", "WIN_R") and params[:-2] == emit_gluon.kernel_params(cfg, varlen, lse)
    with pytest.raises(ValueError, match="^window: backend='triton'"):
        emit(default_config("fp8", 128, 128), window=True)


# ---- launch arguments --------------------------------------------------------------------------------


def _tensors(b=2, sq=1000, sk=1000, h=8, hk=2):
    q = torch.zeros(b, sq, h, 128, dtype=FP8)
    k, v = (torch.zeros(b, sk, hk, 128, dtype=FP8) for _ in range(2))
    return q, k, v, torch.empty(b, sq, h, 128, dtype=BF16), tuple(torch.ones(b, hk) for _ in range(3))


@pytest.mark.parametrize("lse", [False, True])
def test_rectangular_window_arguments(lse):
    q, k, v, out, ds = _tensors()
    buf = torch.empty(2, 8, 1000) if lse else None
    serving = launch.Serving(window=(127, 0), lse=buf)
    _, args, options = launch.prepare(GLUON, q, k, v, out, 0.1, True, *ds, serving=serving)
    names = [*emit_gluon.descriptor_blocks(GLUON), *emit_gluon.kernel_params(GLUON, lse=lse, window=True)]
    a = dict(zip(names, args))
    assert len(args) == len(names) and (a["WIN_L"], a["WIN_R"]) == (127, 0) and options["CAUSAL"] is True
    assert a.get("LSE") is buf
    _, args, options = launch.prepare(GLUON, q, k, v, out, 0.1, False, *ds, serving=launch.Serving(window=(5, 7)))
    assert args[-2:] == (5, 7) and options["CAUSAL"] is False
    with pytest.raises(ValueError, match=r"^window: a causal window's right bound is 0, got \(5, 7\)"):
        launch.prepare(GLUON, q, k, v, out, 0.1, True, *ds, serving=launch.Serving(window=(5, 7)))
    for bad in ((-1, 0), (1, 2**30 + 1), (1.0, 0), (1, 2, 3)):
        with pytest.raises(ValueError, match=r"^window: expected \(left, right\) ints in \[0, 1073741824\]"):
            launch.prepare(GLUON, q, k, v, out, 0.1, False, *ds, serving=launch.Serving(window=bad))


def test_varlen_window_arguments_and_the_fast_path_keeps_them(monkeypatch):
    cfg, q, k, v, out, cu, ds = small_packed_call()
    _, args, _ = gluon_varlen.arguments(cfg, q, k, v, out, 0.1, True, (ds, ds, ds), cu, (300, 300), 132, None, (9, 0))
    n_desc = len(gluon_launch.descriptor_owners(cfg))
    named = dict(zip(emit_gluon.kernel_params(cfg, True, window=True), args[n_desc:]))
    assert len(args) == n_desc + len(named) and (named["WIN_L"], named["WIN_R"]) == (9, 0) and named["O_PTR"] is out
    ran = []
    monkeypatch.setattr(gluon_varlen, "run", lambda *a: ran.append(a) or "compiled")
    bound = gluon_varlen.bind(cfg, q, k, v, out, 0.1, True, (ds, ds, ds), cu, (300, 300), None, (9, 0))
    assert ran[0][-2:] == (False, True) and bound.window == (9, 0)  # (no LSE; the window twin)
    sent = []
    monkeypatch.setattr(gluon_varlen.fastlaunch, "hooks_set", lambda: True)
    monkeypatch.setattr(gluon_varlen.fastlaunch, "launch_compiled", lambda c, g, d, a: sent.append(a))
    bound(q, k, v, out, ds, ds, ds, *cu)
    assert sent[0][-3:] == (9, 0, True)  # (WIN_L, WIN_R, CAUSAL)


def test_the_fast_path_keys_name_the_twin():
    assert launch.twin_names(False, False) == () and launch.twin_names(True, True) == ("lse", "window")
    assert launch.twin_names(False, True) == ("window",)


# ---- routing (meta tensors: no GPU) -----------------------------------------------------------------


@pytest.mark.parametrize("causal,window", [(True, (64, 0)), (True, (1, 0)), (False, (5, 7)), (False, (-1, 3))])
def test_windows_keep_the_gluon_kernel(causal, window):
    from zyfa_tune.attention import explain_attention

    q, k, v = (torch.empty(2, 4096, 8, 128, dtype=BF16, device="meta") for _ in range(3))
    choice = explain_attention(q, k, v, causal=causal, window_size=window, gpu="NVIDIA H200")
    assert choice.kernel.config.backend == "gluon" and "serving variant" not in str(choice)
