"""The float64 reference attention (zyfa_tune/tuning/reference.py) against a naive per-row loop."""

from __future__ import annotations

import math

import pytest
import torch

import zyfa_tune.tuning.reference as reference
from zyfa_tune.tuning.reference import attention_reference, max_abs_err, rel_l2


def naive_attention(q, k, v, causal, scale=None, q_descale=None, k_descale=None, v_descale=None):
    """One query row at a time, with plain Python loops over batch, head and row."""
    b, sq, h, d = q.shape
    sk, hk, dv = k.shape[1], k.shape[2], v.shape[3]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.zeros(b, sq, h, dv, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            kv = hi // (h // hk)
            qs = 1.0 if q_descale is None else float(q_descale[bi, kv])
            ks = 1.0 if k_descale is None else float(k_descale[bi, kv])
            vs = 1.0 if v_descale is None else float(v_descale[bi, kv])
            for i in range(sq):
                last = i + sk - sq if causal else sk - 1  # bottom-right aligned diagonal
                if last < 0:
                    continue  # sees no key: zeros
                qi = q[bi, i, hi].double() * qs
                keys = k[bi, : last + 1, kv].double() * ks
                vals = v[bi, : last + 1, kv].double() * vs
                s = [float(qi @ keys[j]) * scale for j in range(last + 1)]
                m = max(s)
                w = [math.exp(x - m) for x in s]
                total = sum(w)
                row = torch.zeros(dv, dtype=torch.float64)
                for j, wj in enumerate(w):
                    row += (wj / total) * vals[j]
                out[bi, i, hi] = row
    return out


def rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


CASES = [  # b, sq, sk, h, hk, dqk, dv
    (1, 9, 9, 1, 1, 8, 8),
    (2, 7, 7, 4, 2, 16, 8),  # GQA
    (1, 5, 11, 4, 1, 8, 12),  # MQA, more keys than queries
    (2, 11, 5, 2, 2, 8, 8),  # more queries than keys: the first 6 rows see nothing (causal)
    (1, 6, 1, 2, 1, 4, 4),
]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", CASES)
def test_matches_naive(case, causal):
    b, sq, sk, h, hk, dqk, dv = case
    q, k, v = rand(b, sq, h, dqk, seed=1), rand(b, sk, hk, dqk, seed=2), rand(b, sk, hk, dv, seed=3)
    out = attention_reference(q, k, v, causal=causal)
    assert out.shape == (b, sq, h, dv) and out.dtype == torch.float64
    torch.testing.assert_close(out, naive_attention(q, k, v, causal), rtol=1e-12, atol=1e-12)


def test_bottom_right_causal_rows():
    b, sq, sk, h = 1, 6, 4, 1
    q, k, v = rand(b, sq, h, 8, seed=4), rand(b, sk, h, 8, seed=5), rand(b, sk, h, 8, seed=6)
    out = attention_reference(q, k, v, causal=True)
    assert torch.count_nonzero(out[:, : sq - sk]) == 0  # rows 0, 1 see no key
    assert not torch.isnan(out).any()
    # row sq - sk sees exactly key 0: its output is v[0]
    torch.testing.assert_close(out[0, sq - sk, 0], v[0, 0, 0], rtol=1e-14, atol=1e-14)
    # the last row sees every key: same as non-causal
    full = attention_reference(q, k, v, causal=False)
    torch.testing.assert_close(out[:, -1], full[:, -1], rtol=1e-14, atol=1e-14)
    # with more keys than queries, row 0 sees keys 0..sk-sq
    q2 = q[:, :2]
    out2 = attention_reference(q2, k, v, causal=True)
    torch.testing.assert_close(
        out2[:, 0], attention_reference(q2[:, :1], k[:, :3], v[:, :3], causal=False)[:, 0], rtol=1e-13, atol=1e-13
    )


@pytest.mark.parametrize("causal", [True, False])
def test_descales_and_scale(causal):
    b, sq, sk, h, hk = 2, 6, 8, 4, 2
    q, k, v = rand(b, sq, h, 16, seed=7), rand(b, sk, hk, 16, seed=8), rand(b, sk, hk, 8, seed=9)
    qd, kd, vd = (
        torch.rand(b, hk, generator=torch.Generator().manual_seed(s), dtype=torch.float64) + 0.5 for s in (10, 11, 12)
    )
    out = attention_reference(q, k, v, causal=causal, softmax_scale=0.3, q_descale=qd, k_descale=kd, v_descale=vd)
    want = naive_attention(q, k, v, causal, 0.3, qd, kd, vd)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    # the descales matter (so the test above is not vacuous)
    assert max_abs_err(out, attention_reference(q, k, v, causal=causal, softmax_scale=0.3)) > 0.01


def test_fp8_and_bf16_inputs_with_float32_descales():
    b, sq, h, hk, d = 1, 5, 2, 1, 16
    q = rand(b, sq, h, d, seed=13).to(torch.float8_e4m3fn)
    k = rand(b, sq, hk, d, seed=14).to(torch.float8_e4m3fn)
    v = rand(b, sq, hk, d, seed=15).to(torch.bfloat16)
    qd = torch.full((b, hk), 0.25)
    out = attention_reference(q, k, v, q_descale=qd)
    assert out.dtype == torch.float64
    want = naive_attention(q.double(), k.double(), v.double(), True, q_descale=qd.double())
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)


