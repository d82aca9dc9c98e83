"""Activation-like input families (zyfa_tune/tuning/inputs.py): determinism, shapes, the statistic that
defines each family (checked with the float64 reference), validation, and the way from
`zyfa-tune tune --input-family` to the worker's Task, the probe cache and the database."""

from __future__ import annotations

import math
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from zyfa_tune import cli
from zyfa_tune.db import open_store
from zyfa_tune.kernels import dispatch
from zyfa_tune.tuning.inputs import FAMILIES, FAMILY_NAMES, Family, Outliers, Rope, apply_rope, make_qkv
from zyfa_tune.tuning.reference import attention_reference
from zyfa_tune.tuning.spec import TuneSpec
from zyfa_tune.tuning.verify import make_inputs
from zyfa_tune.tuning.worker import Shape, Task, Worker

SHIPPED = str(Path(dispatch.TUNED_DIR) / "h200.db")
SMALL = dict(batch=1, seqlen=256, heads=4, kv_heads=2, head_dim_qk=64, head_dim_v=32)


def qkv(family, seed=0, **kw):
    return make_qkv(family, seed=seed, **{**SMALL, **kw})


def probabilities(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """(batch, seqlen, heads, seqlen_k) causal softmax rows from the float64 reference: with V the
    identity over keys, the output row is the probability row."""
    b, sk, hk = k.shape[:3]
    eye = torch.eye(sk, dtype=torch.float64).view(1, sk, 1, sk).expand(b, sk, hk, sk)
    return attention_reference(q, k, eye, causal=True)


def scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """(batch, heads, seqlen_q, seqlen_k) float64 q.k / sqrt(d), GQA groups expanded."""
    k = k.double().repeat_interleave(q.shape[2] // k.shape[2], 2)
    return torch.einsum("bihd,bjhd->bhij", q.double(), k) / math.sqrt(q.shape[3])


def long_rows(p: torch.Tensor, at_least: int = 32) -> torch.Tensor:
    """Mask of the causal rows that see at least `at_least` keys (seqlen_q == seqlen_k)."""
    seen = torch.arange(1, p.shape[1] + 1).view(1, -1, 1).expand(p.shape[:3])
    return seen >= at_least


def normalised_entropy(p: torch.Tensor) -> torch.Tensor:
    """Row entropy / log(keys seen), in [0, 1]: 0 = one key, 1 = uniform."""
    seen = torch.arange(1, p.shape[1] + 1, dtype=torch.float64).view(1, -1, 1).clamp_min(2)
    return -(p * p.clamp_min(1e-300).log()).sum(-1) / seen.log()


def channel_ratio(x: torch.Tensor) -> torch.Tensor:
    """(heads, dim) channel RMS over batch and tokens / the head's median channel RMS."""
    rms = x.double().pow(2).mean((0, 1)).sqrt()
    return rms / rms.median(1, keepdim=True).values


# ---- every family --------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_deterministic_per_seed_with_gqa_shapes(family):
    q, k, v = qkv(family, seed=3, seqlen_k=300)
    assert q.shape == (1, 256, 4, 64) and k.shape == (1, 300, 2, 64) and v.shape == (1, 300, 2, 32)
    assert {t.dtype for t in (q, k, v)} == {torch.float32} and q.device.type == "cpu"
    assert all(torch.isfinite(t).all() for t in (q, k, v))
    again = qkv(family, seed=3, seqlen_k=300)
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), again))
    other = qkv(family, seed=4, seqlen_k=300)
    assert not torch.equal(q, other[0]) and not torch.equal(k, other[1])


def test_gaussian_is_the_former_default_and_make_inputs_quantises():
    g = torch.Generator().manual_seed(7)
    expected = [torch.randn(*shape, generator=g) for shape in ((2, 64, 4, 64), (2, 64, 2, 64), (2, 64, 2, 32))]
    got = make_qkv(batch=2, seqlen=64, heads=4, kv_heads=2, head_dim_qk=64, head_dim_v=32, seed=7)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    (q8, k8, v8), kw = make_inputs(
        "fp8", 64, 32, batch=2, heads=4, kv_heads=2, seqlen=64, seed=7, device="cpu", family="outliers"
    )
    assert q8.dtype == torch.float8_e4m3fn and kw["k_descale"].shape == (2, 2)
    _, k, _ = make_qkv("outliers", batch=2, seqlen=64, heads=4, kv_heads=2, head_dim_qk=64, head_dim_v=32, seed=7)
    assert torch.allclose(kw["k_descale"], k.abs().amax(dim=(1, 3)) / 448.0)  # one outlier sets the scale
    (qb, _, _), none = make_inputs(
        "bf16", 64, 32, batch=1, heads=2, kv_heads=2, seqlen=8, seed=0, device="cpu", family="peaky"
    )
    assert qb.dtype == torch.bfloat16 and none == {}


