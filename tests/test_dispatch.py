"""Dispatcher: exact / nearest / other-device / default rules, layering, validation of stored
configs, caching, and the end-to-end path database -> dispatcher on the CPU."""

from __future__ import annotations

import logging
import warnings

import pytest

from zyfa_tune.db import Fingerprint, ProblemKey, TrialResult, open_store
from zyfa_tune.generator import GENERATOR_VERSION, KernelConfig, emit
from zyfa_tune.generator.defaults import default_config
from zyfa_tune.kernels import dispatch
from zyfa_tune.search_spaces.seeds import gluon_smem2_config

H200 = ("NVIDIA H200", "9.0", GENERATOR_VERSION)


def fingerprint(gpu="NVIDIA H200", cc="9.0", gen=GENERATOR_VERSION) -> Fingerprint:
    return Fingerprint(
        gpu_name=gpu,
        compute_capability=cc,
        sm_count=132,
        memory_bytes=150_000_000_000,
        driver="580.159.04",
        cuda="13.0",
        torch="2.11.0",
        triton="3.6.0",
        generator_version=gen,
    )


def key(seqlen=8192, batch=2, heads=32, kv_heads=32, dtype="fp8", d=128, causal=True) -> ProblemKey:
    return ProblemKey.from_shape(
        dtype=dtype,
        head_dim_qk=d,
        head_dim_v=d,
        causal=causal,
        batch=batch,
        heads=heads,
        kv_heads=kv_heads,
        seqlen=seqlen,
    )


def cfg(**changes) -> KernelConfig:
    return default_config("fp8", 128, 128).replace(**changes)


def record(store, k, c, ms, fp=None, error=0.02, status="ok"):
    store.record_trial(
        fp or fingerprint(),
        k,
        c,
        TrialResult(status=status, median_ms=ms, tflops=1.0 / ms, error_rel_l2=error),
        source_hash=emit(c).source_hash,
        study="test",
    )


@pytest.fixture
def db(tmp_path):
    def make(name="a.db"):
        return open_store(tmp_path / name)

    return make


def test_exact_match(db):
    with db() as s:
        record(s, key(8192), cfg(num_stages=2), 1.0)
        record(s, key(8192), cfg(num_stages=4), 0.5)  # faster: the best
        record(s, key(16384), cfg(block_n=64), 0.7)
        path = s.url
    d = dispatch.Dispatcher([path.replace("sqlite:///", "")])
    choice = d.choose(key(8192), H200)
    assert choice.source == "exact" and choice.config == cfg(num_stages=4)
    assert choice.tuned_key == key(8192)


def test_nearest_same_head_dims(db):
    with db() as s:
        record(s, key(4096), cfg(num_stages=2), 1.0)
        record(s, key(32768), cfg(block_n=64), 1.0)
        record(s, key(16384, dtype="fp8", d=64), default_config("fp8", 64, 64).replace(num_stages=2), 0.1)
        path = str(s.url).replace("sqlite:///", "")
    d = dispatch.Dispatcher([path])
    # 8K is one bucket from 4K and two from 32K
    choice = d.choose(key(8192), H200)
    assert choice.source == "nearest" and choice.config == cfg(num_stages=2) and choice.tuned_key == key(4096)
    # other head dims never serve as "nearest": a width with no entry (80, 96 beside it) gets its own default
    assert d.choose(key(8192, d=256), H200).source == "default"
    for width in (80, 40):
        choice = d.choose(key(8192, d=width), H200)
        assert choice.source == "default" and choice.config == default_config("fp8", width, width)


def test_other_device_warns_and_other_arch_is_ignored(db):
    with db() as s:
        record(s, key(8192), cfg(num_stages=2), 1.0, fp=fingerprint(gpu="NVIDIA H100 80GB HBM3"))
        record(s, key(8192), cfg(num_stages=4), 0.1, fp=fingerprint(gpu="NVIDIA A100", cc="8.0"))
        path = str(s.url).replace("sqlite:///", "")
    d = dispatch.Dispatcher([path])
    with pytest.warns(RuntimeWarning, match="tuned on NVIDIA H100"):
        choice = d.choose(key(8192), H200)
    assert choice.source == "other-device" and choice.config == cfg(num_stages=2)
    # a new generator version on the same GPU also goes through the other-device rule
    d2 = dispatch.Dispatcher([path])
    with pytest.warns(RuntimeWarning):
        assert d2.choose(key(8192), ("NVIDIA H100 80GB HBM3", "9.0", "9.9.9")).source == "other-device"