def test_chunked_rows_match(monkeypatch):
    """Queries are processed in chunks of _CHUNK rows; a tiny chunk must give the same result."""
    q, k, v = rand(2, 13, 4, 8, seed=16), rand(2, 17, 2, 8, seed=17), rand(2, 17, 2, 8, seed=18)
    whole = attention_reference(q, k, v, causal=True)
    monkeypatch.setattr(reference, "_CHUNK", 3)
    chunked = attention_reference(q, k, v, causal=True)
    torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-15)
    torch.testing.assert_close(chunked, naive_attention(q, k, v, True), rtol=1e-12, atol=1e-12)


def test_rel_l2_and_max_abs_err():
    x = rand(3, 4, 5, seed=19)
    assert rel_l2(x, x) == 0.0 and max_abs_err(x, x) == 0.0
    assert rel_l2(2 * x, x) == pytest.approx(1.0, rel=1e-15)
    assert rel_l2(torch.zeros_like(x), x) == pytest.approx(1.0, rel=1e-15)
    y = x.clone()
    y[1, 2, 3] += 0.5
    assert max_abs_err(y, x) == pytest.approx(0.5, rel=1e-12)
    assert max_abs_err(x, y) == pytest.approx(0.5, rel=1e-12)
    assert rel_l2(y, x) == pytest.approx(0.5 / float(torch.linalg.vector_norm(x)), rel=1e-12)
    # other dtypes are compared in float64
    xb = x.to(torch.bfloat16)
    assert 0 < rel_l2(xb, x) < 2.0**-8
    assert isinstance(rel_l2(xb, x), float) and isinstance(max_abs_err(xb, x), float)
    # NaN anywhere propagates
    y[0, 0, 0] = float("nan")
    assert math.isnan(rel_l2(y, x))
    assert math.isnan(max_abs_err(y, x))


# ---- windows, LSE and packed sequences -------------------------------------------------------------


