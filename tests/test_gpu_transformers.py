"""GPU tests of the transformers adapter: a Llama-architecture model with random weights runs on
zyfa_tune's FP8 kernels through transformers' attention registry, and its logits are compared with
the same model's on SDPA: a batched causal forward, a padded batch, and a packed forward of
sequences of different lengths (against each sequence run alone on SDPA)."""

from __future__ import annotations

import copy

import pytest
import torch

from zyfa_tune.integrations import transformers as zt
from zyfa_tune.tuning.reference import rel_l2

transformers = pytest.importorskip("transformers", exc_type=ModuleNotFoundError)

pytestmark = pytest.mark.gpu

#: rel. L2 bound of the logits against SDPA's. With FP8 input rounding emulated on the CPU (exact
#: attention on per-sequence FP8 codes), this model's logits lie 0.04 from SDPA's (head dim 64,
#: the packed forward below); the kernels' FP8 P@V and their softmax add about as much again
#: (tests/test_gpu_varlen.py bounds the kernel alone at 0.05 of float64 on FP8 codes). Attention
#: across the packed sequences' boundaries moves the logits by about 1.1, far outside the bound
#: (asserted below, so a packing mistake cannot pass).
LOGITS_BOUND = 0.15
#: packed sequence lengths: a single token, odd lengths, block edges, a long one
LENGTHS = [300, 1, 77, 1024, 129, 64]
LAYERS = 4


@pytest.fixture(scope="module", params=[64, 128], ids=lambda d: f"hd{d}")
def models(request):
    """(ours, sdpa): one random-weight bf16 Llama model (hidden 512, 8 heads, 2 KV heads) on
    zyfa_tune and on SDPA."""
    name = zt.register()
    cfg = transformers.LlamaConfig(
        hidden_size=512, intermediate_size=1024, num_hidden_layers=LAYERS, num_attention_heads=8,
        num_key_value_heads=2, head_dim=request.param, vocab_size=1000, max_position_embeddings=4096,
    )  # fmt: skip
    torch.manual_seed(0)
    sdpa = transformers.LlamaForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16).eval()
    ours = copy.deepcopy(sdpa)
    sdpa.set_attn_implementation("sdpa")
    ours.set_attn_implementation(name)
    return ours, sdpa


@pytest.fixture
def spy(monkeypatch):
    """Counts the adapter's calls into zyfa_tune (so a silent fallback to another backend fails)."""
    counts = {"dense": 0, "packed": 0}

    def counted(kind, fn):
        def call(*args, **kwargs):
            counts[kind] += 1
            return fn(*args, **kwargs)

        return call

    monkeypatch.setattr(zt, "attention", counted("dense", zt.attention))
    monkeypatch.setattr(zt, "attention_varlen", counted("packed", zt.attention_varlen))
    return counts


def _ids(*shape: int) -> torch.Tensor:
    return torch.randint(0, 1000, shape, device="cuda", generator=torch.Generator("cuda").manual_seed(0))


def test_batched_causal_forward_matches_sdpa(models, spy):
    ours, sdpa = models
    ids = _ids(2, 1000)
    with torch.inference_mode():
        got, want = ours(ids).logits, sdpa(ids).logits
    assert spy == {"dense": LAYERS, "packed": 0}
    assert torch.isfinite(got).all()
    assert rel_l2(got, want) < LOGITS_BOUND, f"rel L2 {rel_l2(got, want):.3e}"


def test_padded_batch_matches_sdpa_on_real_tokens(models, spy):
    ours, sdpa = models
    ids = _ids(3, 512)
    mask = torch.ones(3, 512, dtype=torch.long, device="cuda")
    mask[0, :100] = 0  # left padding
    mask[2, 300:] = 0  # right padding
    with torch.inference_mode():
        got, want = ours(ids, attention_mask=mask).logits, sdpa(ids, attention_mask=mask).logits
    assert spy == {"dense": 0, "packed": LAYERS}
    real = mask.bool()
    assert rel_l2(got[real], want[real]) < LOGITS_BOUND, f"rel L2 {rel_l2(got[real], want[real]):.3e}"


def test_packed_forward_matches_each_sequence_on_sdpa(models, spy):
    """One row of packed sequences, position ids restarting at each (transformers'
    DataCollatorWithFlattening), against each sequence alone on SDPA."""
    ours, sdpa = models
    ids = _ids(1, sum(LENGTHS))
    positions = torch.cat([torch.arange(n, device="cuda") for n in LENGTHS])[None]
    starts = [0, *torch.tensor(LENGTHS).cumsum(0).tolist()]
    with torch.inference_mode():
        got = ours(ids, position_ids=positions).logits
        want = torch.cat([sdpa(ids[:, a:b]).logits for a, b in zip(starts, starts[1:])], dim=1)
        across = sdpa(ids, position_ids=positions, use_cache=False).logits  # SDPA's own packing mask
        whole = sdpa(ids).logits  # the tokens as one sequence: attention across the boundaries
    assert spy == {"dense": 0, "packed": LAYERS}
    assert torch.isfinite(got).all()
    assert rel_l2(got, want) < LOGITS_BOUND, f"rel L2 {rel_l2(got, want):.3e}"
    assert rel_l2(across, want) < 0.02, "SDPA's packed mask and separate runs agree (bf16 rounding)"
    assert rel_l2(whole, want) > 4 * LOGITS_BOUND, "the bound tells packed from unpacked attention"