def test_default_when_nothing_matches(tmp_path):
    d = dispatch.Dispatcher([])
    choice = d.choose(key(8192, dtype="bf16"), H200)
    assert choice.source == "default" and choice.config == default_config("bf16", 128, 128)
    # FP8 head dim 128 falls back to the overlapped Gluon 256-key kernel with P through two shared-memory
    # tiles (measured fastest untuned), others to the Triton default
    choice = d.choose(key(8192, dtype="fp8"), H200)
    assert choice.source == "default" and choice.config == gluon_smem2_config("fp8", 128, 128)
    assert choice.config.backend == "gluon" and choice.config.block_n == 256
    assert d.choose(key(8192, dtype="fp8", d=64), H200).config == default_config("fp8", 64, 64)


def test_layers_user_first(db):
    with db("user.db") as u:
        record(u, key(8192), cfg(num_stages=2), 5.0)  # slower, but the user's layer wins
        user = str(u.url).replace("sqlite:///", "")
    with db("shipped.db") as s:
        record(s, key(8192), cfg(num_stages=4), 1.0)
        record(s, key(16384), cfg(block_n=64), 1.0)
        shipped = str(s.url).replace("sqlite:///", "")
    d = dispatch.Dispatcher([user, shipped])
    assert d.choose(key(8192), H200).config == cfg(num_stages=2)
    assert d.choose(key(8192), H200).database == user
    assert d.choose(key(16384), H200).config == cfg(block_n=64)


def test_invalid_stored_config_never_reaches_the_generator(db, monkeypatch):
    with db() as s:
        record(s, key(8192), cfg(num_stages=2), 1.0)
        path = str(s.url).replace("sqlite:///", "")
    # tamper with the stored config text behind the store's back
    import sqlite3

    con = sqlite3.connect(path)
    con.execute(
        "UPDATE variants SET config_json = ?",
        ('{"dtype": "fp8\\nimport os; os.system(\\"echo pwned\\")", "head_dim_qk": 128}',),
    )
    con.commit()
    con.close()
    emitted = []
    monkeypatch.setattr(dispatch, "fallback_config", lambda *a: (emitted.append(a), default_config(*a))[1])
    d = dispatch.Dispatcher([path])
    with pytest.warns(RuntimeWarning, match="skipping a damaged row of best entries: dtype"):
        choice = d.choose(key(8192), H200)
    assert choice.source == "default"


def test_damaged_layer_is_skipped_with_a_warning(tmp_path):
    bad = tmp_path / "bad.db"
    bad.write_bytes(b"this is not a database" * 100)
    before = bad.read_bytes()
    d = dispatch.Dispatcher([str(bad)])
    with pytest.warns(RuntimeWarning, match="bad.db"):
        assert d.choose(key(8192), H200).source == "default"
    assert bad.read_bytes() == before


def test_missing_layer_is_skipped(tmp_path):
    d = dispatch.Dispatcher([str(tmp_path / "nope.db")])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert d.choose(key(8192), H200).source == "default"
    assert not (tmp_path / "nope.db").exists()


def test_cached_and_logged(db, caplog, monkeypatch):
    with db() as s:
        record(s, key(8192), cfg(num_stages=2), 1.0)
        path = str(s.url).replace("sqlite:///", "")
    d = dispatch.Dispatcher([path])
    monkeypatch.setattr(dispatch, "device_key", lambda i: H200)
    with caplog.at_level(logging.DEBUG, logger="zyfa_tune.dispatch"):
        c1 = d.config_for("fp8", 128, 128, True, 2, 32, 32, 8000, 0)
    assert c1 == cfg(num_stages=2)
    assert any("exact" in r.getMessage() for r in caplog.records)
    calls = []
    monkeypatch.setattr(d, "_resolve", lambda *a: calls.append(a))
    for _ in range(3):  # same raw shape and same bucket: no new resolution, no database access
        assert d.config_for("fp8", 128, 128, True, 2, 32, 32, 8000, 0) == c1
    assert d.choose(key(8000), H200).config == c1
    assert calls == []


