"""Launch arguments on the CPU (kernels/launch.py, kernels/gluon_launch.py): what `prepare` builds
for a Gluon config (descriptors, scalars in the kernel's parameter order, the persistent grid),
and that a BoundLaunch (the per-layout fast path of flash_attn_func) passes the kernel exactly the
arguments `prepare` builds for the same call, for both backends. The launch itself is replaced by
a recorder: no GPU is needed."""

from __future__ import annotations

import bisect

import pytest
import torch

from zyfa_tune.generator.defaults import default_config
from zyfa_tune.generator.gluon_sm90 import emit as emit_gluon
from zyfa_tune.kernels import fastlaunch, gluon_launch, launch
from zyfa_tune.kernels.transpose import key_permutation, padded_keys, transpose_v

FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16
GLUON = default_config("fp8", 128, 128, "gluon")


def tensors(b=2, sq=1000, sk=1000, h=8, hk=2, seed=0, descales=True, d=128):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, h, d, generator=g).to(FP8)
    k = torch.randn(b, sk, hk, d, generator=g).to(FP8)
    v = torch.randn(b, sk, hk, d, generator=g).to(FP8)
    out = torch.empty(b, sq, h, d, dtype=BF16)
    ds = tuple(torch.rand(b, hk, generator=g) + 0.5 for _ in range(3)) if descales else (None, None, None)
    return q, k, v, out, ds


