"""Packed sequences on the Gluon backend, on the CPU: the ragged tile table (order, count, V^T starts),
its one-program Triton kernel (compiled for sm_90a, and run by the Triton interpreter against the torch
construction), the V^T copy's kernel in the interpreter against its reference, the launch arguments,
and the varlen variant compiled for sm_90a.

GPU runs against float64 are in tests/test_gpu_gluon_varlen.py."""

from __future__ import annotations

import textwrap

import pytest
import torch
from interpreted import run_interpreted

from zyfa_tune.generator import HOPPER, emit
from zyfa_tune.generator.build import compile_for_target
from zyfa_tune.generator.defaults import default_config
from zyfa_tune.generator.gluon_sm90.emit import SCALAR_PARAMS, VARLEN_PARAMS
from zyfa_tune.kernels import gluon_launch, gluon_varlen
from zyfa_tune.search_spaces import get_space
from zyfa_tune.search_spaces.seeds import gluon_lean_max_config
from zyfa_tune.tuning.warm_start import study_seeds

FP8 = torch.float8_e4m3fn
#: a natural-V seed (the producer transposes V): its loads at a sequence's rows, no V^T copy
NATURAL = next(
    c for c in study_seeds(get_space("fp8"), 128, 128, loose=False) if c.backend == "gluon" and c.v_layout == "natural"
)


def cu(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)


