"""The one-pass plain quantiser (kernels/quantize_onepass.py): under Triton's interpreter it gives the torch
path's codes and descales bitwise, and the two passes' (CPU); it compiles for sm_90a without spills, with
its ticket, arrival and amax atomics (CPU); plain calls plan it, other recipes keep the two passes (CPU);
on the GPU it is bitwise the reference at a long prefill's size and runs in a CUDA graph."""

from __future__ import annotations

import re

import pytest
import torch
from interpreted import run_interpreted
from test_quantize import _pass_sass

from zyfa_tune.kernels import quantize as kq
from zyfa_tune.kernels.quantize_onepass import _onepass_kernel, onepass_lag, onepass_tiles
from zyfa_tune.kernels.quantize_passes import _amax_kernel, _codes_kernel
from zyfa_tune.quantize import quantize_fp8

#: the one-pass and two-pass launches (`_launch_tensors`) on CPU tensors in the interpreter, against the torch
#: path. The interpreter's cast to e4m3 truncates where the GPU rounds to nearest even (as torch does): it is
#: replaced by torch's, so the codes can be compared with the reference's bitwise.
_INTERPRETED = """
import numpy as np
import torch
import triton.language as tl
import triton.runtime.interpreter as interp

cast = interp._convert_float


def nearest_e4m3(data, src, dst, rounding):
    if dst != tl.float8e4nv:
        return cast(data, src, dst, rounding)
    return torch.from_numpy(np.ascontiguousarray(data)).float().to(torch.float8_e4m3fn).view(torch.uint8).numpy()


interp._convert_float = nearest_e4m3

from zyfa_tune.kernels import quantize as kq

g = torch.Generator().manual_seed(9)
cases = [  # batch, q tokens, k tokens, q heads, kv heads, head dim, dtype, K-major V, NaN at (tensor, b, s, h, d)
    (2, 300, 17, 4, 2, 64, torch.bfloat16, False, None),
    (1, 17, 300, 6, 2, 96, torch.float16, True, (0, 0, 5, 3, 7)),
    (2, 1, 300, 2, 1, 96, torch.float32, True, (2, 1, 299, 0, 95)),
    (1, 300, 1, 4, 4, 64, torch.bfloat16, False, (1, 0, 0, 2, 0)),
]
for b, sq, sk, h, hk, d, dtype, k_major, nan in cases:
    xs = [(torch.randn(b, s, n, d, generator=g) * 3 + 0.5).to(dtype) for s, n in ((sq, h), (sk, hk), (sk, hk))]
    if nan is not None:
        xs[nan[0]][nan[1:]] = float("nan")
    items = [(x, False, None) for x in xs]
    out = {}
    kq._plans.clear()
    for one in (True, False):  # (ONE_PASS is read at each call: a plan of each)
        kq.ONE_PASS = one
        out[one] = kq._launch_tensors(items, hk, k_major_last=k_major)
    assert sorted(key[0] for key in kq._plans) == [False, True]
    for key, plan in kq._plans.items():
        names = [n for n, *_ in plan.groups[0].kernels]
        assert names == (["quantize_onepass"] if key[0] else ["quantize_amax", "quantize_codes"]), names
        if key[0]:
            chunks, lag = plan.groups[0].tail[-4:-2]
    want = [kq.quantize_heads_reference(x, hk) for x in xs]
    for i, (x, (wc, wd)) in enumerate(zip(xs, want)):
        for one in (True, False):
            codes, descales = out[one][0][i], out[one][1][i]
            assert codes.stride() == (kq._codes_buffer(x, k_major and i == 2).stride())
            assert torch.equal(codes.contiguous().view(torch.uint8), wc.view(torch.uint8)), (i, one)
            assert torch.equal(descales.isnan(), wd.isnan()) and torch.equal(descales.nan_to_num(), wd.nan_to_num())
    if nan is not None:
        assert want[nan[0]][1].isnan().sum() == 1, want
    print("case", chunks, lag)
print("checked", len(cases))
"""