@pytest.mark.parametrize("persistent", [True, False])
@pytest.mark.parametrize(
    "b,sq,sk,h,hk", [(2, 1000, 1000, 8, 2), (1, 1, 1, 2, 2), (1, 300, 100, 4, 1), (4, 8192, 8192, 32, 32)]
)
def test_prepare_gluon(persistent, b, sq, sk, h, hk):
    cfg = GLUON.replace(persistent=persistent, q_order="balanced" if persistent else "heavy_first")
    q, k, v, out, ds = tensors(b, sq, sk, h, hk)
    grid, args, options = launch.prepare(cfg, q, k, v, out, 0.125, True, *ds, sms=132)
    tiles = -(-sq // 128) * b * h
    assert grid == ((min(132, tiles) if persistent else tiles),)
    assert options == {"CAUSAL": True, "num_warps": 4}
    names = list(emit_gluon.descriptor_blocks(cfg)) + list(emit_gluon.SCALAR_PARAMS) + list(emit_gluon.tile_params(cfg))
    assert ("TILE_TABLE" in names) == persistent
    assert len(args) == len(names)
    a = dict(zip(names, args))
    blocks = emit_gluon.descriptor_blocks(cfg)
    for name in blocks:
        d = a[name]
        assert isinstance(d, gluon_launch.TensorDescriptor)
        assert list(d.block_shape) == blocks[name][1] and d.layout == emit_gluon.descriptor_layout(*blocks[name])
    assert a["desc_q"].base is q and a["desc_k"].base is k and a["desc_o"].base is out
    assert a["desc_q"].shape == [b * sq, h * 128] and a["desc_k"].shape == [b * sk, hk * 128]
    assert a["desc_o"].shape == [b, sq, h * 128] and a["desc_o"].strides == [sq * h * 128, h * 128, 1]
    vt = a["desc_v"].base
    skp = padded_keys(sk, True)
    assert a["desc_v"].shape == [b * hk * 128, skp] and vt.shape == (b, hk, 128, skp)
    assert torch.equal(
        vt.view(torch.uint8)[..., :32][..., key_permutation(32).argsort()][..., : min(sk, 32)],
        v.permute(0, 2, 3, 1).view(torch.uint8)[..., : min(sk, 32)],
    )
    assert (a["QD"], a["KD"], a["VD"]) == ds and (a["stride_db"], a["stride_dh"]) == ds[0].stride()
    assert (a["H"], a["GROUP"], a["HKV"], a["SEQ_Q"], a["SEQ_K"]) == (h, h // hk, hk, sq, sk)
    assert (a["N_M_BLOCKS"], a["N_TILES"]) == (-(-sq // 128), tiles)
    assert a["sm_scale_log2"] == pytest.approx(0.125 * 1.4426950408889634)
    if persistent:  # offsets of each program's list, then the lists: every tile once
        table = a["TILE_TABLE"].tolist()
        p = grid[0]
        assert a["TILE_TABLE"].dtype == torch.int32 and table[0] == 0 and table[p] == tiles
        assert sorted(table[p + 1 :]) == list(range(tiles))
        assert all(table[i] <= table[i + 1] for i in range(p))


@pytest.mark.parametrize("mib", [16, 32, 8, 64])
@pytest.mark.parametrize(
    "b,h,group,seqlen", [(4, 32, 1, 4096), (2, 32, 1, 8192), (1, 32, 4, 16384), (3, 5, 5, 1000), (1, 16, 1, 16384)]
)
def test_balanced_schedule(b, h, group, seqlen, mib):
    """Every tile once; no program more than 1% above the mean work (2% with 8 MiB groups, which leave
    the greedy fewer tiles to even out with; round robin: 3-9%); each program
    meets the groups of heads in the same order (the tiles in flight share K/V in L2), the q heads of
    one kv head are in one group, and a group is as many kv heads as fit l2_group_bytes (at least one)."""
    n_m, programs = -(-seqlen // 128), 132
    lists = gluon_launch.schedule(b, h, group, n_m, seqlen, seqlen, 128, 256, True, 256, programs, mib << 20)
    tiles = b * h * n_m
    assert sorted(t for x in lists for t in x) == list(range(tiles))
    cost = lambda t: (
        gluon_launch.block_count(t % n_m, 128, 256, seqlen, seqlen, True) + gluon_launch.TILE_OVERHEAD_BLOCKS
    )
    loads = [sum(map(cost, x)) for x in lists]
    mean = sum(loads) / programs
    if tiles >= 8 * programs:
        assert max(loads) <= (1.01 if mib >= 16 else 1.02) * mean  # 8 MiB at 4K: 8 heads a group, 1.1%
        rr = [sum(cost(t) for t in range(p, tiles, programs)) for p in range(programs)]
        assert max(rr) >= 1.02 * mean  # what the table is for
    per_group = max(1, (mib << 20) // (seqlen * 256))  # kv heads whose K and V fit
    hkv = h // group
    kv_of = lambda t: (t // n_m) // h * hkv + (t // n_m) % h // group

    def in_group_order(bounds):  # every program meets the groups in order; all start in the first
        group_of = lambda t: bisect.bisect_right(bounds, kv_of(t)) - 1
        return all([group_of(t) for t in x] == sorted(group_of(t) for t in x) for x in lists) and {
            group_of(x[0]) for x in lists if x
        } == {0}

    assert in_group_order(gluon_launch.group_bounds(b * hkv, per_group, even=False)) or in_group_order(
        gluon_launch.group_bounds(b * hkv, per_group, even=True)
    )


def test_even_groups_where_a_short_last_group_would_leave_a_tail():
    """At 192/128 with 16 heads (5.2 MB of K and V a head at 16K), 16 MiB groups are 3 heads, the last
    one a single head whose longest tiles come at the end: 4.6% over the mean in the schedule's own cost
    model (measured 3.4% slower than 32 MiB's table). Groups of even sizes (3, 3, 3, 3, 2, 2)
    are taken where their largest load is smaller; elsewhere the table is the chunked one, unchanged."""
    n_m, kv_bytes = 16384 // 128, 320
    cost = [
        gluon_launch.block_count(mb, 128, 128, 16384, 16384, True) + gluon_launch.TILE_OVERHEAD_BLOCKS
        for mb in range(n_m)
    ]
    assert gluon_launch.group_bounds(16, 3, even=False) == (0, 3, 6, 9, 12, 15, 16)
    assert gluon_launch.group_bounds(16, 3, even=True) == (0, 3, 6, 9, 12, 14, 16)
    assert gluon_launch.group_bounds(32, 6, even=True) == (0, 6, 12, 17, 22, 27, 32)  # larger groups first

    def worst(lists):
        loads = [sum(cost[t % n_m] for t in x) for x in lists]
        return max(loads) / (sum(loads) / len(loads))

    chunked, _ = gluon_launch._greedy(gluon_launch.group_bounds(16, 3, even=False), 16, 1, n_m, cost, 132)
    assert worst(chunked) > 1.04
    table = gluon_launch.schedule(1, 16, 1, n_m, 16384, 16384, 128, 128, True, kv_bytes, 132, 16 << 20)
    assert worst(table) < 1.005
    # 32 MiB: groups of 6, 6, 4 are as good as 6, 5, 5 or better: the chunked table stays
    chunked32, _ = gluon_launch._greedy(gluon_launch.group_bounds(16, 6, even=False), 16, 1, n_m, cost, 132)
    assert gluon_launch.schedule(1, 16, 1, n_m, 16384, 16384, 128, 128, True, kv_bytes, 132, 32 << 20) == tuple(
        tuple(x) for x in chunked32
    )


def test_l2_group_is_a_launch_field():
    """l2_group_mib changes the tile table a balanced kernel is given and nothing of the kernel's code
    (only the source's header, which names the config); it is rejected where no table is made."""
    from zyfa_tune.generator import ConfigError, KernelConfig, emit

    b, s, h = 1, 4096, 16  # K and V 1.3 MB a head: 12 heads to a 16 MiB group, all 16 in one of 32 MiB
    q, k = (torch.zeros(b, s, h, 192).to(FP8) for _ in range(2))
    v, out = torch.zeros(b, s, h, 128).to(FP8), torch.empty(b, s, h, 128, dtype=BF16)
    cfg = GLUON.replace(head_dim_qk=192, head_dim_v=128, block_n=128, q_order="balanced")
    wide = cfg.replace(l2_group_mib=32)
    assert wide.kernel_config() == cfg
    assert emit(wide).source.replace(wide.to_json(), cfg.to_json()) == emit(cfg).source
    assert '"l2_group_mib":32' in wide.to_json() and "l2_group_mib" not in cfg.to_json()
    tables = [launch.prepare(c, q, k, v, out, 0.1, True, sms=132)[1][-1] for c in (cfg, wide)]
    assert not torch.equal(tables[0], tables[1])
    assert sorted(tables[0][133:].tolist()) == sorted(tables[1][133:].tolist())  # the same tiles, other programs
    with pytest.raises(ConfigError, match="l2_group_mib=32: the L2 group sizes the tile table of q_order='balanced'"):
        GLUON.replace(q_order="forward", l2_group_mib=32)
    with pytest.raises(ConfigError, match="l2_group_mib"):
        KernelConfig(l2_group_mib=32)  # a Triton config


def test_prepare_gluon_variants():
    q, k, v, out, _ = tensors()
    grid, args, options = launch.prepare(GLUON.replace(v_permute=False), q, k, v, out, 0.1, False, sms=132)
    assert options["CAUSAL"] is False and args[4:9] == (None, None, None, 0, 0)
    assert args[2].shape == [2 * 2 * 128, 1000]  # V^T not permuted: the real key count, no padding
    grid, args, _ = launch.prepare(GLUON.replace(block_m=64, ping_pong=False), q, k, v, out, 0.1, True, sms=132)
    assert list(args[0].block_shape) == [64, 128] and args[14] == 16  # N_M_BLOCKS of 64 rows
    meta = [t.to("meta") for t in (q, k, v, out)]  # what zyfa_tune.tuning.precompile builds: no memory
    grid, args, _ = launch.prepare(GLUON, *meta, 0.1, True)
    assert grid == (min(gluon_launch.DEFAULT_SMS, 8 * 2 * 8),)


@pytest.mark.parametrize("o_split", [False, True])
def test_prepare_gluon_hd96_o_boxes(o_split):
    """Head dim 96: Q / K boxes of 32 columns; O padded to 128 columns reads 128-row V^T boxes and
    stores through a (B, Sq, H, 96) view whose 128-column box TMA clips at 96 (no write reaches the
    next head); o_split reads 64 + 32 V^T rows and stores 64 + 32 columns on the (B, Sq, H*96) view."""
    cfg = default_config("fp8", 96, 96, "gluon").replace(o_split=o_split)
    b, sq, h, hk = 2, 1000, 8, 2
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, sq, n, 96, generator=g).to(FP8) for n in (h, hk, hk))
    out = torch.empty(b, sq, h, 96, dtype=BF16)
    _, args, _ = launch.prepare(cfg, q, k, v, out, 0.1, True, sms=132)
    names = list(emit_gluon.descriptor_blocks(cfg))
    a = dict(zip(names, args))
    assert list(a["desc_q"].block_shape) == [128, 32] and list(a["desc_k"].block_shape) == [128, 32]
    assert a["desc_v"].shape == [b * hk * 96, padded_keys(sq, True)]
    if o_split:
        assert names == ["desc_q", "desc_k", "desc_v", "desc_vc", "desc_o", "desc_oc"]
        assert list(a["desc_v"].block_shape) == [64, 128] and list(a["desc_vc"].block_shape) == [32, 128]
        assert a["desc_vc"].base is a["desc_v"].base and a["desc_oc"].base is out
        assert list(a["desc_o"].block_shape) == [1, 64, 64] and list(a["desc_oc"].block_shape) == [1, 64, 32]
        assert a["desc_o"].shape == a["desc_oc"].shape == [b, sq, h * 96]
    else:
        assert names == ["desc_q", "desc_k", "desc_v", "desc_o"]
        assert list(a["desc_v"].block_shape) == [128, 128]
        assert list(a["desc_o"].block_shape) == [1, 64, 1, 128]
        assert a["desc_o"].shape == [b, sq, h, 96] and a["desc_o"].strides == [sq * h * 96, h * 96, 96, 1]


def test_prepare_gluon_natural_v_passes_v_itself():
    """v_layout="natural": no V^T copy; desc_v is V's (batch*keys, kv_heads*dim) rows in
    (block_n, dim) boxes, as desc_k is K's."""
    cfg = GLUON.replace(v_permute=False, v_layout="natural", producer_regs=40)
    q, k, v, out, ds = tensors()
    _, args, _ = launch.prepare(cfg, q, k, v, out, 0.1, True, *ds, sms=132)
    desc_v = args[2]
    assert desc_v.base is v and desc_v.shape == [2 * 1000, 2 * 128] and desc_v.strides == [v.stride(1), 1]
    assert list(desc_v.block_shape) == [cfg.block_n, 128]
    assert desc_v.layout == emit_gluon.descriptor_layout("fp8", [cfg.block_n, 128])


def test_prepare_gluon_rejects_what_it_cannot_launch():
    q, k, v, out, _ = tensors()
    with pytest.raises(ValueError, match="^out: .*must be contiguous"):
        launch.prepare(GLUON, q, k, v, torch.empty(2, 8, 1000, 128, dtype=BF16).transpose(1, 2), 0.1, True)
    q64 = torch.zeros(1, 16, 2, 64, dtype=FP8)
    with pytest.raises(ValueError, match="head dims 64/64/64; this Gluon kernel is built for 128"):
        launch.prepare(GLUON, q64, q64, q64, torch.empty(1, 16, 2, 64, dtype=BF16), 0.1, True)


# ---- BoundLaunch: the fast path passes what prepare builds ------------------------------------


class Recorder:
    """Stands in for a CompiledKernel: records what `run` gets."""

    function, packed_metadata = "function", "metadata"

    def __init__(self):
        self.calls = []

    def launch_metadata(self, *args):
        return None

    def run(self, g0, g1, g2, stream, function, packed, meta, enter, exit_, *full):
        self.calls.append(((g0, g1, g2), full))


@pytest.fixture
def recorded(monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(launch, "run_prepared", lambda *a, **k: rec)
    monkeypatch.setattr(fastlaunch, "_stream_getter", lambda: lambda device: "stream")
    monkeypatch.setattr(launch, "bind_transpose", lambda v, permute: lambda x: transpose_v(x, permute))
    return rec


def same_argument(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and a.stride() == b.stride() and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    if hasattr(a, "block_shape"):  # descriptors: same class and fields, bases with the same data
        fields = lambda d: {k: x for k, x in vars(d).items() if k != "base"}
        return type(a) is type(b) and fields(a) == fields(b) and same_argument(a.base, b.base)
    return a == b


@pytest.mark.parametrize(
    "config",
    [
        GLUON,
        GLUON.replace(v_permute=False, persistent=False, q_order="heavy_first"),
        default_config("fp8", 128, 128),
        default_config("fp8", 128, 128).replace(loads="pointer"),
        default_config("fp8", 128, 128).replace(v_layout="natural"),
        default_config("fp8", 80, 80, "gluon"),
    ],
    ids=["gluon", "gluon-plain-v", "triton-tma", "triton-pointer", "triton-natural-v", "gluon-zero-padded-qk"],
)
@pytest.mark.parametrize("descales", [True, False])
def test_bound_launch_passes_what_prepare_builds(config, descales, recorded):
    d = config.head_dim_qk
    q, k, v, out, ds = tensors(seed=1, descales=descales, d=d)
    bound = launch.bind(config, q, k, v, out, 0.1, True, *ds)
    assert bound is not None
    q2, k2, v2, out2, ds2 = tensors(seed=2, descales=descales, d=d)  # same layout, new data
    bound(q2, k2, v2, out2, *ds2)
    ((grid, full),) = recorded.calls
    pgrid, args, options = launch.prepare(config, q2, k2, v2, out2, 0.1, True, *ds2)
    expected = (*args, options["CAUSAL"])
    assert grid == (pgrid[0], 1, 1) and len(full) == len(expected)
    for i, (got, want) in enumerate(zip(full, expected)):
        assert same_argument(got, want), (i, got, want)


# ---- BoundLaunch's raw path: descriptors encoded once per pointer, Triton's C launcher direct -----


class FakeDriver:
    """Stands in for Triton's active driver: `fill_tma_descriptor` returns a token of its arguments."""

    def __init__(self):
        self.fills = 0
        self.utils = self

    def fill_tma_descriptor(self, ptr, swizzle, elem_size, elem_type, block, shape, strides, padding):
        self.fills += 1
        return ("map", ptr, swizzle, elem_size, elem_type, tuple(block), tuple(shape), tuple(strides), padding)


class CLauncher:
    """Stands in for Triton's compiled C launcher (a callable that is not a Python function)."""

    def __init__(self, calls: list):
        self.calls = calls

    def __call__(self, *args):
        self.calls.append(args)


class LauncherKernel:
    """A CompiledKernel whose `run` is built the way Triton's CudaLauncher builds its own: the C
    launcher (here a recorder) wrapped by Triton's `wrap_handle_tensordesc`, which expands and
    encodes each descriptor argument. Both paths end in `c_calls`."""

    function, packed_metadata = "function", "metadata"

    def __init__(self, n_args: int, n_desc: int):
        from types import SimpleNamespace

        from triton.backends.nvidia.driver import wrap_handle_tensordesc

        meta = [
            dict(swizzle=128, elem_size=1, elem_type=i, block_size=[64 + i, 128], fp4_padded=False)
            for i in range(n_desc)
        ]
        self.metadata = SimpleNamespace(tensordesc_meta=meta)
        signature = {i: ("tensordesc<fp8e4nv[64, 128]>" if i < n_desc else "i32") for i in range(n_args)}
        self.c_calls = []
        wrapped = wrap_handle_tensordesc(CLauncher(self.c_calls), signature, meta)
        self.run = SimpleNamespace(
            launch=wrapped,
            global_scratch_size=0,
            profile_scratch_size=0,
            launch_cooperative_grid=False,
            launch_pdl=False,
        )
        self.run.__call__ = None

    def launch_metadata(self, *args):
        return None

    def compiled_run(self, g0, g1, g2, stream, function, *args):  # CudaLauncher.__call__, no scratch
        self.run.launch(g0, g1, g2, stream, function, False, False, None, None, *args)


@pytest.mark.parametrize(
    "config", [GLUON.replace(v_permute=False), default_config("fp8", 128, 128)], ids=["gluon", "triton-tma"]
)
def test_raw_launch_passes_what_triton_would(config, monkeypatch):
    from triton.runtime import driver

    fake = FakeDriver()
    monkeypatch.setattr(driver, "_active", fake)
    monkeypatch.setattr(fastlaunch, "_stream_getter", lambda: lambda device: 7)
    monkeypatch.setattr(launch, "bind_transpose", lambda v, permute: lambda x: transpose_v(x, permute))
    q, k, v, out, ds = tensors(seed=1)
    _, args, options = launch.prepare(config, q, k, v, out, 0.1, True, *ds)
    n_desc = sum(hasattr(a, "block_shape") for a in args)
    kern = LauncherKernel(len(args) + 1, n_desc)
    monkeypatch.setattr(launch, "run_prepared", lambda *a, **kw: kern)
    bound = launch.bind(config, q, k, v, out, 0.1, True, *ds)
    assert bound.raw is not None and len(bound.tma) == n_desc
    q2, k2, v2, out2, ds2 = tensors(seed=2)
    bound(q2, k2, v2, out2, *ds2)
    fills = fake.fills
    assert fills == n_desc
    raw_args = kern.c_calls.pop()
    # the same call through Triton's own wrapper (what launch_compiled reaches via compiled.run)
    bound.raw = None
    monkeypatch.setattr(kern, "run", SimpleRun(kern), raising=False)
    bound(q2, k2, v2, out2, *ds2)
    wrapped_args = kern.c_calls.pop()
    assert len(raw_args) == len(wrapped_args)
    for i, (a, b) in enumerate(zip(raw_args, wrapped_args)):
        if isinstance(a, tuple) and a[:1] == ("map",):  # a V^T copy has a new pointer per call
            assert a[2:] == b[2:], i
        else:
            assert a is b or a == b, (i, a, b)


class SimpleRun:
    def __init__(self, kern):
        self.kern, self.launch = kern, kern.run.launch

    def __call__(self, *args):
        self.kern.compiled_run(*args)


def test_raw_launch_encodes_once_per_pointer(monkeypatch):
    from triton.runtime import driver

    fake = FakeDriver()
    monkeypatch.setattr(driver, "_active", fake)
    monkeypatch.setattr(fastlaunch, "_stream_getter", lambda: lambda device: 7)
    config = GLUON.replace(v_permute=False)
    q, k, v, out, ds = tensors(sq=1024, sk=1024, seed=1)
    v = v.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)  # K-major: read in place, no copy
    _, args, _ = launch.prepare(config, q, k, v, out, 0.1, True, *ds)
    kern = LauncherKernel(len(args) + 1, 4)
    monkeypatch.setattr(launch, "run_prepared", lambda *a, **kw: kern)
    bound = launch.bind(config, q, k, v, out, 0.1, True, *ds)
    assert bound.transpose is None  # the descriptor of a K-major V is built on V's own pointer
    for _ in range(3):
        bound(q, k, v, out, *ds)
    assert fake.fills == 4  # four descriptors, encoded at the first call only
    first = kern.c_calls[0]
    assert all(c == first for c in kern.c_calls)
    assert [a[1] for a in first if isinstance(a, tuple)] == [t.data_ptr() for t in (q, k, v, out)]
    out2 = torch.empty_like(out)
    bound(q, k, v, out2, *ds)
    assert (
        fake.fills == 5
        and kern.c_calls[-1][first.index(next(a for a in first if isinstance(a, tuple) and a[1] == out.data_ptr()))][1]
        == out2.data_ptr()
    )
    monkeypatch.setattr(fastlaunch, "TMA_CACHE_LIMIT", 2)
    bound(q, k, v, torch.empty_like(out), *ds)  # the out slot's cache is full: it starts over
    assert len(bound.tma[3][1].encoded) == 1


def test_raw_launch_not_used_with_hooks_or_scratch(monkeypatch):
    from triton import knobs

    kern = LauncherKernel(5, 2)
    assert fastlaunch.raw_launch(kern) is not None
    kern.run.launch = CLauncher([])  # a kernel without descriptors: `launch` is the C launcher itself
    assert fastlaunch.raw_launch(kern).launch is kern.run.launch
    kern.run.launch = lambda *a: None  # a Python wrapper this module does not know
    assert fastlaunch.raw_launch(kern) is None
    kern.run.global_scratch_size = 64
    assert fastlaunch.raw_launch(kern) is None
    kern.run.global_scratch_size = 0
    assert not fastlaunch.hooks_set()  # Triton's default: empty hook chains
    knobs.runtime.launch_enter_hook.add(hook := lambda meta: None)
    try:
        assert fastlaunch.hooks_set()  # then BoundLaunch takes Triton's path, which gives hooks metadata
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert fastlaunch.raw_launch(object()) is None


@pytest.mark.parametrize("through_p", [False, True])
def test_output_box_is_one_chunk_with_the_output_through_p_tiles(through_p):
    """o_through_p (hd256, 128-key blocks, two P tiles): the output descriptor's box is one chunk of
    64 columns (what a P tile holds), on the same (B, Sq, H*256) view; the kernel stores 4 per row block."""
    cfg = default_config("fp8", 256, 256, "gluon").replace(
        block_n=128, num_stages=2, p_carry="smem2", o_through_p=through_p
    )
    b, sq, h = 1, 300, 2
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, sq, h, 256, generator=g).to(FP8) for _ in range(3))
    out = torch.empty(b, sq, h, 256, dtype=BF16)
    _, args, _ = launch.prepare(cfg, q, k, v, out, 0.1, True, sms=132)
    a = dict(zip(emit_gluon.descriptor_blocks(cfg), args))
    assert list(a["desc_o"].block_shape) == [1, 64, 64 if through_p else 256]
    assert a["desc_o"].base is out and a["desc_o"].shape == [b, sq, h * 256]


def test_fast_path_compiles_again_for_other_constexprs_or_options(monkeypatch):
    """`fastlaunch.run` keys a compiled kernel by its constexprs and launch options too: the same
    head and arguments with NSEG=1 then NSEG=3 (the quantiser's one- and three-tensor passes) are
    two compilations, and a repeat of either launches the kernel compiled for it."""
    compiled, launched = [], []

    class Fn:
        def __getitem__(self, grid):
            def compile_and_launch(*args, **kw):
                compiled.append(kw)
                return f"kernel{len(compiled)}"

            return compile_and_launch

    monkeypatch.setattr(fastlaunch, "_compiled", {})
    monkeypatch.setattr(fastlaunch, "launch_compiled", lambda c, grid, device, full: launched.append((c, full)))
    x = torch.zeros(16)
    run = lambda nseg, warps=4: fastlaunch.run(
        ("quantize_amax", 128), Fn(), (1,), (x, 7), {"NSEG": nseg}, {"num_warps": warps}, 0
    )
    assert [run(1), run(3), run(3, warps=8)] == ["kernel1", "kernel2", "kernel3"]
    assert [kw["NSEG"] for kw in compiled] == [1, 3, 3]
    assert run(1) == "kernel1" and run(3) == "kernel2"
    assert [(c, full[-1]) for c, full in launched] == [("kernel1", 1), ("kernel2", 3)]
