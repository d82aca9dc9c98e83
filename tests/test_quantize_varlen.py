"""The packed-sequence quantiser (`quantize_fp8_varlen`, kernels/quantize.py `quantize_packed`): on the CPU
each sequence's codes and descales are `quantize_fp8`'s on that sequence alone, arguments are checked
naming the argument, and the launch plan puts Q, K and V in one launch per pass with a grid sized from
the shapes; on the GPU the passes give the CPU's codes and descales bitwise for random packings, read
strided inputs, and run inside a CUDA graph with lengths that change between replays."""

from __future__ import annotations

import pytest
import torch

from zyfa_tune.kernels.quantize import _Plan, _tiles, quantize_packed, quantize_packed_reference, scale_row
from zyfa_tune.quantize import quantize_fp8, quantize_fp8_varlen

FP8 = torch.float8_e4m3fn
#: lengths 0 and 1, odd ones, row-block edges (16 and 32 rows a block), and longer ones
LENGTHS = [0, 1, 2, 15, 16, 17, 31, 33, 63, 100, 257, 1000]


def _cu(lengths: list[int], device="cpu") -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.long).cumsum(0).tolist()], dtype=torch.int32).to(device)


def _packed(lq, lk, h, hk, dqk, dv, dtype, seed, device="cpu"):
    """q, k, v packed from N(0.5, 3^2) rows, each sequence scaled differently (so that one scale for all
    would differ from one per sequence)."""
    g = torch.Generator().manual_seed(seed)

    def rows(lengths, heads, d):
        x = torch.randn(sum(lengths), heads, d, generator=g) * 3 + 0.5
        gain = torch.cat([torch.full((n,), 4.0 ** (i % 5 - 2)) for i, n in enumerate(lengths)] or [torch.zeros(0)])
        return (x * gain[:, None, None]).to(dtype).to(device)

    return rows(lq, h, dqk), rows(lk, hk, dqk), rows(lk, hk, dv)


def _equal_codes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("h, hk", [(4, 4), (8, 2)])
def test_each_sequence_is_quantize_fp8_on_that_sequence(dtype, h, hk):
    """The CPU path (the GPU tests' reference): per sequence, bitwise the per-batch quantiser on that
    sequence as a batch of one; an empty sequence's descale is an all-zero sequence's (the floor's)."""
    lq, lk = [5, 0, 17, 1, 33], [7, 0, 17, 2, 0]
    q, k, v = _packed(lq, lk, h, hk, 64, 32, dtype, seed=1)
    cq, ck = _cu(lq), _cu(lk)
    q8, k8, v8, qd, kd, vd = quantize_fp8_varlen(q, k, v, cq, ck)
    assert all(t.dtype == FP8 for t in (q8, k8, v8)) and (q8.shape, k8.shape, v8.shape) == (q.shape, k.shape, v.shape)
    assert all(d.shape == (len(lq), hk) and d.dtype == torch.float32 for d in (qd, kd, vd))
    # an empty sequence is quantised as one zero row would be (amax 0: the floor's descale, no codes)
    alone = lambda x, r: x[None, r] if r.stop > r.start else torch.zeros(1, 1, *x.shape[1:], dtype=dtype)  # noqa: E731
    for i in range(len(lq)):
        rq, rk = slice(int(cq[i]), int(cq[i + 1])), slice(int(ck[i]), int(ck[i + 1]))
        want = quantize_fp8(alone(q, rq), alone(k, rk), alone(v, rk))
        for got, w in zip((q8[rq], k8[rk], v8[rk]), want[:3]):
            assert _equal_codes(got, w[0, : got.shape[0]])
        for got, w in zip((qd[i], kd[i], vd[i]), want[3:]):
            assert torch.equal(got, w[0])


def test_a_scale_per_sequence_is_not_one_for_all():
    """Sequences of different magnitudes get different scales (so the check above tells a quantiser per
    sequence from one per packed tensor)."""
    q, k, v = _packed([40, 40], [40, 40], 2, 2, 64, 64, torch.bfloat16, seed=2)
    cu = _cu([40, 40])
    qd = quantize_fp8_varlen(q, k, v, cu, cu)[3]
    assert not torch.equal(qd[0], qd[1])


@pytest.mark.parametrize(
    "change, exc, match",
    [
        (dict(q=torch.zeros(1, 4, 2, 16)), ValueError, "q: expected 3 dims"),
        (dict(k=torch.zeros(4, 2, 16, dtype=torch.float16)), TypeError, "k: dtype torch.float16 differs"),
        (dict(v=torch.zeros(4, 2, 16, dtype=torch.int32)), TypeError, "v: expected a floating dtype"),
        (dict(k=torch.zeros(4, 3, 16)), ValueError, "k/v: expected"),
        (dict(k=torch.zeros(4, 2, 32)), ValueError, "k: head_dim 32 differs"),
        (dict(cu_seqlens_q=torch.tensor([0, 4])), TypeError, "cu_seqlens_q: expected an int32 tensor"),
        (dict(cu_seqlens_k=torch.tensor([0, 2, 4], dtype=torch.int32)), ValueError, "cu_seqlens_k: 3 entries"),
        (dict(cu_seqlens_k=torch.zeros(0, dtype=torch.int32)), TypeError, "cu_seqlens_k: expected an int32"),
        (dict(q="q"), TypeError, "q: expected a torch.Tensor"),
    ],
)
def test_bad_arguments_name_the_argument(change, exc, match):
    args = dict(
        q=torch.zeros(4, 2, 16),
        k=torch.zeros(4, 2, 16),
        v=torch.zeros(4, 2, 16),
        cu_seqlens_q=torch.tensor([0, 4], dtype=torch.int32),
        cu_seqlens_k=torch.tensor([0, 4], dtype=torch.int32),
    )
    with pytest.raises(exc, match=match):
        quantize_fp8_varlen(**{**args, **change})