def test_one_pass_in_the_interpreter_is_the_reference_bitwise():
    """Q, K and V in one launch (GQA 2 and 3, MHA, MQA), 1, 17 and 300 tokens, head dims 64 and 96 (padded),
    bf16, fp16 and float32 rows, natural and K-major V, a NaN in one (batch, kv head) of each tensor in turn:
    both the one-pass and the two-pass launches give the torch path's codes and descales bitwise (a NaN
    unit's descale NaN, the others as before); and the blocks outnumber the lag, so ticket t also did pass 2
    of block t - LAG (the lagged reads and the drain past the last block)."""
    out = run_interpreted(_INTERPRETED).split()
    assert out[-2:] == ["checked", "4"], out
    runs = [(int(c), int(lag)) for c, lag in zip(out[1:-2:3], out[2:-2:3])]
    assert len(runs) == 4 and all(chunks > lag > 0 for chunks, lag in runs), runs


@pytest.mark.parametrize(
    "dim,dtype,segments,k_major",
    [
        (128, torch.bfloat16, 3, False),
        (128, torch.bfloat16, 3, True),
        (64, torch.float16, 3, True),
        (96, torch.float32, 3, False),
        (256, torch.bfloat16, 2, False),
        (192, torch.float16, 1, True),
    ],
)
def test_onepass_kernel_compiles_without_spills(dim, dtype, segments, k_major):
    """The one-pass kernel for sm_90a: no local memory; the ticket an atomic add, the amax an integer atomic
    max, the arrival an add after a GPU-scope fence (release), the waits and the amax strong reads (acquire:
    L1 dropped); 16-byte loads of the rows and stores of the codes (or the keys-fastest tile's runs), whatever
    eviction priority they carry; one IEEE division a block."""
    sass, usage = _pass_sass(_onepass_kernel, dim, dtype, False, False, segments, k_major, tiles=onepass_tiles)
    assert usage["LOCAL"] == 0 and usage["STACK"] == 0, usage
    assert re.search(r"\bATOMG\.E\.ADD\b", sass), "the ticket"
    assert re.search(r"\b(REDG?|ATOMG)\.E\.MAX\.S32\b", sass), "the amax's integer atomic max"
    lines = sass.splitlines()
    fences = [i for i, line in enumerate(lines) if re.search(r"\bMEMBAR\.(\w+\.)?GPU\b", line)]
    after = [line for i in fences for line in lines[i + 1 : i + 12]]  # (the next few instructions)
    assert any(re.search(r"\b(REDG?|ATOMG)\.E\.ADD\b", line) for line in after), "release, then the arrival"
    assert re.search(r"\bLDG\.E\.STRONG\.GPU\b", sass) and "CCTL.IVALL" in sass, "acquire reads"
    assert not re.search(r"\bHGMMA\b", sass)
    hint = r"(\.E[LFU])?"  # (an eviction priority)
    assert re.search(rf"LDG\.E{hint}\.128", sass) and not re.search(rf"LDG\.E{hint}\.(U16|64)\b", sass)
    assert "F2FP.SATFINITE.E4M3" in sass and len(re.findall(r"\bFCHK\b", sass)) <= 1
    assert re.search(rf"STG\.E{hint}\.128", sass) and not re.search(rf"STG\.E{hint}\.(U8|U16|64)\b", sass)


@pytest.mark.parametrize("dim,dtype,k_major", [(128, torch.bfloat16, False), (128, torch.bfloat16, True),
                                               (64, torch.float16, True), (256, torch.float32, False)])  # fmt: skip
