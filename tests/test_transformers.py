"""The transformers adapter on the CPU: it imports without transformers; `register` fills both
registries; a tiny Llama model with attn_implementation="zyfa_tune" routes every attention call
through it, with zyfa_tune's kernels replaced by CPU stand-ins that record their arguments and
compute exact attention, so shapes, layouts, GQA, scaling, causality and the detection of padding
and packing are checked against the same model on SDPA, on FP8 codes of the per-sequence quantiser
too; and the refused cases. The GPU run is tests/test_gpu_transformers.py."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from zyfa_tune.integrations import transformers as zt
from zyfa_tune.quantize import quantize_fp8_varlen
from zyfa_tune.tuning.reference import attention_reference_varlen, rel_l2

try:  # an optional extra; a transformers that fails to import for another reason fails here, loudly
    import transformers
except ModuleNotFoundError:
    transformers = None

ROOT = Path(__file__).resolve().parents[1]
NAME = "zyfa_tune_test"


def test_the_adapter_imports_without_transformers():
    """transformers is an optional extra: the module imports with it absent, and `register` says
    what to install."""
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "import zyfa_tune.integrations.transformers as t\n"
        "try:\n    t.register()\nexcept ImportError as e:\n    print('refused:', e)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "refused:" in run.stdout and "zyfa-tune[hf]" in run.stdout


class _Calls:
    """CPU stand-ins for zyfa_tune's `attention` and `attention_varlen`: exact attention (causal masks
    bottom-right aligned, as zyfa_tune's), every call's arguments recorded."""

    def __init__(self) -> None:
        self.dense: list[dict] = []
        self.packed: list[dict] = []
        self.quantised = False  # packed calls on the per-sequence quantiser's FP8 codes

    def attention(self, q, k, v, causal=True, softmax_scale=None, *, window_size=(-1, -1), error_budget=None):
        call = dict(q=q.shape, k=k.shape, causal=causal, scale=softmax_scale, window=window_size, budget=error_budget)
        self.dense.append(call)
        mask = _fa3_mask(q.shape[1], k.shape[1], causal, window_size)
        out = F.scaled_dot_product_attention(
            *(t.transpose(1, 2) for t in (q, k, v)), attn_mask=mask, scale=softmax_scale, enable_gqa=True
        )
        return out.transpose(1, 2)

    def attention_varlen(
        self, q, k, v, cu_q, cu_k, max_q, max_k, causal=True, softmax_scale=None, *, window_size=(-1, -1), error_budget
    ):
        shapes = dict(q=q.shape, k=k.shape, max=(max_q, max_k), window=window_size, budget=error_budget)
        self.packed.append(dict(cu_q=cu_q.tolist(), cu_k=cu_k.tolist(), **shapes))
        assert cu_q.dtype == cu_k.dtype == torch.int32 and isinstance(max_q, int) and isinstance(max_k, int)
        descales = {}
        if self.quantised:
            q, k, v, *scales = quantize_fp8_varlen(q, k, v, cu_q, cu_k)
            descales = dict(zip(("q_descale", "k_descale", "v_descale"), scales))
        options = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size)
        out = attention_reference_varlen(q, k, v, cu_q, cu_k, **options, **descales)
        return out.to(torch.bfloat16)


def _fa3_mask(sq: int, sk: int, causal: bool, window: tuple[int, int]) -> torch.Tensor:
    """FlashAttention-3's mask, as zyfa_tune's kernels apply it: query i sees keys j with
    i + sk - sq - left <= j <= i + sk - sq + right, -1 unbounded, causal making right 0."""
    diag = torch.arange(sq)[:, None] + (sk - sq)
    keys = torch.arange(sk)[None]
    left, right = window[0], 0 if causal else window[1]
    mask = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        mask &= keys >= diag - left
    if right >= 0:
        mask &= keys <= diag + right
    return mask


@pytest.fixture
def stand_ins(monkeypatch):
    """The CPU stand-ins in place of zyfa_tune's attention calls."""
    stand_in = _Calls()
    monkeypatch.setattr(zt, "attention", stand_in.attention)
    monkeypatch.setattr(zt, "attention_varlen", stand_in.attention_varlen)
    return stand_in


