"""The FP8 quantisation kernels (kernels/quantize.py): they compile for sm_90a without spills (CPU),
the bf16 split behind the rotation is exact (CPU), and on the GPU they give the torch path's
descales and codes (bitwise without a rotation)."""

from __future__ import annotations

import re

import pytest
import torch

from zyfa_tune.kernels.quantize import (
    _TERMS,
    BALANCE_BLOCKS,
    BALANCE_KEYS,
    _amax_kernel,
    _codes_kernel,
    _pm1_matrix,
    _tiles,
    hadamard_matrix,
    quantize_heads,
    quantize_heads_reference,
    rotation_block,
)
from zyfa_tune.quantize import quantize_fp8

FP8 = torch.float8_e4m3fn
_DT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _sm90_sass(kernel, sig: dict, constexprs: dict, attrs: dict, warps: int):
    """(SASS, usage) of `kernel` compiled for sm_90a with no GPU, one stage, `warps` warps."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from zyfa_tune.generator.build import _disassemble

    compiled = triton.compile(
        ASTSource(kernel, sig, constexprs, attrs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": warps, "num_stages": 1},
    )
    return _disassemble(compiled.asm["cubin"])


def _pass_sass(
    kernel,
    dim: int,
    dtype: torch.dtype,
    centre: bool,
    rotate: bool,
    segments: int = 3,
    k_major: bool = False,
    balanced: bool = False,
    packed: bool = False,
    tiles=None,
):
    """`_sm90_sass` of a quantiser pass, specialised as a launch with these options specialises it (`tiles`:
    the pass's tiling, `_tiles`'s contract)."""
    block_s, dp, bn, warps = tiles(dim) if tiles else _tiles(dim, rotate, balanced)
    terms = 3 if centre else _TERMS[dtype]
    sig = {name: "i32" for name in kernel.arg_names}
    sig.update({f"X{i}": "*" + _DT[dtype] for i in range(3)}, R="*bf16", MEAN="*fp32", inv_sqrt="fp32")
    sig.update(AMAX="*fp32", FREE="*i32", CU0="*i32", CU1="*i32", CU2="*i32")
    if "DESCALE" in kernel.arg_names:  # a pass that writes codes
        sig.update({f"OUT{i}": "*fp8e4nv" for i in range(3)}, DESCALE="*fp32", WEIGHT="*fp32")
    constexprs = dict(
        stride_d=1,
        NSEG=segments,
        DP=dp,
        BN=bn,
        BLOCK_S=block_s,
        CENTER=centre,
        ROTATE=rotate,
        TERMS=terms,
        LAST_K_MAJOR=k_major,
        BALANCED=balanced,
        PACKED=packed,
    )
    sig.update({name: "constexpr" for name in constexprs})
    # pointers, strides and sizes that are multiples of 16, as a launch on contiguous inputs specialises them
    # (packed: not the total token count)
    sizes = r"S[BSH]\d|D|SKP" if packed else r"S[BSH]?\d|D|SKP"
    div16 = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(kernel.arg_names)
        if sig[name].startswith("*") or re.fullmatch(sizes, name)
    }
    return _sm90_sass(kernel, sig, constexprs, div16, warps)


@pytest.mark.parametrize(
    "dim,dtype,centre,rotate,k_major,balanced",
    [
        (128, torch.bfloat16, False, False, False, False),
        (128, torch.bfloat16, False, True, False, False),
        (128, torch.float32, True, True, False, False),
        (96, torch.float16, False, True, False, False),
        (64, torch.float32, False, True, False, False),
        (256, torch.bfloat16, True, True, False, False),
        (192, torch.bfloat16, False, False, False, False),
        (64, torch.float16, True, False, False, False),
        (128, torch.bfloat16, False, False, True, False),
        (64, torch.float16, False, False, True, False),
        (128, torch.bfloat16, False, False, False, True),
        (128, torch.float32, False, False, True, True),
        (64, torch.float16, False, False, False, True),
        (256, torch.bfloat16, False, False, True, True),
        (96, torch.bfloat16, False, False, False, True),
    ],
)
def test_kernels_compile_without_spills(dim, dtype, centre, rotate, k_major, balanced):
    """Both passes, for the head dims and input dtypes the API takes (a centred or balanced tensor alone
    in its launch, others as three segments, Q, K and V; V's codes also written keys-fastest, k_major,
    or balanced along the keys): no local memory, the rotation (only it) on the tensor cores, and 16-byte
    loads of the rows and stores of the codes whichever segment a program takes (keys-fastest: the
    transposed tile's 16-key runs)."""
    for kernel in (_amax_kernel, _codes_kernel):
        sass, usage = _pass_sass(kernel, dim, dtype, centre, rotate, 1 if centre or balanced else 3, k_major, balanced)
        assert usage["LOCAL"] == 0 and usage["STACK"] == 0, (kernel.__name__, usage)
        assert bool(re.search(r"\bHGMMA\b", sass)) == rotate, kernel.__name__  # the rotation: wgmma
        if kernel is _codes_kernel:
            # one IEEE division a program (the scale), none an element: a division's range check (FCHK) once
            assert len(re.findall(r"\bFCHK\b", sass)) <= 1, kernel.__name__
        if kernel is _codes_kernel and balanced:
            # keys one row a load, each thread all 16 keys of its channels: the reductions over the keys need no
            # shuffles, and each key's largest |value| over the channels comes from pass 1 (16 floats a block,
            # not a reduction across threads); the codes leave in 16-byte runs
            assert len(re.findall(r"\bSHFL\.", sass)) <= 8, kernel.__name__
            assert "STG.E.128" in sass and "F2FP.SATFINITE.E4M3" in sass
            continue
        assert "LDG.E.128" in sass and not re.search(r"LDG\.E\.(U16|64)\b", sass), kernel.__name__
        if kernel is _codes_kernel:
            assert "F2FP.SATFINITE.E4M3" in sass  # the rounding to e4m3, satfinite as torch's cast after the clamp
            assert "STG.E.128" in sass and not re.search(r"STG\.E\.(U8|U16|64)\b", sass)


@pytest.mark.parametrize("blocks,channels", [(1, 1), (2, 1), (8, 1), (4, 2)])
@pytest.mark.parametrize("dim,dtype,k_major", [(128, torch.bfloat16, False), (256, torch.float32, True)])
def test_balanced_passes_compile_without_spills_at_any_block_count(monkeypatch, blocks, channels, dim, dtype, k_major):
    """Balanced V's passes at the BALANCE_BLOCKS (16-key blocks a program, a loop over them) and BALANCE_CHANNELS
    (channels a thread) a benchmark may set: no local memory, one division a program, the key reductions in
    registers, and the K-major codes in 16-byte runs."""
    from zyfa_tune.kernels import quantize

    monkeypatch.setattr(quantize, "BALANCE_BLOCKS", blocks)
    monkeypatch.setattr(quantize, "BALANCE_CHANNELS", channels)
    assert _tiles(dim, False, True)[0::3] == (BALANCE_KEYS * blocks, dim // 32 // channels)
    for kernel in (_amax_kernel, _codes_kernel):
        sass, usage = _pass_sass(kernel, dim, dtype, False, False, 1, k_major, True)
        assert usage["LOCAL"] == 0 and usage["STACK"] == 0, (kernel.__name__, usage)
        if kernel is _codes_kernel:
            assert len(re.findall(r"\bFCHK\b", sass)) <= 1 and len(re.findall(r"\bSHFL\.", sass)) <= 8
            assert "F2FP.SATFINITE.E4M3" in sass and (not k_major or "STG.E.128" in sass)


@pytest.mark.parametrize(
    "dim,dtype,segments",
    [
        (128, torch.bfloat16, 3),
        (64, torch.float16, 3),
        (256, torch.bfloat16, 3),
        (96, torch.float32, 3),
        (192, torch.bfloat16, 2),
    ],
)
def test_packed_passes_compile_without_spills(dim, dtype, segments):
    """Packed sequences (PACKED: each program's rows within one sequence, found by a binary search over the
    cumulative lengths): both passes, Q, K and V as segments of one launch, no local memory, 16-byte loads
    of the rows (a block may start at any row) and 16-byte stores of the codes, no tensor cores."""
    for kernel in (_amax_kernel, _codes_kernel):
        sass, usage = _pass_sass(kernel, dim, dtype, False, False, segments, packed=True)
        assert usage["LOCAL"] == 0 and usage["STACK"] == 0, (kernel.__name__, usage)
        assert not re.search(r"\bHGMMA\b", sass), kernel.__name__
        assert "LDG.E.128" in sass and not re.search(r"LDG\.E\.(U16|64)\b", sass), kernel.__name__
        if kernel is _codes_kernel:
            assert len(re.findall(r"\bFCHK\b", sass)) <= 1
            assert "F2FP.SATFINITE.E4M3" in sass
            assert "STG.E.128" in sass and not re.search(r"STG\.E\.(U8|U16|64)\b", sass)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kappa_kernels_compile_without_spills(dtype):
    """balance_weights' launches on a GPU: _kappa_part_kernel, one 64 x 64 block of float32 scores from 32-column
    slices of Q and K (a loop over any head dim) on the tensor cores in TF32 x3 (float32's precision: TF32 alone
    would round Q and K to 10 bits), for the input dtypes the API takes; _kappa_sum_kernel, two warps merging a
    group's partials a head at a time, with no atomics. Neither uses local memory."""
    from zyfa_tune.kernels.balanced_v import _KAPPA_KEYS, _KAPPA_ROWS, _kappa_part_kernel, _kappa_sum_kernel

    sig = {name: "i32" for name in _kappa_part_kernel.arg_names}
    sig.update(Q="*" + _DT[dtype], K="*" + _DT[dtype], PART="*fp32")
    constexprs = dict(BQ=_KAPPA_ROWS, BK=_KAPPA_KEYS)
    sig.update({name: "constexpr" for name in constexprs})
    div16 = {
        (i,): [["tt.divisibility", 16]] for i, name in enumerate(_kappa_part_kernel.arg_names) if sig[name][0] == "*"
    }
    sass, usage = _sm90_sass(_kappa_part_kernel, sig, constexprs, div16, 4)
    assert usage["LOCAL"] == 0 and usage["STACK"] == 0, usage
    # three TF32 products per 8-column step of a 32-column slice (one slice a loop step)
    assert len(re.findall(r"\bHGMMA\.64x64x8\.F32\.TF32\b", sass)) == 3 * 4
    sig = dict(PART="*fp32", OUT="*fp32", QB="i32", KB="i32", GROUP="i32", NQ="i32", NK="i32", scale2="fp32")
    sig.update({name: "constexpr" for name in constexprs})
    sass, usage = _sm90_sass(_kappa_sum_kernel, sig, constexprs, {}, 2)
    assert usage["LOCAL"] == 0 and usage["STACK"] == 0, usage
    assert "STG.E" in sass and not re.search(r"\b(ATOMG?|RED)\.", sass)  # a fixed-order sum


@pytest.mark.parametrize("dtype,parts", [(torch.bfloat16, 1), (torch.float16, 2), (torch.float32, 3)])
def test_bf16_parts_add_up_to_the_rows_exactly(dtype, parts):
    """The rotation's split (kernels/hadamard._columns): hi = bf16(x), mid = bf16(x - hi), lo =
    bf16(x - hi - mid); each difference is exact in float32, and `parts` of them rebuild x."""
    g = torch.Generator().manual_seed(5)
    span = 14 if dtype == torch.float16 else 30  # finite in the dtype, subnormals included
    x = (torch.randn(4096, generator=g) * torch.exp2(torch.randint(-span - 10, span, (4096,), generator=g).float())).to(
        dtype
    )
    xf = x.float()
    hi = xf.to(torch.bfloat16)
    rest = xf - hi.float()
    mid = rest.to(torch.bfloat16)
    lo = (rest - mid.float()).to(torch.bfloat16)
    got = [hi, mid, lo][:parts]
    assert torch.equal(sum(p.double() for p in got), x.double())
    if parts > 1:  # and one part fewer would not do
        assert not torch.equal(sum(p.double() for p in got[:-1]), x.double())


def test_pm1_blocks_are_the_rotation_times_sqrt_block():
    """The kernel's matrix (without a GPU: built the same way on the CPU) is hadamard_matrix * sqrt(block)."""
    for d in (64, 96, 128, 192, 256):
        block = rotation_block(d)
        want = hadamard_matrix(d, dtype=torch.float64) * block**0.5
        assert torch.equal(_pm1_matrix(d, torch.device("cpu"))[:d, :d].double(), want.round())


def test_reference_is_the_cpu_path():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 33, 4, 96, generator=g, dtype=torch.float32)
    mean = torch.randn(2, 2, 96, generator=g)
    for rotate in (False, True):
        for m in (None, mean):
            a = quantize_heads(x, 2, rotate=rotate, mean=m)
            b = quantize_heads_reference(x, 2, rotate=rotate, mean=m)
            assert torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])