# ---- the defining statistics ---------------------------------------------------------------------


def test_outlier_channels_are_20_to_100x_fixed_per_seed_and_shared_by_q_and_k():
    q, k, v = qkv("outliers", batch=2)
    n = FAMILIES["outliers"].outliers.channels
    for x in (q, k):
        ratio = channel_ratio(x)
        big = ratio > 10
        assert (big.sum(1) == n).all()
        assert ratio[big].min() >= 19 and ratio[big].max() <= 105
    big_k = channel_ratio(k) > 10
    assert torch.equal(channel_ratio(q) > 10, big_k.repeat_interleave(2, 0))  # GQA: the group's channels
    assert (channel_ratio(v) < 3).all()  # no outliers in V
    # fixed per seed: the same channels at another length and batch; other channels for another seed
    assert torch.equal(channel_ratio(qkv("outliers", seqlen=128)[1]) > 10, big_k)
    assert not torch.equal(channel_ratio(qkv("outliers", seed=1)[1]) > 10, big_k)
    # the outliers add ~score_std to the key-varying scores; rows stay far from one-hot
    assert normalised_entropy(probabilities(q, k))[long_rows(q)].mean() > 0.7


@pytest.mark.parametrize("family", ["sink", "llm"])
def test_the_sink_key_takes_the_most_mass_in_most_rows(family):
    q, k, v = qkv(family)
    p = probabilities(q, k)
    rows = long_rows(p)
    assert (p.argmax(-1) == 0)[rows].double().mean() > 0.9
    assert p[..., 0][rows].mean() > 0.4
    assert v[:, 0].abs().mean() < 0.2 * v[:, 1:].abs().mean()  # a small value: a "no-op" sink
    plain = probabilities(*qkv("gaussian")[:2])
    assert (plain.argmax(-1) == 0)[rows].double().mean() < 0.1


def test_peaky_rows_have_low_entropy_and_flat_rows_high():
    entropy = {f: normalised_entropy(probabilities(*qkv(f)[:2])) for f in ("peaky", "gaussian", "flat")}
    rows = long_rows(entropy["flat"][..., None])
    mean = {f: e[rows].mean().item() for f, e in entropy.items()}
    assert mean["peaky"] < 0.3 < mean["gaussian"] < 0.95 < mean["flat"]
    p = probabilities(*qkv("peaky")[:2])
    top4 = p.topk(4, dim=-1).values.sum(-1)
    assert top4[long_rows(p)].mean() > 0.8  # a few keys dominate


def test_rope_rotates_by_position_and_favours_near_keys():
    rope = FAMILIES["rope"].rope
    q, k, _ = qkv("rope")
    # undo the rotation: the pre-RoPE tensors share one mean per kv head at every position
    pre = apply_rope(k, -torch.arange(256), rope.base)
    mean_early, mean_late = pre[:, :128].mean((0, 1)), pre[:, 128:].mean((0, 1))
    assert torch.allclose(mean_early, mean_late, atol=0.35)
    assert (mean_early.norm(dim=-1) ** 2 / 8).sub(rope.locality).abs().max() < 0.6  # |mean|^2/sqrt(d)
    fast = torch.tensor([0, 1, 2, 3, 32, 33, 34, 35])  # the 4 highest-frequency pairs: turned away
    assert (k[:, 128:].mean((0, 1))[:, fast].norm(dim=-1) < 0.5 * mean_late[:, fast].norm(dim=-1)).all()
    assert torch.allclose(apply_rope(pre, torch.arange(256), rope.base), k, atol=1e-5)
    # RoPE's decay: scores of nearby keys are higher than of distant ones
    i = torch.arange(256)
    dist = i[:, None] - i[None, :]

    def near_minus_far(s: torch.Tensor) -> float:
        return float(s[..., (dist >= 0) & (dist < 8)].mean() - s[..., dist >= 128].mean())

    assert near_minus_far(scores(q, k)) > 0.15 * rope.locality  # base 500000: ~30% of the pairs turn away
    assert abs(near_minus_far(scores(*qkv("gaussian")[:2]))) < 0.1


def test_llm_outliers_sit_in_low_frequency_rope_pairs():
    q, k, _ = qkv("llm")
    big = channel_ratio(k) > 10
    pairs = big.nonzero()[:, 1] % 32
    assert (big.sum(1) == 4).all() and (pairs >= 28).all()  # the 4 lowest-frequency pairs of 32


# ---- validation ----------------------------------------------------------------------------------