@pytest.fixture
def calls(stand_ins, monkeypatch):
    """The stand-ins, and zyfa_tune registered as NAME; both registries restored afterwards."""
    if transformers is None:
        pytest.skip("needs transformers (pip install 'zyfa-tune[hf]')")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    for registry in (AttentionInterface, AttentionMaskInterface):
        monkeypatch.setattr(registry, "_global_mapping", dict(registry._global_mapping))
    assert zt.register(NAME, error_budget=1.5) == NAME
    return stand_ins


def _models(heads=4, kv_heads=2, head_dim=16, layers=2):
    """The same random-weight tiny Llama twice: on zyfa_tune (NAME) and on SDPA."""
    cfg = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=head_dim, vocab_size=100,
    )  # fmt: skip
    torch.manual_seed(0)
    ours = transformers.LlamaForCausalLM(copy.deepcopy(cfg)).to(torch.bfloat16).eval()
    sdpa = transformers.LlamaForCausalLM(copy.deepcopy(cfg)).to(torch.bfloat16).eval()
    sdpa.load_state_dict(ours.state_dict())
    ours.set_attn_implementation(NAME)
    sdpa.set_attn_implementation("sdpa")
    return ours, sdpa


def _ids(*shape):
    return torch.randint(0, 100, shape, generator=torch.Generator().manual_seed(1))


def test_register_fills_both_registries(calls):
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    assert NAME in AttentionInterface._global_mapping
    assert AttentionMaskInterface._global_mapping[NAME] is flash_attention_mask
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=10,
        attn_implementation=NAME,
    ))  # fmt: skip
    assert model.config._attn_implementation == NAME


@pytest.mark.parametrize("name", ["", "sdpa", "eager", "org/kernel", "paged|x", 3])
def test_register_refuses_bad_names(name):
    with pytest.raises(ValueError, match="name"):
        zt.register(name)


@pytest.mark.parametrize("budget", [0, -1.0, float("inf"), True, "1"])
def test_register_refuses_bad_error_budgets(budget):
    with pytest.raises(ValueError, match="error_budget"):
        zt.register(NAME, error_budget=budget)


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (4, 1)])
def test_a_batched_causal_forward_runs_dense_in_fa3_layout(calls, heads, kv_heads):
    ours, sdpa = _models(heads, kv_heads)
    ids = _ids(3, 11)
    with torch.inference_mode():
        got, want = ours(ids).logits, sdpa(ids).logits
    assert len(calls.dense) == 2 and not calls.packed  # one call a layer
    for c in calls.dense:
        assert c["q"] == (3, 11, heads, 16) and c["k"] == (3, 11, kv_heads, 16)
        assert c["causal"] is True and c["scale"] == 16**-0.5 and c["budget"] == 1.5
    assert rel_l2(got, want) < 1e-2


def test_an_all_ones_mask_is_a_dense_batch(calls):
    ours, sdpa = _models()
    ids = _ids(2, 9)
    with torch.inference_mode():
        got, want = ours(ids, attention_mask=torch.ones(2, 9, dtype=torch.long)).logits, sdpa(ids).logits
    assert calls.dense and not calls.packed
    assert rel_l2(got, want) < 1e-2


def test_a_padded_batch_is_unpadded_into_packed_sequences(calls):
    """Left and right padding: only real tokens are attended to and attend; padded rows are zeros."""
    ours, sdpa = _models()
    ids = _ids(3, 10)
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[0, :4] = 0  # left padding
    mask[2, 7:] = 0  # right padding
    with torch.inference_mode():
        got, want = ours(ids, attention_mask=mask).logits, sdpa(ids, attention_mask=mask).logits
    assert not calls.dense and len(calls.packed) == 2
    c = calls.packed[0]
    assert c["q"] == (23, 4, 16) and c["k"] == (23, 2, 16)
    assert c["cu_q"] == c["cu_k"] == [0, 6, 16, 23] and c["max"] == (10, 10) and c["budget"] == 1.5
    real = mask.bool()
    assert rel_l2(got[real], want[real]) < 1e-2


def _packed_against_separate(ours, sdpa, lengths, **kwargs):
    ids = _ids(1, sum(lengths))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.inference_mode():
        got = ours(ids, position_ids=positions, **kwargs).logits
        starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
        want = torch.cat([sdpa(ids[:, a:b]).logits for a, b in zip(starts, starts[1:])], dim=1)
        whole = sdpa(ids).logits  # the same tokens as one sequence
    return got, want, whole