def test_plan_groups_tensors_by_their_passes():
    """One launch per pass for the tensors that take the same compiled passes (CPU: a plan is built
    from shapes and strides only): plain Q, K, V of one head dim are one group of three segments; a
    rotation splits off V, K smoothing K (a centred tensor is always alone), another head dim V.
    Segment starts are cumulative program counts, buffer offsets (batch x kv heads, 6 here, rounded up
    to 16 bytes: 8 floats) per tensor."""
    from zyfa_tune.kernels.quantize import _Plan

    b, hk = 2, 3
    q, k, v = (torch.empty(b, s, h, 128) for s, h in ((100, 6), (300, 3), (300, 3)))
    rows = _tiles(128, False)[0]
    plain = _Plan([q, k, v], [False] * 3, [False] * 3, hk).groups
    assert [(g.members, g.consts["NSEG"]) for g in plain] == [((0, 1, 2), 3)]
    nq, nk = -(-100 // rows) * b * 6, -(-300 // rows) * b * 3
    assert plain[0].grid == (nq + 2 * nk,) and plain[0].tail[:5] == (nq, nq + nk, 0, 8, 16)
    assert plain[0].tail[5:8] == (100, 300, 300)  # S per segment
    rotated = _Plan([q, k, v], [True, True, False], [False] * 3, hk).groups
    assert [(g.members, g.consts["ROTATE"]) for g in rotated] == [((0, 1, 0), True), ((2, 2, 2), False)]
    assert rotated[1].tail[:5] == (rotated[1].grid[0],) * 2 + (16,) * 3
    smooth = _Plan([q, k, v], [False] * 3, [False, True, False], hk).groups
    assert [(g.members, g.consts["CENTER"]) for g in smooth] == [((0, 2, 0), False), ((1, 1, 1), True)]
    both = _Plan([k, k, k], [False] * 3, [True] * 3, hk).groups
    assert [g.members for g in both] == [(0, 0, 0), (1, 1, 1), (2, 2, 2)]
    balanced = _Plan([q, k, v], [False] * 3, [False] * 3, hk, k_major=2, balanced=2).groups
    assert [(g.members, g.consts["BALANCED"], g.consts["LAST_K_MAJOR"], g.consts["BLOCK_S"]) for g in balanced] == [
        ((0, 1, 0), False, False, rows),
        ((2, 2, 2), True, True, BALANCE_KEYS * BALANCE_BLOCKS),
    ]
    # (programs of BALANCE_BLOCKS 16-key blocks, the last of each head partly past its 300 keys)
    assert balanced[1].grid == (-(-300 // (BALANCE_KEYS * BALANCE_BLOCKS)) * b * 3,)
    v128 = torch.empty(b, 300, 3, 128)
    q192, k192 = torch.empty(b, 100, 6, 192), torch.empty(b, 300, 3, 192)
    assert [g.members for g in _Plan([q192, k192, v128], [False] * 3, [False] * 3, hk).groups] == [(0, 1, 0), (2, 2, 2)]


# ---- GPU ----------------------------------------------------------------------------------------


def _ordinal(codes: torch.Tensor) -> torch.Tensor:
    """e4m3 codes as integers in the order of their values (+0 and -0 both 0)."""
    c = codes.view(torch.uint8).to(torch.int16)
    return torch.where(c >= 128, 128 - c, c)


def _codes_close(got: torch.Tensor, want: torch.Tensor, exact: bool) -> None:
    a, b = got.view(torch.uint8), want.view(torch.uint8)
    diff = _ordinal(got) - _ordinal(want)
    where = (a != b).nonzero()[:4].tolist()
    what = (
        f"{int((a != b).sum())} of {a.numel()} codes differ, e.g. at {where}: "
        f"{[(int(a[tuple(i)]), int(b[tuple(i)])) for i in where]}"
    )
    if exact:
        assert torch.equal(a, b), what
        return
    # neighbours (or zeros of either sign) where a float32 rounding decides, and that rarely
    assert (diff.abs() <= 1).all(), what
    assert (a != b).float().mean().item() < 1e-3, what


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "shape,kv_heads",
    [((2, 1000, 8, 128), 2), ((1, 17, 2, 96), 1), ((1, 4100, 4, 256), 4), ((3, 257, 6, 64), 3), ((1, 300, 2, 192), 1)],
)
@pytest.mark.parametrize("rotate,centre", [(False, False), (True, False), (False, True), (True, True)])
def test_kernels_give_the_reference_codes(dtype, shape, kv_heads, rotate, centre):
    g = torch.Generator(device="cuda").manual_seed(sum(shape))
    x = (torch.randn(*shape, device="cuda", generator=g) * 3 + 0.5).to(dtype)
    b, _, _, d = shape
    mean = x.float().view(b, shape[1], kv_heads, -1, d)[:, :, :, 0].mean(dim=1) if centre else None
    got_codes, got_descale = quantize_heads(x, kv_heads, rotate=rotate, mean=mean)
    want_codes, want_descale = quantize_heads_reference(x, kv_heads, rotate=rotate, mean=mean)
    assert got_codes.shape == want_codes.shape and got_codes.dtype == FP8 and got_descale.shape == (b, kv_heads)
    exact = not rotate and not centre
    if exact:
        assert torch.equal(got_descale, want_descale)
    else:  # the amax of rotated / centred rows: the same up to float32 summation order (a sum of
        # d rounded products in torch's matmul: ~sqrt(d) 2^-24 of the sum of |terms|)
        torch.testing.assert_close(got_descale, want_descale, rtol=2e-5, atol=0)
    _codes_close(got_codes, want_codes, exact=exact)
    strided = x.transpose(1, 2).contiguous().transpose(1, 2)  # other strides: the same result
    again = quantize_heads(strided, kv_heads, rotate=rotate, mean=mean)
    assert torch.equal(again[0].view(torch.uint8), got_codes.view(torch.uint8)) and torch.equal(again[1], got_descale)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "shape,kv_heads", [((2, 1000, 8, 128), 2), ((1, 17, 2, 96), 1), ((1, 4100, 4, 256), 4), ((3, 257, 6, 64), 3)]
)
@pytest.mark.parametrize("weighed", [False, True])
@pytest.mark.parametrize("blocks,channels", [(1, 1), (4, 1), (4, 2)])
def test_balanced_codes_on_the_gpu_are_the_cpu_codes(monkeypatch, dtype, shape, kv_heads, weighed, blocks, channels):
    """V's balanced rounding (integer error sums; the codes pass, `blocks` 16-key blocks a program, `channels` a
    thread): a GPU gives the CPU's codes bitwise, a sink-like small key and a partial last program of keys
    included, and they are not the nearest codes; `weighed`: each (batch, kv head) its own kappa (0.3 to 1e6)."""
    from zyfa_tune.kernels import quantize

    monkeypatch.setattr(quantize, "BALANCE_BLOCKS", blocks)
    monkeypatch.setattr(quantize, "BALANCE_CHANNELS", channels)
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g) * 3 + 0.5
    x[:, 0] *= 0.05
    x = x.to(dtype)
    weight = None
    if weighed:
        weight = torch.tensor([0.3, 1.7, 6.0, 1e6, 0.0, 2.5])[torch.arange(shape[0] * kv_heads) % 6]
        weight = weight.view(shape[0], kv_heads).contiguous()
    got, got_d = quantize_heads(x.cuda(), kv_heads, balance=True, weight=None if weight is None else weight.cuda())
    want, want_d = quantize_heads_reference(x, kv_heads, balance=True, weight=weight)
    assert torch.equal(got_d.cpu(), want_d)
    _codes_close(got.cpu(), want, exact=True)
    assert not torch.equal(want.view(torch.uint8), quantize_heads_reference(x, kv_heads)[0].view(torch.uint8))