def test_balanced_onepass_kernel_compiles_without_spills(dim, dtype, k_major):
    """Balanced V in one pass, at its own tiling (`_tiles`'s balanced rows): no local memory; the waits and the
    masks of which keys may move (another program stored them in this launch) read past L1, the keys'
    reductions in registers (no shuffles beyond the two passes' own: pass 1's reductions over the channels),
    the codes rounded as e4m3."""
    sass, usage = _pass_sass(
        _onepass_kernel, dim, dtype, False, False, 1, k_major, True, tiles=lambda d: kq._tiles(d, False, True)
    )
    assert usage["LOCAL"] == 0 and usage["STACK"] == 0, usage
    assert re.search(r"\bLDG\.E\.STRONG\.GPU\b", sass) and "CCTL.IVALL" in sass, "acquire reads"
    two = [
        _pass_sass(kernel, dim, dtype, False, False, 1, k_major, True)[0] for kernel in (_amax_kernel, _codes_kernel)
    ]
    shuffles = [len(re.findall(r"\bSHFL\.", x)) for x in (sass, *two)]
    assert shuffles[0] <= shuffles[1] + shuffles[2] + 8, shuffles
    assert "F2FP.SATFINITE.E4M3" in sass
    assert not k_major or re.search(r"STG\.E(\.E[LFU])?\.128", sass)