def test_set_databases_and_env_layers(tmp_path, monkeypatch):
    monkeypatch.setenv("ZYFA_TUNE_DB", str(tmp_path / "default.db"))
    monkeypatch.setenv(dispatch.ENV_DATABASES, f"{tmp_path / 'e1.db'}{__import__('os').pathsep}{tmp_path / 'e2.db'}")
    layers = dispatch.default_layers()
    assert layers[:2] == [str(tmp_path / "e1.db"), str(tmp_path / "e2.db")]
    assert str(tmp_path / "default.db") not in layers  # only existing default file is used
    dispatch.set_databases([tmp_path / "mine.db"])
    try:
        layers = dispatch.default_layers()
        assert layers[0] == str(tmp_path / "mine.db") and str(tmp_path / "e1.db") not in layers
    finally:
        dispatch.set_databases(None)


# ---- error budget: the fastest kernel within a rel. L2 error, among those that passed the gate ----


def test_error_budget_picks_the_fastest_kernel_within_it(db):
    lean = cfg(softmax="lean", rowsum="mma")
    with db() as s:
        record(s, key(8192), cfg(num_stages=2), 1.0, error=0.020)  # slow, accurate
        record(s, key(8192), lean, 0.8, error=0.028)  # fast, less accurate
        record(s, key(8192), cfg(num_stages=4), 0.5, error=0.5, status="wrong")  # failed its gate: never
        record(s, key(16384), cfg(block_n=64), 0.7, error=0.030)  # nothing within 0.025 here
        assert [e.config_json for e in s.fastest_within(0.025)] == [cfg(num_stages=2).to_json()]
        assert {e.config_json for e in s.fastest_within(0.05)} == {lean.to_json(), cfg(block_n=64).to_json()}
        assert s.fastest_within(0.01) == []
        with pytest.raises(ValueError, match="max_error"):
            s.fastest_within(float("nan"))
        path = s.url.replace("sqlite:///", "")
    assert dispatch.Dispatcher([path]).choose(key(8192), H200).config == lean  # no budget: the fastest
    tight = dispatch.Dispatcher([path], error_budget=0.025)
    choice = tight.choose(key(8192), H200)
    assert choice.config == cfg(num_stages=2) and "error budget 0.025" in choice.detail
    # 16K has nothing within the budget: the nearest key that has
    assert tight.choose(key(16384), H200).source == "nearest"
    assert dispatch.Dispatcher([path], error_budget=0.001).choose(key(8192), H200).source == "default"


@pytest.mark.parametrize("bad", [0, -0.1, float("inf"), float("nan"), True, "0.03"])
def test_error_budget_rejects_bad_values(bad):
    with pytest.raises(ValueError, match="max_error"):
        dispatch.set_error_budget(bad)
    with pytest.raises(ValueError, match="error_budget"):
        dispatch.Dispatcher([], error_budget=bad)


def test_error_budget_from_env_and_setter(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_ERROR_BUDGET, "0.03")
    try:
        dispatch.set_error_budget(None)  # explicit: none, over the environment
        assert dispatch.error_budget() is None
        dispatch.set_error_budget(0.04)
        assert dispatch.dispatcher().error_budget == 0.04
    finally:
        dispatch._user_budget = None
        dispatch._dispatcher = None
    assert dispatch.error_budget() == 0.03 and dispatch.dispatcher().error_budget == 0.03
    monkeypatch.setenv(dispatch.ENV_ERROR_BUDGET, "tight")
    with pytest.raises(ValueError, match="ZYFA_TUNE_ERROR_BUDGET"):
        dispatch.error_budget()
    monkeypatch.delenv(dispatch.ENV_ERROR_BUDGET)
    dispatch._dispatcher = None


def test_shipped_databases_use_a_rollback_journal():
    """A shipped database is read from the (possibly read-only) install folder: WAL mode would need a
    writable -shm beside it. `zyfa-tune export` writes rollback-journal files; one updated with
    `zyfa-tune merge` in place must be switched back (PRAGMA journal_mode = DELETE) before shipping."""
    import sqlite3

    paths = sorted(dispatch.TUNED_DIR.glob("*.db"))
    assert paths and not list(dispatch.TUNED_DIR.glob("*.db-wal")) and not list(dispatch.TUNED_DIR.glob("*.db-shm"))
    for path in paths:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as con:
            assert con.execute("PRAGMA journal_mode").fetchone()[0] == "delete", path