def naive_window_lse(q, k, v, causal, window, scale):
    """Per row: the keys FlashAttention-3's window_size lets it see (written out as the rule reads),
    the softmax over them, and the natural-log sum of exp(scores) (-inf, zeros where none)."""
    b, sq, h, d = q.shape
    sk, hk, dv = k.shape[1], k.shape[2], v.shape[3]
    left, right = window
    right = 0 if causal else right
    out = torch.zeros(b, sq, h, dv, dtype=torch.float64)
    lse = torch.full((b, h, sq), float("-inf"), dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            kv = hi // (h // hk)
            for i in range(sq):
                diag = i + sk - sq
                seen = [j for j in range(sk) if (right < 0 or j <= diag + right) and (left < 0 or j >= diag - left)]
                if not seen:
                    continue
                s = torch.tensor([float(q[bi, i, hi] @ k[bi, j, kv]) * scale for j in seen], dtype=torch.float64)
                lse[bi, hi, i] = float(torch.logsumexp(s, 0))
                p = torch.softmax(s, 0)
                out[bi, i, hi] = sum(p[n] * v[bi, j, kv] for n, j in enumerate(seen))
    return out, lse


@pytest.mark.parametrize(
    "causal,window",
    [
        (True, (-1, -1)),
        (False, (-1, -1)),
        (True, (2, -1)),
        (True, (0, 5)),
        (False, (3, 1)),
        (False, (-1, 0)),
        (False, (1, -1)),
    ],
)
@pytest.mark.parametrize("shape", [(2, 7, 7), (1, 5, 11), (1, 9, 4)])
def test_windows_and_lse_match_the_rule_written_out(causal, window, shape):
    b, sq, sk = shape
    q, k, v = rand(b, sq, 4, 8, seed=20), rand(b, sk, 2, 8, seed=21), rand(b, sk, 2, 8, seed=22)
    out, lse = attention_reference(q, k, v, causal=causal, window_size=window, return_lse=True, softmax_scale=0.4)
    want_out, want_lse = naive_window_lse(q, k, v, causal, window, 0.4)
    assert lse.shape == (b, 4, sq)
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)  # -inf where a row sees nothing
    plain = attention_reference(q, k, v, causal=causal, softmax_scale=0.4)
    assert torch.equal(plain, out) == (window[0] == -1 and (window[1] == -1 or causal))


def test_lse_includes_the_descales():
    q, k, v = rand(2, 6, 4, 8, seed=23), rand(2, 6, 2, 8, seed=24), rand(2, 6, 2, 8, seed=25)
    qd = torch.full((2, 2), 0.5, dtype=torch.float64)
    _, lse = attention_reference(q, k, v, q_descale=qd, return_lse=True)
    _, want = attention_reference(q * 0.5, k, v, return_lse=True)
    torch.testing.assert_close(lse, want, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (-1, -1)), (True, (3, -1)), (False, (2, 4))])
def test_packed_reference_is_the_reference_of_each_sequence(causal, window):
    """Sequences of lengths 0, 1, odd and more keys than queries (and the reverse), each with its
    own descales: every sequence's rows are attention_reference of that sequence alone."""
    lq, lk = [3, 0, 1, 7, 5, 2], [3, 4, 1, 9, 2, 0]
    cq = torch.tensor([0, *torch.tensor(lq).cumsum(0).tolist()], dtype=torch.int32)
    ck = torch.tensor([0, *torch.tensor(lk).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = rand(sum(lq), 4, 8, seed=26), rand(sum(lk), 2, 8, seed=27), rand(sum(lk), 2, 6, seed=28)
    ds = {n: rand(6, 2, seed=30 + i).abs() + 0.5 for i, n in enumerate(("q_descale", "k_descale", "v_descale"))}
    out, lse = reference.attention_reference_varlen(
        q, k, v, cq, ck, causal=causal, window_size=window, return_lse=True, **ds
    )
    assert out.shape == (sum(lq), 4, 6) and lse.shape == (4, sum(lq))
    for i in range(len(lq)):
        rows, keys = slice(int(cq[i]), int(cq[i + 1])), slice(int(ck[i]), int(ck[i + 1]))
        one = {n: d[i : i + 1] for n, d in ds.items()}
        want, want_lse = attention_reference(
            q[None, rows], k[None, keys], v[None, keys], causal=causal, window_size=window, return_lse=True, **one
        )
        torch.testing.assert_close(out[rows], want[0], rtol=1e-13, atol=1e-13)
        torch.testing.assert_close(lse[:, rows], want_lse[0], rtol=1e-13, atol=1e-13)
    assert (lse[:, int(cq[5]) : int(cq[6])] == float("-inf")).all()  # the last sequence has no keys
    assert (out[int(cq[5]) :] == 0).all()
