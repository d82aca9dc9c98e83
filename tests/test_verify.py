"""kernels.verify.verify_entry's decisions, with the GPU parts (the probe, the timed check) replaced:
a stored entry fails on a wrong result or when it is slower than stored, and a slow timing is taken
once more first (launch-bound entries move with the host)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from zyfa_tune.kernels import verify
from zyfa_tune.kernels.defaults import default_config
from zyfa_tune.kernels.verify import Verdict, verify_entry

CONFIG = default_config("fp8", 128, 128)
ENTRY = SimpleNamespace(config_json=CONFIG.to_json(), median_ms=0.030, batch=1, heads=16, seqlen=256,
                        key=SimpleNamespace(gqa_group=1, bh_bucket=16, seqlen_bucket=256, causal=True))


@pytest.fixture
def timings(monkeypatch):
    """verify_entry with check_config returning these medians (ms) in turn; the calls made."""
    calls = []

    def use(*medians):
        it = iter(medians)

        def fake_check(config, probe, **kw):
            calls.append(config)
            return Verdict(True, "", 0.02, 0.03, next(it))
        monkeypatch.setattr(verify, "make_probe", lambda *a, **k: SimpleNamespace())
        monkeypatch.setattr(verify, "check_config", fake_check)
        return calls
    return use


def test_on_record_is_timed_once(timings):
    calls = timings(0.031)
    v = verify_entry(ENTRY)
    assert v.ok and v.median_ms == 0.031 and len(calls) == 1 and calls[0] == CONFIG


def test_a_slow_timing_is_taken_again_and_the_better_counts(timings):
    calls = timings(0.054, 0.030)
    v = verify_entry(ENTRY)
    assert v.ok and v.median_ms == 0.030 and len(calls) == 2


def test_slow_twice_fails_naming_the_slowdown(timings):
    timings(0.060, 0.054)
    v = verify_entry(ENTRY)
    assert not v.ok and v.median_ms == 0.054 and v.reason == "+80.0% slower than stored"


def test_a_wrong_result_fails_without_timing(monkeypatch):
    monkeypatch.setattr(verify, "make_probe", lambda *a, **k: SimpleNamespace())
    monkeypatch.setattr(verify, "check_config", lambda *a, **k: Verdict(False, "error 9e-1 > 3e-2", 0.9, 0.03))
    v = verify_entry(ENTRY)
    assert not v.ok and v.reason.startswith("error")


def test_an_invalid_stored_config_fails():
    v = verify_entry(SimpleNamespace(**{**vars(ENTRY), "config_json": '{"block_m": 3}'}))
    assert not v.ok and v.reason.startswith("invalid config")