def test_restarting_position_ids_are_packed_sequences(calls):
    """DataCollatorWithFlattening's form: one row, positions restarting at each sequence."""
    ours, sdpa = _models()
    lengths = [4, 1, 7, 3]
    got, want, whole = _packed_against_separate(ours, sdpa, lengths)
    assert not calls.dense and len(calls.packed) == 2
    assert calls.packed[0]["cu_q"] == [0, 4, 5, 12, 15] and calls.packed[0]["max"] == (7, 7)
    assert rel_l2(got, want) < 1e-2
    assert rel_l2(whole, want) > 0.1  # the check would see attention across the sequences' boundaries


def test_flash_attention_keyword_arguments_are_packed_sequences(calls):
    """DataCollatorWithFlattening(return_flash_attn_kwargs=True)'s form: cumulative lengths given."""
    ours, sdpa = _models()
    lengths = [6, 2, 5]
    cu = torch.tensor([0, 6, 8, 13], dtype=torch.int64)
    kw = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=6, max_length_k=6)
    got, want, _ = _packed_against_separate(ours, sdpa, lengths, **kw)
    assert calls.packed[0]["cu_q"] == [0, 6, 8, 13] and calls.packed[0]["max"] == (6, 6)
    assert rel_l2(got, want) < 1e-2


def test_greedy_generation_matches_sdpa(calls):
    """Prefill then decode steps over the KV cache: one query against every cached key (causal
    masks bottom-right aligned)."""
    ours, sdpa = _models()
    ids = _ids(1, 6)
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        got, want = ours.generate(ids, **kw), sdpa.generate(ids, **kw)
    assert any(c["q"][1] == 1 and c["k"][1] > 1 for c in calls.dense)
    assert torch.equal(got, want)


def test_left_padded_batched_generation_matches_sdpa(calls):
    """A padded batch over the KV cache: each decode step's query is the mask's last column, its
    keys the row's real tokens."""
    ours, sdpa = _models()
    ids = _ids(2, 7)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :3] = 0
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        got, want = ours.generate(ids, **kw), sdpa.generate(ids, **kw)
    steps = [c for c in calls.packed if c["cu_q"] == [0, 1, 2]]  # decode steps: one query a row
    assert steps and all(c["cu_k"][1] - (c["cu_k"][2] - c["cu_k"][1]) == 3 for c in steps)  # row 1: 3 keys fewer
    assert torch.equal(got, want)


def test_fp8_packed_forward_stays_near_sdpa(calls):
    """The real per-sequence quantiser (FP8 codes, exact attention on them): the logits stay within
    FP8 rounding of SDPA's, far below what attention across sequence boundaries would cost."""
    calls.quantised = True
    ours, sdpa = _models(heads=4, kv_heads=2, head_dim=32)
    got, want, whole = _packed_against_separate(ours, sdpa, [13, 1, 30, 8])
    assert 0 < rel_l2(got, want) < 0.1 < rel_l2(whole, want)


def _qkv(b=1, h=4, hk=2, s=8, d=16, dtype=torch.bfloat16, grad=False):
    q, k, v = (torch.randn(b, n, s, d, dtype=dtype, requires_grad=grad) for n in (h, hk, hk))
    return q, k, v


@pytest.mark.parametrize(
    "change, exc, match",
    [
        (dict(dtype=torch.float32), TypeError, "query: dtype torch.float32"),
        (dict(dropout=0.1), ValueError, "dropout"),
        (dict(output_attentions=True), ValueError, "output_attentions"),
        (dict(softcap=30.0), ValueError, "softcap"),
        (dict(s_aux=torch.zeros(4)), ValueError, "s_aux"),
        (dict(sliding_window=0), ValueError, "sliding_window: expected a positive int"),
        (dict(sliding_window=2.5), ValueError, "sliding_window: expected a positive int"),
        (dict(attention_mask=torch.zeros(1, 1, 8, 8, dtype=torch.bool)), ValueError, "attention_mask"),
        (dict(cu_seq_lens_q=torch.tensor([0, 8])), ValueError, "cu_seq_lens_k, max_length_q, max_length_k: missing"),
        (dict(grad=True), RuntimeError, "forward-only"),
    ],
)
def test_unsupported_calls_are_refused_naming_the_argument(stand_ins, change, exc, match):
    shape = {n: change.pop(n) for n in ("dtype", "grad") if n in change}
    mask = change.pop("attention_mask", None)
    with pytest.raises(exc, match=match):
        zt.attention_forward(torch.nn.Module(), *_qkv(**shape), mask, **change)
    assert not stand_ins.dense and not stand_ins.packed


