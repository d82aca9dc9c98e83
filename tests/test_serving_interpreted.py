"""The Triton serving variant (varlen, paged KV cache, windows, LSE) run by Triton's interpreter on
CPU against the float64 references: random packings, page tables out of order with NaN in every slot
no sequence uses, windows of every kind, TMA and pointer loads. The interpreter computes in float32
(the kernel's bf16 casts become float32, as the interpreter's bf16 is not numpy's), so the bounds are
float32 round-off: any masking, page or LSE mistake shows up as an O(1) error."""

from __future__ import annotations

import textwrap

import pytest
import torch
from interpreted import run_interpreted

from zyfa_tune.generator.defaults import default_config
from zyfa_tune.kernels import launch

#: run in a fresh interpreter (`run_interpreted`)
_SCRIPT = textwrap.dedent(
    """
    import random, sys
    import torch
    from zyfa_tune.api import window_bounds
    from zyfa_tune.generator.defaults import default_config
    from zyfa_tune.generator.emitted import emitted
    from zyfa_tune.generator.triton import emit as triton_emit
    from zyfa_tune.kernels import launch as L
    from zyfa_tune.tuning.reference import attention_reference, attention_reference_paged, attention_reference_varlen

    L.emit = lambda c, serving=False, **gluon_options: emitted(  # (the Gluon-only LSE and window twins unused)
        c, triton_emit._Emitter(c, serving).source().replace("tl.bfloat16", "tl.float32")
    )

    def cu(ls):
        return torch.tensor([0, *torch.tensor(ls, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)

    def paged(lens, ps, hk, d, g):
        counts = [-(-n // ps) for n in lens]
        pages = sum(counts) + 2
        free = torch.randperm(pages, generator=g).tolist()
        table = torch.full((len(lens), max(counts) + 1), 10**6, dtype=torch.int32)
        for b, c in enumerate(counts):
            table[b, :c] = torch.tensor([free.pop() for _ in range(c)], dtype=torch.int32)
        kc, vc = (torch.full((pages, ps, hk, d), float("nan")) for _ in "kv")
        for b, n in enumerate(lens):
            for r in range(n):
                page = int(table[b, r // ps])
                kc[page, r % ps], vc[page, r % ps] = torch.randn(2, hk, d, generator=g)
        return kc, vc, table, torch.tensor(lens, dtype=torch.int32)

    loads, trials = sys.argv[1], int(sys.argv[2])
    base = default_config("bf16", 64, 64).replace(loads=loads, num_stages=1)
    rnd, g = random.Random(1), torch.Generator().manual_seed(0)
    h, hk, d = 2, 1, 64
    bad = 0
    for trial in range(trials):
        bm, bn = rnd.choice([(64, 32), (64, 64), (128, 32)])
        cfg = base.replace(block_m=bm, block_n=bn)
        causal = rnd.random() < 0.5
        win = tuple(rnd.choice([-1, 0, rnd.randint(0, 100)]) for _ in "lr")
        kind = rnd.choice(["varlen", "varlen paged", "dense", "dense paged"])
        n = rnd.randint(1, 3)
        if kind.startswith("varlen"):
            lq = [rnd.choice([0, 1, rnd.randint(1, 150)]) for _ in range(n)]
            lk = [rnd.choice([0, 1, a, a + rnd.randint(0, 150)]) for a in lq]
        else:
            lq = [rnd.randint(1, 150)] * n
            lk = [lq[0] + rnd.randint(0, 150)] * n
        if kind.endswith("paged"):
            lk = [max(a, b) for a, b in zip(lq, lk)]
        if sum(lq) == 0 or sum(lk) == 0:
            continue
        dense = kind.startswith("dense")
        q = torch.randn(sum(lq), h, d, generator=g)
        out = torch.zeros(sum(lq), h, d)
        lse = torch.empty(n, h, lq[0]) if dense else torch.empty(h, sum(lq))
        q4, out4 = (q.view(n, lq[0], h, d), out.view(n, lq[0], h, d)) if dense else (q[None], out[None])
        cu_q = None if dense else cu(lq)
        max_q = lq[0] if dense else max(lq)
        opts = dict(causal=causal, window_size=win, return_lse=True)
        if kind.endswith("paged"):
            ps = bn * rnd.choice([1, 2])
            kc, vc, table, lens = paged(lk, ps, hk, d, g)
            window = window_bounds(win, causal, table.shape[1] * ps, max_q)
            serving = L.Serving(cu_q, None, max_q if not dense else 0, window, lse, table, lens)
            k4, v4 = kc, vc
            ref, rlse = attention_reference_paged(q4 if dense else q, kc, vc, table, lens, cu_seqlens_q=cu_q, **opts)
        else:
            k, v = torch.randn(2, sum(lk), hk, d, generator=g)
            window = window_bounds(win, causal, sum(lk), sum(lq))
            if dense:
                k4, v4 = k.view(n, lk[0], hk, d), v.view(n, lk[0], hk, d)
                serving = L.Serving(window=window, lse=lse)
                ref, rlse = attention_reference(q4, k4, v4, **opts)
            else:
                k4, v4 = k[None], v[None]
                serving = L.Serving(cu_q, cu(lk), max_q, window, lse)
                ref, rlse = attention_reference_varlen(q, k, v, cu_q, cu(lk), **opts)
        grid, args, options = L.prepare(cfg, q4, k4, v4, out4, d**-0.5, causal and window is None, serving=serving)
        L.kernel(cfg, True)[grid](*args, **{c: options[c] for c in L._CONSTEXPRS})
        err = (out4.double() - ref).abs().max().item()
        seen = torch.isfinite(rlse)
        lse_err = (lse[seen].double() - rlse[seen]).abs().max().item() if seen.any() else 0.0
        if not (err < 1e-4 and lse_err < 1e-4 and torch.equal(torch.isfinite(lse), seen)):
            bad += 1
            print("BAD", kind, dict(bm=bm, bn=bn, lq=lq, lk=lk, causal=causal, win=win), err, lse_err)
    print("bad", bad)
    """
)


@pytest.mark.parametrize("loads", ["tma", "pointer"])
def test_serving_variant_in_the_interpreter_matches_float64(loads):
    """Windows, LSE and paged caches (dense and packed queries), with both load kinds."""
    out = run_interpreted(_SCRIPT, loads, "60")
    assert out.split()[-2:] == ["bad", "0"], out[-3000:]


def test_tma_descriptors_of_a_paged_cache_span_all_its_pages():
    """K's and V's TMA views are (pages x page_size) rows, not q's batch x page_size: a page past
    the batch size would read as zeros."""
    cfg = default_config("bf16", 64, 64)
    q = torch.zeros(2, 100, 4, 64, dtype=torch.bfloat16)
    cache = torch.zeros(9, 128, 2, 64, dtype=torch.bfloat16)
    specs = launch._descriptor_specs(cfg, q, cache, cache)
    assert [shape for i, shape, _, _ in specs if i == 0] == [[200, 256]]
    assert {tuple(shape) for i, shape, _, _ in specs if i in (1, 2)} == {(9 * 128, 128)}
