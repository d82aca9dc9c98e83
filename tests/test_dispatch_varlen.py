"""The dispatcher's packed-sequence lookup: exact / nearest (in the tokens bucket too) / other-device
among packed entries only, layered, and the rectangular lookup at the mean length where none exists;
rectangular calls never get a packed entry. Crafted databases, as test_dispatch does."""

from __future__ import annotations

import warnings

import pytest
from test_dispatch import H200, cfg, fingerprint, key, record

from zyfa_tune.db import ProblemKey, open_store
from zyfa_tune.kernels import dispatch

D = 128


def packed(tokens=131072, nseq=64, max_len=8192, heads=32, kv_heads=32) -> ProblemKey:
    return dispatch.problem_key("fp8", D, D, True, nseq, heads, kv_heads, max_len, tokens=tokens)


def rect(seqlen=2048, batch=64, heads=32, kv_heads=32) -> ProblemKey:
    return key(seqlen, batch=batch, heads=heads, kv_heads=kv_heads)


@pytest.fixture
def path(tmp_path):
    return lambda name="a.db": tmp_path / name


def test_exact_packed_entry_and_nearest_in_tokens(path):
    with open_store(path()) as s:
        record(s, packed(131072), cfg(num_stages=2), 1.0)
        record(s, packed(131072), cfg(num_stages=4), 0.5)  # faster: the best
        record(s, packed(16384, nseq=8), cfg(block_n=64), 0.2)
        record(s, rect(), cfg(block_m=64), 0.1)  # rectangular: never a packed call's
    d = dispatch.Dispatcher([path()])
    exact = d.choose_varlen(packed(131072), H200)
    assert exact.source == "exact" and exact.config == cfg(num_stages=4) and exact.tuned_key == packed()
    near = d.choose_varlen(packed(262144), H200)  # one tokens bucket away from the best-known class
    assert near.source == "nearest" and near.config == cfg(num_stages=4)
    small = d.choose_varlen(packed(8192, nseq=8), H200)
    assert small.source == "nearest" and small.config == cfg(block_n=64)
    assert d.choose(rect(), H200).config == cfg(block_m=64)  # the rectangular lookup ignores packed rows
    assert d.choose(rect(8192, batch=1), H200).config == cfg(block_m=64)


def test_without_packed_entries_the_rectangular_lookup_at_the_mean_length_decides(path, monkeypatch):
    monkeypatch.setattr(dispatch, "device_key", lambda index: H200)
    with open_store(path()) as s:
        record(s, rect(2048), cfg(block_m=64), 0.3)
        record(s, rect(8192), cfg(block_n=64), 3.0)
    d = dispatch.Dispatcher([path()])
    config, tuned = d.varlen_config_for("fp8", D, D, True, 64, 32, 32, 131072, 8192, 0)
    assert config == cfg(block_m=64) and not tuned  # mean 2048 tokens, not the longest 8192
    choice = d.choose_varlen(packed(), H200, rect(2048))
    assert choice.source == "exact" and choice.key == packed() and "no packed-sequence entry" in choice.detail
    assert d.choose_varlen(packed(), H200).config == cfg(block_n=64)  # default rectangle: the longest
    empty = dispatch.Dispatcher([])
    assert empty.choose_varlen(packed(), H200).source == "default"
    with pytest.raises(ValueError, match="not of packed sequences"):
        d.choose_varlen(rect(), H200)


def test_varlen_config_for_takes_host_values_and_caches(path, monkeypatch):
    with open_store(path()) as s:
        record(s, packed(131072, kv_heads=8), cfg(num_stages=3), 0.5)
    d = dispatch.Dispatcher([path()])
    monkeypatch.setattr(dispatch, "device_key", lambda index: H200)
    # 64 sequences of 32 heads over 8 kv heads, 100K tokens, the longest 5000: the 131072-token class
    assert d.varlen_config_for("fp8", D, D, True, 64, 32, 8, 100_000, 5000, 0) == (cfg(num_stages=3), True)
    calls = []
    monkeypatch.setattr(d, "choose_varlen", lambda *a: calls.append(a))
    assert d.varlen_config_for("fp8", D, D, True, 64, 32, 8, 100_000, 5000, 0)[1]  # from the per-call dict
    assert calls == []


def test_layers_and_other_devices(path):
    with open_store(path("user.db")) as s:
        record(s, packed(), cfg(num_stages=2), 2.0)
    with open_store(path("shipped.db")) as s:
        record(s, packed(), cfg(num_stages=4), 0.5)  # faster, but in a later layer
        record(s, packed(32768, nseq=8), cfg(block_n=64), 0.5, fp=fingerprint("NVIDIA H100 80GB HBM3"))
    d = dispatch.Dispatcher([path("user.db"), path("shipped.db")])
    assert d.choose_varlen(packed(), H200).config == cfg(num_stages=2)  # first layer wins
    other = dispatch.Dispatcher([path("shipped.db")])
    h100 = ("NVIDIA H100 80GB HBM3", "9.0", H200[2])
    assert other.choose_varlen(packed(32768, nseq=8), h100).source == "exact"
    b200 = ("NVIDIA B200", "9.0", H200[2])  # same architecture string, another GPU: warned
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        choice = other.choose_varlen(packed(), b200)
    assert choice.source == "other-device" and any("tuned on" in str(w.message) for w in caught)