def test_problems_are_reported_together(stand_ins):
    q, k, v = _qkv(dtype=torch.float32)
    with pytest.raises(TypeError) as info:
        zt.attention_forward(torch.nn.Module(), q, k, v, None, dropout=0.5, output_attentions=True)
    assert all(word in str(info.value) for word in ("query", "dropout", "output_attentions"))


def test_a_sliding_window_longer_than_the_keys_runs_unwindowed(stand_ins):
    zt.attention_forward(torch.nn.Module(), *_qkv(), None, sliding_window=8)
    assert stand_ins.dense[0]["window"] == (-1, -1)


@pytest.mark.parametrize("sq, sk", [(12, 12), (1, 12), (5, 12)])
def test_a_sliding_window_of_w_sees_w_keys_including_the_query_s_own(stand_ins, sq, sk):
    """transformers' window of W (its masks: key j seen from query i where i - W < j <= i, bottom-right
    aligned over a cache) against SDPA on that mask written out; a window one key wider or narrower
    would differ."""
    w = 4
    q, _, _ = _qkv(s=sq)
    _, k, v = _qkv(s=sk)
    got, _ = zt.attention_forward(torch.nn.Module(), q, k, v, None, sliding_window=w)
    assert stand_ins.dense[0]["window"] == (w - 1, w - 1)

    def sdpa(width):
        i = torch.arange(sq)[:, None] + sk - sq
        j = torch.arange(sk)[None]
        mask = (j > i - width) & (j <= i)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).transpose(1, 2)

    assert rel_l2(got, sdpa(w)) < 1e-2
    assert rel_l2(got, sdpa(w + 1)) > 0.05 and rel_l2(got, sdpa(w - 1)) > 0.05


def _mistrals(window=4):
    """The same random-weight tiny Mistral (sliding-window attention) on zyfa_tune and on SDPA."""
    cfg = transformers.MistralConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=100, sliding_window=window,
    )  # fmt: skip
    torch.manual_seed(0)
    ours = transformers.MistralForCausalLM(copy.deepcopy(cfg)).to(torch.bfloat16).eval()
    sdpa = transformers.MistralForCausalLM(copy.deepcopy(cfg)).to(torch.bfloat16).eval()
    sdpa.load_state_dict(ours.state_dict())
    ours.set_attn_implementation(NAME)
    sdpa.set_attn_implementation("sdpa")
    return ours, sdpa


def test_a_mistral_sliding_window_matches_sdpa_dense_and_padded(calls):
    """Mistral's sliding window (SDPA builds its own sliding-window mask) on the dense path and, in a
    padded batch, on the packed path; a model without the window would differ."""
    ours, sdpa = _mistrals()
    ids = _ids(2, 11)
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, :3] = 0
    with torch.inference_mode():
        got, want = ours(ids).logits, sdpa(ids).logits
        got_padded, want_padded = ours(ids, attention_mask=mask).logits, sdpa(ids, attention_mask=mask).logits
        unwindowed = _mistrals(window=None)[1](ids).logits
    assert [c["window"] for c in calls.dense] == [(3, 3)] * 2
    assert [c["window"] for c in calls.packed] == [(3, 3)] * 2
    assert rel_l2(got, want) < 1e-2 and rel_l2(unwindowed, want) > 0.05
    real = mask.bool()
    assert rel_l2(got_padded[real], want_padded[real]) < 1e-2


def test_mistral_greedy_generation_past_the_window_matches_sdpa(calls):
    ours, sdpa = _mistrals()
    ids = _ids(1, 7)
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        got, want = ours.generate(ids, **kw), sdpa.generate(ids, **kw)
    assert any(c["window"] == (3, 3) for c in calls.dense)
    assert torch.equal(got, want)


def test_packed_positions_over_a_cache_prefix_are_refused(stand_ins):
    q, _, _ = _qkv(s=4)
    _, k, v = _qkv(s=8)
    with pytest.raises(ValueError, match="position_ids: restart"):
        zt.attention_forward(torch.nn.Module(), q, k, v, None, position_ids=torch.tensor([[0, 1, 0, 1]]))


def test_a_non_causal_module_runs_non_causal(stand_ins):
    module = torch.nn.Module()
    module.is_causal = False
    zt.attention_forward(module, *_qkv(), None)
    zt.attention_forward(torch.nn.Module(), *_qkv(), None, is_causal=False)
    assert [c["causal"] for c in stand_ins.dense] == [False, False]