def _costs(lq, lk, bm, bn, causal):
    """(sequence, block) -> cost, from the rectangular schedule's own block count."""
    return {
        (s, mb): gluon_launch.block_count(mb, bm, bn, a, b, causal) + 1
        for s, (a, b) in enumerate(zip(lq, lk))
        for mb in range(-(-a // bm))
    }


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ragged_tiles_lists_every_tile_once_heaviest_first(causal, seed):
    g = torch.Generator().manual_seed(seed)
    lq = [int(x) for x in torch.randint(0, 700, (9,), generator=g)] + [0, 1]
    lk = [a + int(x) for a, x in zip(lq, torch.randint(0, 300, (11,), generator=g))] if seed else list(lq)
    lk[-2] = 5  # keys without queries
    bm, bn = 128, 64
    table = gluon_varlen.ragged_tiles(cu(lq), cu(lk), max(lq), bm, bn, causal)
    n_m = gluon_varlen.query_blocks(max(lq), bm)
    assert table.dtype == torch.int32 and table.shape == (1 + len(lq) * n_m + len(lq) + 1,)
    want = _costs(lq, lk, bm, bn, causal)
    n = int(table[0])
    entries = [divmod(int(e), n_m) for e in table[1 : 1 + n]]
    assert n == len(want) and sorted(entries) == sorted(want)  # each tile with rows, once
    costs = [want[e] for e in entries]
    assert costs == sorted(costs, reverse=True)  # heaviest first
    rest = [divmod(int(e), n_m) for e in table[1 + n : 1 + len(lq) * n_m]]
    assert not set(rest) & set(want)  # the entries past the count hold no rows
    starts = table[1 + len(lq) * n_m :].tolist()
    assert starts[0] == 0 and all(s % gluon_varlen.VT_ALIGN == 0 for s in starts)
    assert all(b - a >= n for a, b, n in zip(starts, starts[1:], lk))  # room for each sequence's keys
    assert starts[-1] <= gluon_varlen.vt_columns(sum(lk), len(lk))


def test_ragged_tiles_put_the_long_sequences_tiles_before_the_short_ones():
    table = gluon_varlen.ragged_tiles(cu([100, 1000]), cu([100, 1000]), 1000, 128, 128, True)
    n_m = gluon_varlen.query_blocks(1000, 128)
    first = [divmod(int(e), n_m) for e in table[1:4]]
    assert first == [(1, 7), (1, 6), (1, 5)]  # the long sequence's last (longest) query blocks
    assert divmod(int(table[1 + int(table[0]) - 1]), n_m) in ((0, 0), (1, 0))  # a 1-block tile last


@pytest.mark.parametrize("tiles", [1, 700, gluon_varlen.MAX_SORTED_TILES])
def test_tile_table_kernel_compiles_for_sm90a_without_spills(tiles):
    """At the narrowest sort, a middling one and the widest (MAX_SORTED_TILES), with the launch's warps."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from zyfa_tune.generator.build import artifacts

    n = -(-tiles // 4)  # sequences of 4 query blocks
    _, args, constexprs, options = gluon_varlen.tile_table_launch(cu([512] * n), cu([512] * n), 512, 128, 64, True)
    assert constexprs["WIDTH"] >= tiles and options["num_warps"] in (4, 8, 16)
    kernel = gluon_varlen._ragged_tiles_kernel
    sig = dict(zip(kernel.arg_names, ["*i32"] * 3 + ["i32"] * 4 + ["constexpr"] * 2))
    compiled = triton.compile(
        ASTSource(kernel, sig, constexprs, {}),
        target=GPUTarget("cuda", 90, 32),
        options={**options, "num_stages": 1},
    )
    art = artifacts(compiled)
    assert art.spill_bytes == 0 and art.shared_bytes <= HOPPER.shared_memory_bytes


#: run in a fresh interpreter: TRITON_INTERPRET is read when triton is first imported
_INTERPRETED = textwrap.dedent(
    """
    import torch
    from zyfa_tune.kernels import gluon_varlen as gv

    def cu(lengths):
        return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)

    g = torch.Generator().manual_seed(5)
    cases = [([], []), ([0], [0]), ([1], [0]), ([0, 1, 0], [3, 1, 0]), ([130] * 70, [200] * 70)]
    for n in (3, 9, 17, 40):
        lq = torch.randint(0, 700, (n,), generator=g).tolist()
        lq[:2] = [0, 1]
        cases.append((lq, [a + b for a, b in zip(lq, torch.randint(0, 300, (n,), generator=g).tolist())]))
        cases.append((lq, list(lq)))
    for lq, lk in cases:
        for bm, bn, causal in ((128, 64, True), (128, 128, False), (64, 128, True)):
            args = (cu(lq), cu(lk), max(lq, default=0), bm, bn, causal)
            table, kargs, constexprs, options = gv.tile_table_launch(*args)
            gv._ragged_tiles_kernel[(1,)](*kargs, **constexprs, **options)
            want = gv.ragged_tiles_reference(*args)
            assert torch.equal(table, want), (lq, lk, bm, bn, causal, table.tolist(), want.tolist())
    print("checked", len(cases))
    """
)


def test_tile_table_kernel_in_the_interpreter_equals_the_torch_construction():
    """Random length sets with 0 and 1 lengths, no sequence, keys without queries, a sort wider than 128."""
    assert run_interpreted(_INTERPRETED).split() == ["checked", "13"]


#: the V^T copy's kernel in a fresh interpreter; the interpreter cannot loop over a runtime scalar, so
#: the kernel's source runs with its SEARCH parameter a constexpr (the same steps, the same loads and stores)
_VT_INTERPRETED = textwrap.dedent(
    """
    import importlib.util, inspect, os, tempfile, textwrap
    import torch, triton
    from zyfa_tune.kernels import gluon_varlen as gv

    src = textwrap.dedent(inspect.getsource(gv._packed_vt_kernel.fn))
    src = src.replace("BATCH, SEARCH,", "BATCH, SEARCH: tl.constexpr,")
    path = os.path.join(tempfile.mkdtemp(), "packed_vt_kernel.py")
    with open(path, "w") as f:
        f.write("import triton\\nimport triton.language as tl\\n_ALIGN = tl.constexpr(%d)\\n\\n" % gv.VT_ALIGN + src)
    spec = importlib.util.spec_from_file_location("packed_vt_kernel", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def cu(lengths):
        return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)

    n = 0
    for lk in ([0, 1, 31, 32, 33, 300, 0, 7], [5], [0, 64], [40, 0]):
        for permute in (False, True):
            for d in (64, 80, 128):
                g = torch.Generator().manual_seed(n)
                # uint8 codes (the copy moves bytes), dims not the innermost allocation: any strides
                v = torch.randint(1, 255, (sum(lk), 3, d + 8), generator=g, dtype=torch.uint8)[:, :, 4 : 4 + d]
                c, batch = cu(lk), len(lk)
                cols = gv.vt_columns(sum(lk), batch)
                out = torch.full((1, 3, d, cols), 0x7F, dtype=torch.uint8)  # e4m3 NaNs: every byte must be written
                grid = (triton.cdiv(cols, gv._BLOCK_K), 3, triton.cdiv(d, gv._BLOCK_D))
                mod._packed_vt_kernel[grid](
                    v, out, c, gv.vt_starts(c), *v.stride(), batch, max(1, batch.bit_length()), cols,
                    DIM=d, PERMUTE=permute, BLOCK_K=gv._BLOCK_K, BLOCK_D=gv._BLOCK_D,
                )
                assert torch.equal(out, gv.packed_vt_reference(v, c, permute)), (lk, permute, d)
                n += 1
    print("checked", n)
    """
)


def test_packed_vt_kernel_in_the_interpreter_equals_its_reference():
    """Empty and 1-key sequences, lengths either side of 32, head dims under and over one 64-dim block, both
    key orders, a strided V and an output full of NaN codes (the padding must be written as zeros)."""
    assert run_interpreted(_VT_INTERPRETED).split() == ["checked", "24"]


def test_ragged_tiles_on_cpu_tensors_are_the_torch_construction():
    args = (cu([5, 0, 300]), cu([7, 2, 300]), 300, 128, 64, True)
    assert torch.equal(gluon_varlen.ragged_tiles(*args), gluon_varlen.ragged_tiles_reference(*args))


def test_packed_vt_reference_starts_each_sequence_on_its_column():
    lk = [3, 0, 40]
    v = torch.arange(sum(lk) * 2 * 8, dtype=torch.float32).view(sum(lk), 2, 8).to(FP8)
    vt = gluon_varlen.packed_vt_reference(v, cu(lk), permute=False)
    starts = gluon_varlen.vt_starts(cu(lk)).tolist()
    assert vt.shape == (1, 2, 8, gluon_varlen.vt_columns(43, 3)) and starts == [0, 32, 32, 96]
    bits, vb = vt.view(torch.uint8), v.view(torch.uint8)
    assert torch.equal(bits[0, :, :, 32:72], vb[3:43].permute(1, 2, 0))
    assert (bits[0, :, :, 3:32] == 0).all() and (bits[0, :, :, 72:] == 0).all()  # padding zeros


def test_arguments_of_a_natural_config_on_cpu_tensors():
    cfg = default_config("fp8", 128, 128, "gluon").replace(v_layout="natural", v_permute=False)
    lq, lk = [5, 0, 300], [7, 2, 300]
    q = torch.zeros(sum(lq), 8, 128, dtype=FP8)
    k = torch.zeros(sum(lk), 2, 128, dtype=FP8)
    v = torch.zeros(sum(lk), 2, 128, dtype=FP8)
    out = torch.empty(sum(lq), 8, 128, dtype=torch.bfloat16)
    ds = torch.ones(3, 2)
    grid, args, options = gluon_varlen.arguments(
        cfg, q, k, v, out, 0.1, True, (ds, ds, ds), (cu(lq), cu(lk)), (300, 300), sms=132
    )
    n_desc = len(gluon_launch.descriptor_owners(cfg))
    names = [*SCALAR_PARAMS, *VARLEN_PARAMS]
    named = dict(zip(names, args[n_desc:]))
    assert named["QD"] is ds and named["stride_db"] == 2 and named["stride_dh"] == 1
    assert (named["H"], named["GROUP"], named["HKV"], named["N_M_BLOCKS"], named["N_TILES"]) == (8, 4, 2, 3, 9)
    assert named["CU_Q"].tolist() == [0, 5, 5, 305] and named["O_PTR"] is out
    assert int(named["TILE_TABLE"][0]) == 1 + 3  # query blocks with rows: 1 + 0 + 3
    assert grid == (8 * 6,) and options == dict(CAUSAL=True, num_warps=4)  # heads x (ceil(305 / 128) + 3 sequences)
    assert args[0].base.data_ptr() == q.data_ptr() and tuple(args[0].shape) == (sum(lq), 8 * 128)  # packed rows


def test_varlen_refuses_k_perm_and_the_serving_launcher_refuses_gluon():
    with pytest.raises(ValueError, match="^config: k_perm reads K in 16-key groups"):
        emit(default_config("fp8", 128, 128, "gluon").replace(k_perm=True), serving=True)


# ---- the varlen variant compiles ------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,cfg",
    [
        ("64", default_config("fp8", 64, 64, "gluon")),
        ("128", default_config("fp8", 128, 128, "gluon")),
        ("256", default_config("fp8", 256, 256, "gluon")),
        ("192-128", default_config("fp8", 192, 128, "gluon")),
        ("128-lean", gluon_lean_max_config("fp8", 128, 128)),
        ("128-natural", NATURAL),
    ],
)
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_variant_compiles_clean_for_sm90a(name, cfg, causal):
    """QGMMA only, within shared memory, no more spills than the rectangular kernel (none causal), and
    the pointer stores of edge tiles only in the varlen variant."""
    art = compile_for_target(emit(cfg, serving=True), causal=causal)
    plain = compile_for_target(emit(cfg), causal=causal)
    assert art.spill_bytes <= plain.spill_bytes and (art.spill_bytes == 0 or not causal), f"{name}: spills"
    assert art.shared_bytes <= HOPPER.shared_memory_bytes
    assert art.count("QGMMA") > 0 and art.count("HGMMA") == 0 and art.count("USETMAXREG") > 0
    assert art.serialised_wgmma is None
    assert "tt.store" in art.ttgir and "tt.store" not in plain.ttgir  # the rectangular kernel stores by TMA only