@pytest.mark.gpu
def test_more_heads_than_a_grid_dimension_holds():
    """batch x heads = 65600 > 65535 (a CUDA grid's y and z limit): the grid is one-dimensional."""
    x = torch.randn(4100, 3, 16, 64, device="cuda", dtype=torch.bfloat16)
    for rotate in (False, True):
        got = quantize_heads(x, 16, rotate=rotate)
        want = quantize_heads_reference(x, 16, rotate=rotate)
        _codes_close(got[0], want[0], exact=not rotate)
        torch.testing.assert_close(got[1], want[1], rtol=0 if not rotate else 2e-5, atol=0)


@pytest.mark.gpu
def test_quantize_fp8_on_the_gpu_is_the_cpu_arithmetic():
    """The whole API on a GPU against the same call on the CPU (GQA, every option): bitwise without a
    rotation or centring (the descale is amax times float32(1/448) on both: torch's own division by a
    scalar differs between the two, in the last bit of 2 of 4 descales here before)."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 700, h, 128, generator=g).to(torch.bfloat16) for h in (8, 2, 2))
    for opts in (
        {},
        dict(hadamard=True),
        dict(smooth_k=True),
        dict(hadamard=True, smooth_k=True),
        dict(v_layout="k_major"),
        dict(v_layout="k_major", hadamard=True),
        dict(v_layout="k_major", smooth_k=True),
        dict(v_rounding="balanced", v_weight=0.0),
        dict(v_rounding="balanced", v_layout="k_major", v_weight=1.7),
        dict(v_rounding="balanced", hadamard=True, v_weight=2.0),
        dict(v_rounding="balanced", smooth_k=True, v_layout="k_major", v_weight=0.5),
    ):
        cpu = quantize_fp8(q, k, v, **opts)
        gpu = quantize_fp8(q.cuda(), k.cuda(), v.cuda(), **opts)
        exact = not opts.get("hadamard") and not opts.get("smooth_k")
        for c, t in zip(cpu[:3], gpu[:3]):
            assert t.shape == c.shape and t.stride() == c.stride()
            _codes_close(t.cpu().contiguous(), c.contiguous(), exact=exact)
        for c, t in zip(cpu[3:], gpu[3:]):  # rotated or centred: float32 summation order
            torch.testing.assert_close(t.cpu(), c, rtol=0 if exact else 2e-5, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
@pytest.mark.parametrize(
    "opts", [{}, dict(hadamard=True), dict(smooth_k=True), dict(v_rounding="balanced", v_layout="k_major")]
)
def test_a_non_finite_input_gives_its_head_a_non_finite_descale(poison, opts):
    """As the CPU arithmetic does (torch's amax keeps a NaN; Triton's max and float atomic_max drop it):
    a NaN or inf in one (batch, kv head) makes that descale non-finite and leaves the others as they were."""
    g = torch.Generator().manual_seed(4)
    clean = [torch.randn(2, 300, h, 128, generator=g).to(torch.bfloat16).cuda() for h in (4, 2, 2)]
    want = quantize_fp8(*clean, **opts)[3:]
    for which in range(3):
        dirty = [t.clone() for t in clean]
        dirty[which][1, 7, 2 if which == 0 else 1, 3] = poison
        got = quantize_fp8(*dirty, **opts)[3:]
        cpu = quantize_fp8(*(t.cpu() for t in dirty), **opts)[3:]
        for i, (d, w, c) in enumerate(zip(got, want, cpu)):
            bad = ~torch.isfinite(d)
            assert torch.equal(bad.cpu(), ~torch.isfinite(c)), (which, i)
            if i == which:
                assert bad[1, 1] and not bad[0].any(), (which, i, d)
            else:
                assert torch.equal(d, w), (which, i)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,kv_heads", [(1, 1), (1, 2), (3, 1), (2, 3)])
def test_descales_start_16_byte_aligned(batch, kv_heads):
    """The FP8 kernels' bound fast path takes only 16-byte aligned pointers: quantize_fp8's descales
    (views of one buffer) must each start aligned whatever batch x kv_heads is."""
    q, k, v = (torch.randn(batch, 64, kv_heads * g, 64, device="cuda").to(torch.bfloat16) for g in (2, 1, 1))
    for opts in ({}, dict(v_rounding="balanced", v_layout="k_major")):
        out = quantize_fp8(q, k, v, **opts)
        assert all(d.data_ptr() % 16 == 0 and d.shape == (batch, kv_heads) for d in out[3:]), opts
        want = quantize_fp8(q.cpu(), k.cpu(), v.cpu(), **opts)[3:]
        assert all(torch.equal(d.cpu(), w) for d, w in zip(out[3:], want)), opts


@pytest.mark.gpu
def test_balance_weights_on_the_gpu():
    """kappa from a sample of the scores on a GPU (_kappa_part_kernel, then _kappa_sum_kernel) is the CPU's torch
    ops' to float32 summation order: grouped heads, fewer tokens than the sample (200), a head dim that is no power
    of two, rows whose scores have means of hundreds (channel outliers: the variance merged from centred chunks);
    the same bits run to run (a fixed-order sum); and balanced V by default is the codes pass with the GPU's own
    kappa."""
    from zyfa_tune.kernels.quantize import balance_weights, quantize_tensors
    from zyfa_tune.tuning.inputs import make_qkv

    g = torch.Generator().manual_seed(6)
    for s, d, dtype in ((200, 96, torch.float16), (4099, 64, torch.float32)):
        q, k = (torch.randn(3, s, h, d, generator=g).to(dtype) for h in (4, 4))
        torch.testing.assert_close(
            balance_weights(q.cuda(), k.cuda(), 0.3).cpu(), balance_weights(q, k, 0.3), rtol=1e-4, atol=0
        )
    q, k, _ = make_qkv(
        "outliers", head_dim_qk=128, head_dim_v=128, seed=1, device="cpu", batch=1, seqlen=2048, heads=4, kv_heads=4
    )
    torch.testing.assert_close(balance_weights(q.cuda(), k.cuda()).cpu(), balance_weights(q, k), rtol=1e-4, atol=0)
    q, k, v = (torch.randn(2, 5000, h, 128, generator=g).to(torch.bfloat16) for h in (8, 2, 2))
    w = balance_weights(q.cuda(), k.cuda())
    torch.testing.assert_close(w.cpu(), balance_weights(q, k), rtol=1e-4, atol=0)
    qc, kc, vc = q.cuda(), k.cuda(), v.cuda()
    assert all(torch.equal(balance_weights(qc, kc), w) for _ in range(3))
    got = quantize_fp8(qc, kc, vc, v_rounding="balanced")[2]
    want = quantize_tensors(((vc, False, None),), 2, balance_last=True, balance_weight=w)[0][0]
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.gpu
def test_a_pass_compiled_for_one_tensor_is_not_launched_for_three(monkeypatch):
    """192/128 inputs quantise Q and K in one two-tensor pass and V (head dim 128) in a one-tensor
    pass; 128/128 inputs afterwards take a three-tensor pass of the same head dim. With nothing
    compiled before, the second call must compile its own (once it launched the one-tensor pass: K
    and V were left unwritten and the attention after it NaN)."""
    from zyfa_tune.kernels import fastlaunch
    from zyfa_tune.kernels import quantize as kq

    monkeypatch.setattr(fastlaunch, "_compiled", {})
    monkeypatch.setattr(kq, "_plans", {})
    g = torch.Generator().manual_seed(4)
    # shapes whose scalar arguments specialise alike (multiples of 16 where it counts): the pass
    # compiled for V of the first call would be taken for the second's three tensors
    for (dqk, dv), b, s in (((192, 128), 1, 4096), ((128, 128), 2, 2048)):
        q, k, v = (torch.randn(b, s, 8, d, generator=g).to(torch.bfloat16) for d in (dqk, dqk, dv))
        for c, t in zip(quantize_fp8(q, k, v), quantize_fp8(q.cuda(), k.cuda(), v.cuda())):
            if c.dtype == torch.float8_e4m3fn:
                _codes_close(t.cpu().contiguous(), c.contiguous(), exact=True)
            else:
                torch.testing.assert_close(t.cpu(), c, rtol=0, atol=0)


@pytest.mark.gpu
def test_planned_launches_quantize_new_inputs():
    """A second call with the same layout runs the plan kept from the first (direct launches of the
    compiled passes, shared amax and descale buffers): fresh inputs give the CPU path's codes and
    descales, and no new plan is made."""
    from zyfa_tune.kernels import quantize as kq

    g = torch.Generator().manual_seed(11)
    shapes = ((3, 333, 6, 192), (3, 517, 3, 192), (3, 517, 3, 128))  # Q and K one launch, V another (plain)
    for opts in ({}, dict(hadamard=True), dict(smooth_k=True)):
        first = [torch.randn(*shape, generator=g).to(torch.float16) for shape in shapes]
        quantize_fp8(*(t.cuda() for t in first), **opts)
        plans = len(kq._plans)
        fresh = [torch.randn(*shape, generator=g).to(torch.float16) * 5 for shape in shapes]
        gpu = quantize_fp8(*(t.cuda() for t in fresh), **opts)
        assert len(kq._plans) == plans
        cpu = quantize_fp8(*fresh, **opts)
        exact = not opts
        for c, t in zip(cpu[:3], gpu[:3]):
            _codes_close(t.cpu(), c, exact=exact)
        for c, t in zip(cpu[3:], gpu[3:]):
            assert t.shape == (3, 3) and t.is_contiguous()
            torch.testing.assert_close(t.cpu(), c, rtol=0 if exact else 2e-5, atol=0)
