"""Packed-sequence (varlen) tuning on the CPU: --lengths parsing and its errors, the named mixes,
packed shapes and their problem class, and a simulated study end to end whose entries the
dispatcher's packed lookup then serves."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pytest
from test_tune import SHIPPED, spec

from zyfa_tune import cli
from zyfa_tune.db import open_store
from zyfa_tune.kernels import dispatch
from zyfa_tune.tuning.lengths import MIXES, LengthMix, log_uniform, parse_lengths
from zyfa_tune.tuning.task import Shape, shape_key, task_flops
from zyfa_tune.tuning.timing import attention_flops
from zyfa_tune.tuning.tuner import Tuner, simulation_fingerprint

# ---- --lengths -----------------------------------------------------------------------------------


def test_a_comma_list_and_files_of_lengths(tmp_path):
    mix = parse_lengths("128, 512,8192")
    assert mix.lengths == (128, 512, 8192) and (mix.count, mix.total, mix.max_len) == (3, 8832, 8192)
    assert parse_lengths("128,512,8192").name == mix.name  # named by content: the same study
    assert parse_lengths("512,128,8192").name != mix.name
    lines = tmp_path / "prompts.txt"
    lines.write_text("# prompt lengths\n300\n\n 7 # a short one\n4096\n")
    assert parse_lengths(str(lines)).lengths == (300, 7, 4096) and parse_lengths(str(lines)).name.startswith("prompts-")
    listed = tmp_path / "mix.json"
    listed.write_text(json.dumps([1, 2, 3000]))
    assert parse_lengths(str(listed)).lengths == (1, 2, 3000)


@pytest.mark.parametrize(
    "text,match",
    [
        ("", "expected a mix name"),
        ("chatty", "'chatty' is not a named mix \\(chat, long-doc\\), an existing file"),
        ("128,0,5", "entry 1 is 0; sequence lengths must be >= 1"),
        ("128,-4", "entry 1 is -4"),
        ("128,,5", "entry 1 of the list \\(''\\) is not an integer"),
        ("12.5,3", "entry 0 of the list \\('12.5'\\) is not an integer"),
        ("4096", None),
        ("missing.txt", "'missing.txt' is not a named mix"),
    ],
)
def test_bad_lengths_are_named(text, match):
    if match is None:  # (one length is a list of one)
        assert parse_lengths(text).lengths == (int(text),)
        return
    with pytest.raises(ValueError, match=f"^--lengths: {match}"):
        parse_lengths(text)


@pytest.mark.parametrize(
    "name,content,match",
    [
        ("bad.json", "[1, 2,", "is not valid JSON"),
        ("obj.json", '{"lengths": [1]}', "must hold a JSON list of lengths, got dict"),
        ("float.json", "[128, 1.5]", r"entry 1 \(1.5\) is not an integer"),
        ("bool.json", "[128, true]", r"entry 1 \(True\) is not an integer"),
        ("zero.json", "[128, 0]", "entry 1 is 0"),
        ("empty.json", "[]", "expected a non-empty list"),
        ("words.txt", "128\nlong\n", r"entry 1 of .*words.txt \('long'\) is not an integer"),
        ("empty.txt", "# nothing\n", "expected a non-empty list"),
        ("binary.txt", b"\xff\xfe\x00", "cannot read"),
    ],
)
def test_bad_files_are_named(tmp_path, name, content, match):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ValueError, match=f"^--lengths.*{match}"):
        parse_lengths(str(path))


def test_named_mixes_are_the_documented_reproducible_draws():
    chat, doc = parse_lengths("chat"), parse_lengths("long-doc")
    assert chat.count == 64 and (min(chat.lengths), chat.max_len) == (128, 8192)
    assert abs(chat.total - 131072) < 0.01 * 131072  # "about 128K tokens"
    assert doc.count == 8 and (min(doc.lengths), doc.max_len) == (8192, 32768)
    assert len(set(chat.lengths)) > 50  # drawn, not repeated
    assert chat.lengths == log_uniform(64, 128, 8192) and MIXES["chat"] is chat  # fixed seed: the same every time
    assert log_uniform(64, 128, 8192, seed=1) != chat.lengths
    with pytest.raises(ValueError, match="entry 0 is 0"):
        LengthMix("x", (0,))


# ---- packed shapes and their class -----------------------------------------------------------------


def test_packed_shape_flops_and_problem_class():
    s = Shape.packed((100, 3000, 7), 32, 8)
    assert (s.batch, s.seqlen, s.tokens, s.lengths) == (3, 3000, 3107, (100, 3000, 7))
    assert str(s) == "varlen N=3 T=3107 max=3000 H=32/8"
    flops = sum(attention_flops(1, 32, n, n, 128, 128, True) for n in (100, 3000, 7))
    assert task_flops(128, 128, s, True) == flops < task_flops(128, 128, Shape(3, 32, 8, 3000), True)
    key = shape_key(s, "fp8", 128, 128, True)
    assert key.packed and (key.tokens_bucket, key.seqlen_bucket, key.bh_bucket, key.gqa_group) == (4096, 4096, 128, 4)
    assert not shape_key(Shape(3, 32, 8, 3000), "fp8", 128, 128, True).packed
    with pytest.raises(ValueError, match="lengths: batch must be their number"):
        Shape(2, 32, 8, 3000, lengths=(100, 3000, 7))
    with pytest.raises(ValueError, match="entry 1 is 0"):
        Shape.packed((5, 0), 32, 8)


def test_spec_of_packed_sequences(tmp_path):
    chat = MIXES["chat"]
    s = spec(tmp_path, seqlens=(), lengths=chat, heads=32, kv_heads=8)
    assert s.packed and s.shapes == (Shape.packed(chat.lengths, 32, 8),)
    assert s.name == "fp8-128x128-causal-varlen-chat"
    with pytest.raises(ValueError, match="lengths: packed sequences replace seqlens"):
        spec(tmp_path, lengths=chat)  # seqlens too
    with pytest.raises(ValueError, match="api 'fp8' only"):
        spec(tmp_path, seqlens=(), lengths=chat, api="bf16")
    with pytest.raises(ValueError, match="expected a LengthMix"):
        spec(tmp_path, seqlens=(), lengths=(128, 256))


# ---- a simulated study end to end ------------------------------------------------------------------


def test_simulated_varlen_study_writes_entries_the_dispatcher_serves(tmp_path):
    mix = parse_lengths("300,1000,2048,700")
    s = spec(tmp_path, seqlens=(), lengths=mix, trials=5, sampler="random")
    study = Tuner(s).run()
    measured = [t for t in study.trials if "statuses" in t.user_attrs]
    assert measured  # Gluon configs too: their varlen variant runs packed sequences
    pruned = [t for t in study.trials if t.state == optuna.trial.TrialState.PRUNED]
    assert not any(t.user_attrs.get("infeasible", "").startswith("packed") for t in pruned)
    key = shape_key(s.shapes[0], "fp8", 128, 128, True)
    with open_store(s.storage, readonly=True, create=False) as store:
        best = store.best_entries()
        rows = store.trials(key=key)
    assert [e.key for e in best] == [key] and len(rows) == len(measured)
    assert {(r["batch"], r["seqlen"]) for r in rows} == {(4, 2048)}
    ok = [r for r in rows if r["status"] == "ok"]
    flops = task_flops(128, 128, s.shapes[0], True)
    assert ok and all(r["tflops"] == pytest.approx(flops / (r["median_ms"] * 1e-3) / 1e12) for r in ok)
    device = simulation_fingerprint(s.runner).device_key()
    d = dispatch.Dispatcher([s.storage])
    choice = d.choose_varlen(key, device)
    assert choice.source == "exact" and choice.config.to_json() == best[0].config_json
    assert d.choose(dispatch.problem_key("fp8", 128, 128, True, 4, 32, 32, 2048), device).source == "default"


def test_cli_tune_lengths(tmp_path, capsys):
    base = ["tune", "--head-dim", "128", "--trials", "2", "--storage", str(tmp_path / "t.db")]
    base += ["--study-storage", str(tmp_path / "s.journal"), "--warm-start", "none", "--runner", f"simulate:{SHIPPED}"]
    assert cli.main([*base, "--lengths", "chatty"]) != 0
    assert "--lengths: 'chatty' is not a named mix" in capsys.readouterr().out.replace("\n", "")
    assert cli.main([*base, "--lengths", "long-doc", "--sampler", "random"]) == 0
    out = capsys.readouterr().out
    assert "varlen-long-doc" in out and "varlen N=8" in out
    with open_store(Path(tmp_path / "t.db"), readonly=True, create=False) as store:
        assert {e.key.tokens_bucket for e in store.best_entries()} <= {262144}
        assert store.count_trials() >= 1
