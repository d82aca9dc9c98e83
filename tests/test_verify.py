"""kernels.verify.verify_entry's decisions, with the GPU parts (the probe, the timed check) replaced:
a stored entry fails on a wrong result or when it is slower than stored, and a slow timing is taken
once more first (launch-bound entries move with the host); one still slow passes as launch-bound only
when its kernels, replayed from a CUDA graph, are within the margin of the stored time."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from zyfa_tune.generator.defaults import default_config
from zyfa_tune.tuning import verify
from zyfa_tune.tuning.timing import Timing
from zyfa_tune.tuning.verify import Verdict, verify_entry

CONFIG = default_config("fp8", 128, 128)
ENTRY = SimpleNamespace(
    config_json=CONFIG.to_json(),
    median_ms=0.030,
    batch=1,
    heads=16,
    seqlen=256,
    recipe=None,
    key=SimpleNamespace(gqa_group=1, bh_bucket=16, seqlen_bucket=256, causal=True, api="fp8", packed=False),
)


@pytest.fixture
def timings(monkeypatch):
    """verify_entry with check_config returning these medians (ms) in turn; the calls made."""
    calls = []

    def use(*medians, replay=None):
        it = iter(medians)

        def fake_check(config, probe, **kw):
            calls.append(config)
            median = next(it)
            return Verdict(True, "", 0.02, 0.03, median, timing=Timing(median, median, median, median, 20, 1980.0))

        def fake_replay(config, probe, **kw):
            calls.append(("replay", config))
            return replay

        monkeypatch.setattr(verify, "make_probe", lambda *a, **k: SimpleNamespace())
        monkeypatch.setattr(verify, "check_config", fake_check)
        monkeypatch.setattr(verify, "replay_ms", fake_replay)
        return calls

    return use


def test_on_record_is_timed_once(timings):
    calls = timings(0.031)
    v = verify_entry(ENTRY)
    assert v.ok and v.median_ms == 0.031 and len(calls) == 1 and calls[0] == CONFIG
    assert v.timing.sm_clock_mhz == 1980.0  # (verify prints the clock of the timing it judged)


def test_a_slow_timing_is_taken_again_and_the_better_counts(timings):
    calls = timings(0.054, 0.030)
    v = verify_entry(ENTRY)
    assert v.ok and v.median_ms == 0.030 and len(calls) == 2


def test_slow_twice_fails_naming_the_slowdown(timings):
    calls = timings(0.060, 0.054, replay=0.034)  # (its kernels alone 13% over the stored call: slower)
    v = verify_entry(ENTRY)
    assert not v.ok and v.median_ms == 0.054 and v.reason == "+80.0% slower than stored"
    assert calls[-1] == ("replay", CONFIG) and v.timing.median_ms == 0.054


def test_slow_twice_passes_as_launch_bound_when_its_kernels_are_on_record(timings):
    calls = timings(0.041, 0.040, replay=0.012)
    v = verify_entry(ENTRY)
    assert v.ok and v.median_ms == 0.040 and v.slowdown == pytest.approx(1 / 3)
    assert v.reason == "launch-bound: the call +33.3%, its kernels 0.012 ms (graph replay)"
    assert calls == [CONFIG, CONFIG, ("replay", CONFIG)]


def test_slow_twice_fails_when_the_call_cannot_be_replayed(timings):
    timings(0.041, 0.040, replay=None)
    v = verify_entry(ENTRY)
    assert not v.ok and v.reason == "+33.3% slower than stored"


def test_an_entry_on_record_is_not_replayed(timings):
    calls = timings(0.054, 0.031, replay=0.001)
    assert verify_entry(ENTRY).reason == "" and ("replay", CONFIG) not in calls


def test_still_slow_is_timed_in_a_fresh_process_which_has_the_last_word(timings):
    """Slow twice and its graph replay slow too: `fresh_ms` (the CLI: a new worker process) decides,
    and the verdict names both readings."""
    fresh = []
    timings(0.036, 0.035, replay=0.034)
    v = verify_entry(ENTRY, fresh_ms=lambda e: fresh.append(e) or 0.031)
    assert v.ok and fresh == [ENTRY] and v.median_ms == 0.035
    assert v.reason == "+16.7% here, +3.3% in a fresh process (0.031 ms)"
    timings(0.036, 0.035, replay=0.034)
    v = verify_entry(ENTRY, fresh_ms=lambda e: 0.036)
    assert not v.ok and v.reason == "+16.7% slower than stored (+20.0% in a fresh process)"
    timings(0.036, 0.035, replay=0.034)  # (the fresh process failed: the verdict stands)
    v = verify_entry(ENTRY, fresh_ms=lambda e: None)
    assert not v.ok and v.reason == "+16.7% slower than stored"


def test_a_fast_entry_never_starts_a_process(timings):
    timings(0.031)
    assert verify_entry(ENTRY, fresh_ms=lambda e: pytest.fail("a process for an entry on record")).ok
    timings(0.041, 0.040, replay=0.012)  # launch-bound: its kernels are on record
    assert verify_entry(ENTRY, fresh_ms=lambda e: pytest.fail("a process for a launch-bound entry")).ok


def test_an_entry_is_timed_in_a_fresh_worker_process_at_its_own_shape():
    """time_in_fresh_process runs the entry's config at entry_shape in a new child process: with the
    simulation runner (stored GPU measurements, CPU only) it answers the entry's own stored trial."""
    from zyfa_tune.db import open_store
    from zyfa_tune.kernels import dispatch
    from zyfa_tune.tuning.worker import Shape, time_in_fresh_process

    shipped = str(Path(dispatch.TUNED_DIR) / "h200.db")
    with open_store(shipped, readonly=True, create=False) as store:
        entry = next(e for e in store.best_entries(dtype="fp8", head_dims=(256, 256)) if e.seqlen == 16384)
    assert verify.entry_shape(entry) == (entry.batch, entry.heads, entry.heads, 16384)
    r = time_in_fresh_process(
        entry.config_json,
        Shape(*verify.entry_shape(entry)),
        causal=entry.key.causal,
        runner=f"simulate:{shipped}",
        timeout_s=120,
    )
    assert r.status == "ok" and r.median_ms == pytest.approx(entry.median_ms) and r.seqlen == 16384