def test_bad_arguments_name_themselves(tmp_path):
    names = str(list(FAMILY_NAMES))
    with pytest.raises(ValueError, match=r"family: 'lognormal' is not one of \['gaussian'"):
        qkv("lognormal")
    with pytest.raises(ValueError) as info:
        make_inputs("fp8", 64, 64, batch=1, heads=2, kv_heads=2, seqlen=8, seed=0, device="cpu", family="x")
    assert names in str(info.value)
    with pytest.raises(ValueError, match="kv_heads"):
        qkv("sink", heads=4, kv_heads=3)
    with pytest.raises(ValueError, match="seqlen"):
        qkv("gaussian", seqlen=0)
    with pytest.raises(ValueError, match="seed"):
        qkv("gaussian", seed=-1)
    with pytest.raises(ValueError, match="head_dim_qk: RoPE"):
        qkv("rope", head_dim_qk=63)
    with pytest.raises(ValueError, match="outliers.channels"):
        qkv(Family("many", "", outliers=Outliers(channels=33), rope=Rope()))
    with pytest.raises(ValueError, match="outliers.ratio"):
        qkv(Family("inverted", "", outliers=Outliers(ratio=(100.0, 20.0))))
    base = dict(dtype="fp8", head_dim_qk=128, head_dim_v=128, seqlens=(4096,), trials=1)
    with pytest.raises(ValueError, match=r"input_family: 'x' is not one of"):
        TuneSpec(**base, input_family="x")
    with pytest.raises(ValueError, match=r"input_family: 'x' is not one of"):
        Task("{}", (Shape(1, 2, 2, 8),), input_family="x")
    acts = tmp_path / "acts.pt"
    torch.save({"q": torch.zeros(1, 8, 2, 128), "k": torch.zeros(1, 8, 2, 128), "v": torch.zeros(1, 8, 2, 128)}, acts)
    with pytest.raises(ValueError, match="input_family: 'sink' generates inputs.*one or the other"):
        Task("{}", (Shape(1, 2, 2, 8),), inputs=str(acts), input_family="sink")
    with pytest.raises(ValueError, match="input_family"):
        TuneSpec(**{**base, "seqlens": ()}, inputs=str(acts), input_family="sink")


# ---- from the CLI to the worker, the probe cache and the database --------------------------------


def test_cli_flag_reaches_the_task_and_the_provenance(tmp_path, monkeypatch):
    seen: list[Task] = []
    run = Worker.run

    def spy(self, task):
        seen.append(task)
        return run(self, task)

    monkeypatch.setattr(Worker, "run", spy)
    storage, journal = str(tmp_path / "t.db"), str(tmp_path / "s.journal")
    argv = [
        "tune",
        "--head-dim",
        "128",
        "--seqlens",
        "4096",
        "--trials",
        "2",
        "--runner",
        f"simulate:{SHIPPED}",
        "--storage",
        storage,
        "--study-storage",
        journal,
        "--timeout",
        "60",
    ]
    assert cli.main(argv + ["--input-family", "sink"]) == 0
    assert seen and all(t.input_family == "sink" and t.inputs is None for t in seen)
    with open_store(storage, readonly=True, create=False) as store:
        rows = store.trials()
    assert rows and all(r["provenance"].endswith(" inputs=sink") for r in rows)
    assert all(r["study"] == "fp8-128x128-causal-sink" for r in rows)
    seen.clear()
    assert cli.main(argv + ["--input-family", "lognormal"]) == 2 and not seen


def test_probe_cache_keys_on_the_family(monkeypatch):
    from zyfa_tune.generator import KernelConfig
    from zyfa_tune.generator.defaults import default_config
    from zyfa_tune.tuning import gpu_runner, verify

    calls = []
    monkeypatch.setattr(verify, "make_probe", lambda *a, **kw: calls.append(kw["family"]) or object())
    gpu = object.__new__(gpu_runner.GpuRunner)  # no CUDA needed to exercise the cache
    gpu._probes = OrderedDict()
    cfg: KernelConfig = default_config("fp8", 128, 128)
    shape = Shape(1, 2, 2, 256)
    for family in ("gaussian", "outliers", "gaussian", "outliers"):
        gpu._probe(cfg, shape, Task(cfg.to_json(), (shape,), input_family=family))
    assert calls == ["gaussian", "outliers"]


def test_entry_outliers_are_fa3s_random_entries_in_q_k_and_v():
    """About 0.1% of the entries of each of q, k and v carry an N(0, 100) outlier; no channel or token
    is favoured (FA3's test distribution, the case for the Hadamard rotation)."""
    q, k, v = qkv("entry_outliers", batch=4, seqlen=512)
    for x in (q, k, v):
        big = x.abs() > 5  # an N(0, 1) entry is above 5 with probability 6e-7
        share = big.float().mean().item()
        assert 0.5e-3 < share < 1.2e-3  # P(|N(0,100)| > 5) = 0.62 of the 1e-3
        assert x[big].abs().max() > 20 and x[~big].std() == pytest.approx(1.0, abs=0.02)
        per_channel = big.sum(dim=(0, 1, 2)).float()
        assert per_channel.max() < 4 * per_channel.mean() + 4  # random entries, not channels