def test_rows_without_a_sequence_are_refused():
    with pytest.raises(ValueError, match="cu_seqlens: no sequence holds"):
        quantize_packed(((torch.zeros(3, 2, 16), torch.zeros(1, dtype=torch.int32)),), 2)


def test_plan_is_one_launch_per_pass_sized_from_the_shapes():
    """Q, K and V of one head dim are three segments of one launch (CPU: a plan is built from shapes
    only); each head has total // rows + sequences program slots (a sequence's blocks start at its
    first row, so up to one more block a sequence than the total needs); scales per (sequence, kv head)."""
    batch, h, hk = 5, 6, 3
    q, k, v = (torch.empty(1, n, heads, 128) for n, heads in ((300, h), (1000, hk), (1000, hk)))
    groups = _Plan([q, k, v], [False] * 3, [False] * 3, hk, packed=batch).groups
    rows = _tiles(128, False)[0]
    assert [(g.members, g.consts["NSEG"], g.consts["PACKED"]) for g in groups] == [((0, 1, 2), 3, True)]
    nq, nk = (300 // rows + batch) * h, (1000 // rows + batch) * hk
    row = scale_row(batch, hk)
    assert groups[0].grid == (nq + 2 * nk,) and groups[0].tail[:5] == (nq, nq + nk, 0, row, 2 * row)
    assert groups[0].tail[-2:] == (batch, 3)  # NSEQ, and the binary search's steps (5 < 2^3)
    assert _Plan([q, k, v], [False] * 3, [False] * 3, hk).groups[0].consts["PACKED"] is False


def test_the_reference_leaves_rows_outside_the_sequences_zero():
    x = torch.randn(10, 2, 16)
    codes, descales = quantize_packed_reference(x, torch.tensor([0, 3, 7], dtype=torch.int32), 2)
    assert (codes[7:].view(torch.uint8) == 0).all() and descales.shape == (2, 2)


# ---- GPU ----------------------------------------------------------------------------------------


def _random_lengths(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [LENGTHS[int(i)] for i in torch.randint(len(LENGTHS), (n,), generator=g)]


def _check_against_reference(q, k, v, cq, ck) -> None:
    got = quantize_fp8_varlen(q, k, v, cq, ck)
    for x, cu, codes, descale in zip((q, k, v), (cq, ck, ck), got[:3], got[3:]):
        want_codes, want_descale = quantize_packed_reference(x.cpu(), cu.cpu(), k.shape[1])
        assert codes.is_cuda and _equal_codes(codes.cpu(), want_codes)
        assert descale.data_ptr() % 16 == 0 and torch.equal(descale.cpu(), want_descale)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("dqk, dv", [(128, 128), (64, 64), (96, 96), (256, 256), (192, 128)])
@pytest.mark.parametrize("h, hk", [(8, 8), (8, 2), (4, 1)])
def test_random_packings_give_the_reference_bitwise(dtype, dqk, dv, h, hk):
    for seed in range(3):
        lq = _random_lengths(7, seed)
        lk = lq if seed == 0 else _random_lengths(7, seed + 100)
        q, k, v = _packed(lq, lk, h, hk, dqk, dv, dtype, seed, device="cuda")
        _check_against_reference(q, k, v, _cu(lq, "cuda"), _cu(lk, "cuda"))


@pytest.mark.gpu
def test_empty_batches_and_one_token_sequences():
    for lengths in ([0], [0, 0, 0], [1], [1, 0, 1, 1], [0] * 40 + [3]):
        q, k, v = _packed(lengths, lengths, 4, 2, 128, 128, torch.bfloat16, seed=len(lengths), device="cuda")
        cu = _cu(lengths, "cuda")
        _check_against_reference(q, k, v, cu, cu)


@pytest.mark.gpu
def test_strided_inputs_and_many_sequences():
    """Q, K and V as views of one fused (total, heads + 2 kv_heads, dim) projection (row stride not the
    heads'), and more sequences than the binary search's first steps cover."""
    lengths = _random_lengths(300, seed=7)
    qkv = torch.randn(sum(lengths), 12, 128, device="cuda").to(torch.bfloat16)
    q, k, v = qkv[:, :8], qkv[:, 8:10], qkv[:, 10:]
    cu = _cu(lengths, "cuda")
    _check_against_reference(q, k, v, cu, cu)


@pytest.mark.gpu
def test_cuda_graph_replays_with_new_lengths():
    """No length is read on the host: a call captured in a CUDA graph, replayed with other values and
    other lengths (same totals and sequence count) written into the captured tensors, gives the
    reference for the new lengths."""
    first, second = [100, 0, 33, 1, 122], [1, 200, 0, 50, 5]
    q, k, v = _packed(first, first, 8, 2, 128, 128, torch.bfloat16, seed=1, device="cuda")
    cu = _cu(first, "cuda")
    quantize_fp8_varlen(q, k, v, cu, cu)  # the eager call that makes the plan and compiles the passes
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = quantize_fp8_varlen(q, k, v, cu, cu)
    for lengths, seed in ((second, 2), (first, 3)):
        fresh = _packed(lengths, lengths, 8, 2, 128, 128, torch.bfloat16, seed=seed, device="cuda")
        for dst, src in zip((q, k, v, cu), (*fresh, _cu(lengths, "cuda"))):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        for x, codes, descale in zip(fresh, out[:3], out[3:]):
            want_codes, want_descale = quantize_packed_reference(x.cpu(), cu.cpu(), 2)
            assert _equal_codes(codes.cpu(), want_codes) and torch.equal(descale.cpu(), want_descale)