def test_plain_calls_plan_one_pass_and_other_recipes_two():
    """A plain call's groups take the one-pass kernel: CHUNKS the blocks of all segments, LAG the most
    blocks of a unit (a kv head's group of q heads), a grid of at most one program a block, and the
    counters after the amaxes in the zeroed buffer (per tensor a 16-byte row of amaxes, as many arrival
    counts, then a ticket a group). A rotated or centred tensor's group takes the two passes and the plain
    or balanced groups beside it one pass; packing or ONE_PASS off: the two passes for all."""
    b, hk = 2, 3
    q, k, v = (torch.empty(b, s, h, 64) for s, h in ((100, 6), (300, 3), (300, 3)))
    rows = onepass_tiles(64)[0]
    plan = kq._Plan([q, k, v], [False] * 3, [False] * 3, hk, onepass=True)
    (group,) = plan.groups
    assert group.kernels[0][:2] == ("quantize_onepass", _onepass_kernel) and len(group.kernels) == 1
    nq, nk = -(-100 // rows) * b * 6, -(-300 // rows) * b * 3
    unit = max(-(-100 // rows) * 2, -(-300 // rows))  # Q's unit: a kv head's two q heads
    assert 0 < group.grid[0] <= nq + 2 * nk and plan.buffer == 2 * 3 * 8 + 4
    assert group.tail[-4:] == (nq + 2 * nk, onepass_lag(unit, group.grid[0]), 3 * 8, 2 * 3 * 8)
    assert onepass_lag(unit, group.grid[0]) >= unit and group.consts["BLOCK_S"] == rows
    # two groups (another head dim for V): a ticket each
    v128 = torch.empty(b, 300, 3, 128)
    two = kq._Plan([q, k, v128], [False] * 3, [False] * 3, hk, onepass=True).groups
    assert [g.tail[-1] for g in two] == [48, 49]
    for opts, passes in (
        (dict(rotates=[True, True, False]), [2, 1]),  # (Q and K rotated, V plain)
        (dict(centres=[False, True, False]), [1, 2]),  # (Q and V plain, K centred alone)
        (dict(balanced=2), [1, 1]),  # (Q and K plain, V balanced alone)
        (dict(packed=2), [2]),
        (dict(onepass=False), [2]),
    ):
        args = {**dict(rotates=[False] * 3, centres=[False] * 3, kv_heads=hk, onepass=True), **opts}
        plan = kq._Plan([q, k, v], args.pop("rotates"), args.pop("centres"), **args)
        assert [len(g.kernels) for g in plan.groups] == passes, opts
        assert all((g.kernels[0][0] == "quantize_amax") == (len(g.kernels) == 2) for g in plan.groups), opts
        assert plan.buffer == (3 * 8 if passes == [2] else 2 * 3 * 8 + 4), opts
    balanced = kq._Plan([q, k, v], [False] * 3, [False] * 3, hk, balanced=2, onepass=True).groups[1]
    assert balanced.consts["BALANCED"] and balanced.consts["BLOCK_S"] == kq.BALANCE_KEYS * kq.BALANCE_BLOCKS


# ---- GPU ----------------------------------------------------------------------------------------


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype == torch.float8_e4m3fn:
        return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    return torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_heads,v_layout", [(32, "natural"), (8, "k_major")])
def test_one_pass_at_a_long_prefill_is_the_reference_and_captures(monkeypatch, kv_heads, v_layout):
    """16K tokens x 32 heads x hd128 bf16 (Q, K and V 128 MB each, more than L2 holds): the one-pass launch
    gives the reference's codes and descales bitwise, and the two passes' outputs; inside a CUDA graph,
    replays on new rows give their codes."""
    monkeypatch.setattr(kq, "_plans", {})
    g = torch.Generator(device="cuda").manual_seed(12)
    q, k, v = (
        (torch.randn(1, 16384, h, 128, device="cuda", generator=g) * 2 + 0.25).to(torch.bfloat16)
        for h in (32, kv_heads, kv_heads)
    )
    monkeypatch.setattr(kq, "ONE_PASS", False)
    two = quantize_fp8(q, k, v, v_layout=v_layout)
    monkeypatch.setattr(kq, "ONE_PASS", True)
    one = quantize_fp8(q, k, v, v_layout=v_layout)
    assert any(g.kernels[0][0] == "quantize_onepass" for p in kq._plans.values() for g in p.groups)
    for i, x in enumerate((q, k, v)):
        wc, wd = kq.quantize_heads_reference(x, kv_heads)
        assert _same(one[i], wc) and _same(one[3 + i], wd), i
        assert one[i].stride() == two[i].stride()
    assert all(_same(a, b) for a, b in zip(one, two))
    # a CUDA graph of the call (warmed up above: compiled and planned), replayed on new rows
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        captured = quantize_fp8(q, k, v, v_layout=v_layout)
    torch.cuda.current_stream().wait_stream(stream)
    for scale in (0.5, 3.0):
        for x in (q, k, v):
            x.mul_(scale)
        graph.replay()
        torch.cuda.synchronize()
        want = quantize_fp8(q, k, v, v_layout=v_layout)
        assert all(_same(a, b) for a, b in zip(captured, want)), scale


@pytest.mark.gpu
@pytest.mark.parametrize("kv_heads,v_layout", [(32, "natural"), (8, "k_major")])
def test_balanced_v_in_one_pass_is_the_two_passes_bitwise(monkeypatch, kv_heads, v_layout):
    """Balanced V in the one-pass launch (which keys may move, stored by pass 1 of other programs of the same
    launch and read back by pass 2) at a long prefill: the two passes' codes and descales bitwise, call after
    call; Q and K beside it in a one-pass launch of their own."""
    monkeypatch.setattr(kq, "_plans", {})
    g = torch.Generator(device="cuda").manual_seed(13)
    q, k, v = (
        (torch.randn(1, 16384, h, 128, device="cuda", generator=g) * 2 + 0.25).to(torch.bfloat16)
        for h in (32, kv_heads, kv_heads)
    )
    opts = dict(v_layout=v_layout, v_rounding="balanced")
    monkeypatch.setattr(kq, "ONE_PASS", False)
    two = quantize_fp8(q, k, v, **opts)
    monkeypatch.setattr(kq, "ONE_PASS", True)
    for _ in range(3):
        one = quantize_fp8(q, k, v, **opts)
        assert all(_same(a, b) for a, b in zip(one, two))
    (plan,) = (p for key, p in kq._plans.items() if key[0])
    assert [(g.kernels[0][0], g.consts["BALANCED"]) for g in plan.groups] == [
        ("quantize_onepass", False),
        ("quantize_onepass", True),
    ]