def test_a_bucket_without_a_recorded_shape_is_checked_at_its_largest():
    entry = SimpleNamespace(
        **{
            **vars(ENTRY),
            "batch": None,
            "heads": None,
            "seqlen": None,
            "key": SimpleNamespace(
                gqa_group=4, bh_bucket=128, seqlen_bucket=8192, causal=True, api="fp8", packed=False
            ),
        }
    )
    assert verify.entry_shape(entry) == (2, 64, 16, 8192)


def test_a_wrong_result_fails_without_timing(monkeypatch):
    monkeypatch.setattr(verify, "make_probe", lambda *a, **k: SimpleNamespace())
    monkeypatch.setattr(verify, "check_config", lambda *a, **k: Verdict(False, "error 9e-1 > 3e-2", 0.9, 0.03))
    v = verify_entry(ENTRY)
    assert not v.ok and v.reason.startswith("error")


def test_an_invalid_stored_config_fails():
    v = verify_entry(SimpleNamespace(**{**vars(ENTRY), "config_json": '{"block_m": 3}'}))
    assert not v.ok and v.reason.startswith("invalid config")


def test_the_clock_cell_shows_this_timing_and_the_stored_one():
    from zyfa_tune.cli.db_cmds import _clocks

    assert _clocks(1838.4, 1980.0) == "1838 (1980)"
    assert _clocks(1980.0, None) == "1980"
    assert _clocks(None, 1980.0) == "- (1980)"
    assert _clocks(None, None) == "-"


def test_verify_command_checks_only_the_entries_asked_for(tmp_path, monkeypatch):
    """`zyfa-tune verify --dtype --head-dim`: only those entries of this GPU are re-checked (the GPU
    parts replaced: the fingerprint is the test database's H200, each check a stand-in verdict)."""
    import torch
    from test_db_support import config as db_config
    from test_db_support import fingerprint, key, record

    import zyfa_tune.db as db
    from zyfa_tune import cli
    from zyfa_tune.db import open_store

    path = tmp_path / "t.db"
    with open_store(path) as s:
        record(s, 1.0, sm_clock_mhz=1980.0)  # fp8 128/128
        record(s, 2.0, k=key(d=64), cfg=db_config(64))  # fp8 64/64
        record(s, 3.0, k=key(dtype="bf16"), cfg=db_config(dtype="bf16"))
    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(db, "current_fingerprint", lambda: fingerprint())
    monkeypatch.setattr(
        verify,
        "verify_entry",
        lambda e, **kw: seen.append((e.key.dtype, e.key.head_dim_qk)) or Verdict(True, "", 0.02, 0.03, e.median_ms),
    )
    assert cli.main(["verify", "--storage", str(path), "--dtype", "fp8", "--head-dim", "64"]) == 0
    assert seen == [("fp8", 64)]
    seen.clear()
    assert cli.main(["verify", "--storage", str(path)]) == 0
    assert sorted(seen) == [("bf16", 128), ("fp8", 64), ("fp8", 128)]


def test_a_bf16_api_entry_is_rechecked_as_timed_with_its_recipe(monkeypatch):
    """A bf16-API entry's time is its recipe's quantiser and its kernel on bf16 inputs: that is the probe."""
    from zyfa_tune.search_spaces.recipes import BALANCED

    made = []
    monkeypatch.setattr(verify, "make_probe", lambda *a, **k: pytest.fail("the FP8 API's probe for a bf16 entry"))
    monkeypatch.setattr(verify, "make_recipe_probe", lambda *a, **k: made.append((a, k)) or SimpleNamespace())
    monkeypatch.setattr(verify, "check_config", lambda *a, **k: Verdict(True, "", 0.02, 0.03, 0.031))
    key = SimpleNamespace(**{**vars(ENTRY.key), "api": "bf16"})
    v = verify_entry(SimpleNamespace(**{**vars(ENTRY), "key": key, "recipe": BALANCED.to_json()}))
    assert v.ok and not v.skipped and made[0][0] == (128, 128, BALANCED)
    assert made[0][1] == dict(batch=1, heads=16, kv_heads=16, seqlen=256, causal=True, gate=verify.DEFAULT_ERROR_GATE)


def test_a_packed_entry_is_skipped_not_failed(monkeypatch):
    from zyfa_tune.cli.db_cmds import _verdict

    monkeypatch.setattr(verify, "make_probe", lambda *a, **k: pytest.fail("a packed entry re-timed as a rectangle"))
    key = SimpleNamespace(**{**vars(ENTRY.key), "packed": True})
    v = verify_entry(SimpleNamespace(**{**vars(ENTRY), "key": key}))
    assert v.ok and v.skipped and "keeps no lengths" in v.reason
    assert _verdict(v).startswith("[yellow]skipped") and _verdict(Verdict(False, "slow")) == "[red]slow[/red]"
