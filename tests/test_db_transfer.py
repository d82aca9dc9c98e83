"""Export (filtered, self-contained, never overwriting) and import (validated merge) between
databases, on SQLite and PostgreSQL; a crafted database cannot smuggle anything in."""

from __future__ import annotations

import json
import sqlite3

import pytest
from test_db_support import H100, H200, config, fingerprint, key, record, sha256

from zyfa_tune.db import DatabaseError, ImportReport, open_store
from zyfa_tune.generator import KernelConfig

pytest_plugins = ["test_db_support"]  # fixtures: target (sqlite + postgres), pg_url


def fill(store) -> None:
    """Two GPUs x two head dims, three trials each (the fastest is the best), plus a failed one."""
    for gpu, base in ((H200, 1.0), (H100, 2.0)):
        for d in (128, 64):
            for i, stages in enumerate((2, 3, 4)):
                record(store, base + d / 1000 + i, fp=fingerprint(gpu), k=key(d=d), cfg=config(d, num_stages=stages))
    record(store, None, status="compile_error", cfg=config(num_stages=5), message="ptxas error")


@pytest.fixture
def source(target):
    with open_store(target) as s:
        fill(s)
        yield s


def test_export_best_only_all_and_filters(source, tmp_path):
    out = tmp_path / "best.db"
    assert source.export(out) == 4
    with open_store(out, readonly=True) as e:
        assert sorted((b.fingerprint.gpu_name, b.key.head_dim_qk, b.median_ms) for b in e.best_entries()) == sorted(
            (b.fingerprint.gpu_name, b.key.head_dim_qk, b.median_ms) for b in source.best_entries()
        )
        assert e.count_trials() == 4  # each best entry's own trial comes along
        assert [b.provenance for b in e.best_entries()] == [b.provenance for b in source.best_entries()]

    assert source.export(tmp_path / "h100.db", gpu_name=H100) == 2
    assert source.export(tmp_path / "d64.db", head_dims=(64, 64)) == 2
    assert source.export(tmp_path / "h200_d64.db", gpu_name=H200, head_dims=(64, 64)) == 1
    assert source.export(tmp_path / "none.db", gpu_name="NVIDIA B200") == 0
    assert source.export(tmp_path / "all.db", best_only=False) == 13
    assert source.export(tmp_path / "all_h200.db", best_only=False, gpu_name=H200) == 7
    with open_store(tmp_path / "h100.db", readonly=True) as e:
        assert {b.fingerprint.gpu_name for b in e.best_entries()} == {H100}
    with open_store(tmp_path / "h200_d64.db", readonly=True) as e:
        (b,) = e.best_entries()
        assert b.key == key(d=64) and b.median_ms == 1.064
    with open_store(tmp_path / "all.db", readonly=True) as e:
        assert e.count_trials() == 13 and e.count_trials(status="compile_error") == 1 and len(e.best_entries()) == 4
    with open_store(tmp_path / "all_h200.db", readonly=True) as e:
        assert e.count_trials() == 7 and {t["gpu_name"] for t in e.trials()} == {H200}

    # self-contained: a single file with a rollback journal, readable from a read-only folder
    for f in set(tmp_path.glob("*.db")) - {tmp_path / "tuning.db"}:
        assert not (tmp_path / f"{f.name}-wal").exists()
        con = sqlite3.connect(f"file:{f}?mode=ro", uri=True)
        assert con.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
        con.close()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temp files left


def test_export_refuses_to_overwrite(source, tmp_path):
    existing = tmp_path / "existing.db"
    existing.write_bytes(b"precious")
    with pytest.raises(DatabaseError, match="already exists"):
        source.export(existing)
    assert existing.read_bytes() == b"precious"
    link = tmp_path / "link.db"
    link.symlink_to(tmp_path / "nowhere.db")
    with pytest.raises(DatabaseError, match="already exists"):
        source.export(link)
    assert not (tmp_path / "nowhere.db").exists()
    with pytest.raises(DatabaseError, match="folder"):
        source.export(tmp_path / "missing" / "x.db")


def test_import_keeps_the_faster_entry_per_key(target, tmp_path):
    theirs = tmp_path / "theirs.db"
    with open_store(theirs) as s:
        record(s, 0.5, cfg=config(num_stages=4))  # faster than ours
        record(s, 3.0, k=key(d=64), cfg=config(64, num_stages=4))  # slower than ours
        record(s, 20.0, k=key(seqlen=65536), cfg=config(block_n=64))  # a key we lack
        record(s, 2.0, fp=fingerprint(H100), cfg=config(num_stages=3))  # another GPU
        record(s, None, status="timeout", cfg=config(num_stages=5))
    with open_store(target) as s:
        record(s, 1.0, cfg=config(num_stages=2))
        record(s, 1.0, k=key(d=64), cfg=config(64, num_stages=2))
        report = s.import_from(theirs)
        assert report == ImportReport(accepted=5 + 4, rejected=[], added=5, present=0, new=2, replaced=1, kept=1)
        best = {(b.fingerprint.gpu_name, b.key): b for b in s.best_entries()}
        assert len(best) == 4
        won = best[(H200, key())]
        assert won.median_ms == 0.5 and KernelConfig.from_json(won.config_json) == config(num_stages=4)
        assert won.provenance.startswith("imported from theirs.db; study=test host=")
        ours = best[(H200, key(d=64))]
        assert ours.median_ms == 1.0 and not ours.provenance.startswith("imported")
        assert best[(H200, key(seqlen=65536))].provenance.startswith("imported from theirs.db")
        assert s.count_trials() == 2 + 5 and s.count_trials(status="timeout") == 1
        assert all(t["provenance"].startswith("imported from theirs.db") for t in s.trials() if t["median_ms"] != 1.0)

        again = s.import_from(theirs)  # nothing new: trials are not copied twice
        assert (again.accepted, again.added, again.present, again.new, again.replaced, again.kept, again.rejected) == (
            9,
            0,
            5,
            0,
            0,
            4,
            [],
        )
        assert s.count_trials() == 7


def test_import_from_a_store_object_and_postgres_to_sqlite(pg_url, tmp_path):
    with open_store(pg_url) as pg, open_store(tmp_path / "local.db") as local:
        fill(pg)
        report = local.import_from(pg)
        assert (report.accepted, report.rejected) == (13 + 4, [])
        assert local.count_trials() == 13
        assert sorted(b.median_ms for b in local.best_entries()) == sorted(b.median_ms for b in pg.best_entries())
        assert all(
            b.provenance.startswith("imported from postgresql+psycopg://") and "***" in b.provenance
            for b in local.best_entries()
        )
        back = pg.import_from(tmp_path / "local.db")
        assert (back.replaced, back.kept, pg.count_trials()) == (0, 4, 13)


def test_import_argument_checks(tmp_path):
    with open_store(tmp_path / "a.db") as s:
        with pytest.raises(ValueError, match="mode"):
            s.import_from(tmp_path / "a.db", mode="replace")
        with pytest.raises(DatabaseError, match="does not exist"):
            s.import_from(tmp_path / "missing.db")
        assert not (tmp_path / "missing.db").exists()


# ---- a crafted database -----------------------------------------------------------------------

INJECTED_CONFIGS = {  # variant id -> (config_json text, words the rejection reason must contain)
    101: (dict(softmax="exact\nimport os; os.system('echo pwned')"), "softmax"),
    102: (dict(dtype='fp8"; import os; "'), "dtype"),
    103: (dict(evil="__import__('os').system('echo pwned')"), "unknown config fields"),
    104: (dict(block_m="128"), "block_m: expected int"),
    105: (dict(num_warps=8.0), "num_warps: expected int"),
    106: (dict(loads=True), "loads: expected str"),
    107: ("{not json", "not valid JSON"),
    108: ("[1, 2, 3]", "must be a mapping"),
    109: ('{"dtype": "fp8", "dtype": "fp8\\u000aimport os"}', "dtype"),
}


def craft(path) -> dict:
    """A database made by our store, then edited by hand with hostile rows (CHECK constraints and
    foreign keys off, as an attacker's own SQLite would have them). Returns the ids of good rows."""
    good = config(num_stages=4)
    with open_store(path) as s:
        good_ok = record(s, 0.5, cfg=good)
        good_wrong = record(s, 0.1, status="wrong", cfg=config(num_stages=3))
        good_64 = record(s, 0.7, k=key(d=64), cfg=config(64))
        lie = record(s, 9.0, k=key(seqlen=65536), cfg=config(block_n=64))  # its best row will lie
    con = sqlite3.connect(path)
    con.execute("PRAGMA ignore_check_constraints = ON")
    fp = fingerprint()
    env_cols = ", ".join(fp.to_dict())
    with con:
        # hostile environments and problems
        bad_fp = dict(fp.to_dict(), gpu_name="NVIDIA H200\nimport os")
        con.execute(
            f"INSERT INTO environments (id, digest, {env_cols}) VALUES (50, 'deadbeefdeadbeef', "
            f"{', '.join('?' * len(bad_fp))})",
            tuple(bad_fp.values()),
        )
        forged = dict(fp.to_dict(), driver="1.0")  # valid fields, but a digest that is not theirs
        con.execute(
            f"INSERT INTO environments (id, digest, {env_cols}) VALUES (51, ?, {', '.join('?' * len(forged))})",
            (fingerprint(H100).digest(), *forged.values()),
        )
        con.execute("INSERT INTO problems VALUES (60, 'fp8', 84, 84, 1, 1, 8192, 64, 'fp8', 0)")
        con.execute("INSERT INTO problems VALUES (61, 'fp8', 128, 128, 2, 1, 8192, 64, 'fp8', 0)")
        con.execute(
            "INSERT INTO problems VALUES (62, 'fp8''; DROP TABLE trials; --', 128, 128, 1, 1, 8192, 64, 'fp8', 0)"
        )
        # hostile variants, each used by an otherwise fine trial of the 128/128 problem (id 1)
        for vid, (cfg, _) in INJECTED_CONFIGS.items():
            text = cfg if isinstance(cfg, str) else json.dumps(dict(config(num_stages=2).to_dict(), **cfg))
            con.execute("INSERT INTO variants VALUES (?, 'triton', ?, ?, '0.1.0')", (vid, text, f"{vid:016x}"))
        con.execute(
            "INSERT INTO variants VALUES (110, 'triton; rm -rf /', ?, 'aaaaaaaaaaaaaaaa', '0.1.0')",
            (config().to_json(),),
        )
        con.execute("INSERT INTO variants VALUES (111, 'triton', ?, 'zz''; --', '0.1.0')", (config().to_json(),))
        con.execute(
            "INSERT INTO variants VALUES (112, 'triton', ?, 'bbbbbbbbbbbbbbbb', '0.1.0')", (config(64).to_json(),)
        )  # valid, but for head dim 64

        def trial(tid, *, env=1, prob=1, var=1, status="ok", median=1.0, **extra):
            cols = dict(
                dict(
                    id=tid,
                    environment_id=env,
                    problem_id=prob,
                    variant_id=var,
                    status=status,
                    median_ms=median,
                    message="",
                    provenance="crafted",
                    created_at="2026-11-30 00:00:00.000000",
                ),
                **extra,
            )
            con.execute(
                f"INSERT INTO trials ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})", tuple(cols.values())
            )
            con.execute(
                "INSERT OR REPLACE INTO best (environment_id, problem_id, variant_id, trial_id, median_ms, "
                "provenance, updated_at) VALUES (?, ?, ?, ?, 1.0, 'crafted', '2026-11-30 00:00:00')",
                (env, prob + 1000 * tid, var, tid),
            )  # a best row of its own per crafted trial

        for vid in [*INJECTED_CONFIGS, 110, 111, 112]:
            trial(vid, var=vid)
        trial(201, median=float("inf"))
        trial(202, median=-1.0)
        trial(203, median="NaN")
        trial(204, median=float("nan"))  # SQLite stores NaN as NULL: an "ok" without a time
        trial(205, status="great")
        trial(206, status="ok'); DROP TABLE best; --")
        trial(207, tflops="lots")
        trial(208, created_at="yesterday")
        trial(209, message=b"\x00binary")
        trial(210, env=50)
        trial(211, env=51)
        trial(212, prob=60)
        trial(213, prob=61)
        trial(214, prob=62)
        trial(215, env=999)
        trial(216, batch=-4)
        # best rows that lie about their trial: its time, its problem
        con.execute("UPDATE best SET median_ms = 0.0001 WHERE trial_id = ?", (lie,))
        con.execute(
            "INSERT INTO best (environment_id, problem_id, variant_id, trial_id, median_ms, provenance, "
            "updated_at) VALUES (1, 5000, 1, ?, 0.5, 'crafted', '2026-11-30')",
            (good_ok,),
        )
    con.close()
    return dict(ok=good_ok, wrong=good_wrong, d64=good_64, lie=lie)


def test_import_of_a_crafted_database_rejects_every_bad_row(target, tmp_path):
    crafted = tmp_path / "hostile.db"
    craft(crafted)
    before = sha256(crafted)
    with open_store(target) as s:
        record(s, 1.0, cfg=config(num_stages=2))
        report = s.import_from(crafted)
        reasons = dict(report.rejected)

        # the good rows: 4 trials and 2 best entries
        assert report.accepted == 6 and report.replaced == 1 and report.kept == 0
        best = {b.key: b for b in s.best_entries()}
        assert best[key()].median_ms == 0.5 and best[key(d=64)].median_ms == 0.7
        assert s.count_trials() == 1 + 4 and s.count_trials(key=key(seqlen=65536)) == 1

        for vid, (_, words) in INJECTED_CONFIGS.items():
            assert words in reasons[f"variants row id={vid}"], (vid, reasons[f"variants row id={vid}"])
            assert "variant_id" in reasons[f"trials row id={vid}"]
        assert "backend" in reasons["variants row id=110"]
        assert "source_hash" in reasons["variants row id=111"]
        assert "config is for fp8 64/64 but the problem is fp8 128/128" in reasons["trials row id=112"]
        expected = {
            201: "median_ms",
            202: "median_ms",
            203: "median_ms",
            204: "median_ms",
            205: "status",
            206: "status",
            207: "tflops",
            208: "created_at",
            209: "message",
            210: "environment_id",
            211: "environment_id",
            212: "problem_id",
            213: "problem_id",
            214: "problem_id",
            215: "environment_id",
            216: "batch",
        }
        for tid, word in expected.items():
            assert word in reasons[f"trials row id={tid}"], (tid, reasons[f"trials row id={tid}"])
        assert "gpu_name" in reasons["environments row id=50"]
        assert "digest" in reasons["environments row id=51"]
        assert "head_dim_qk" in reasons["problems row id=60"]
        assert "causal" in reasons["problems row id=61"]
        assert "dtype" in reasons["problems row id=62"]
        assert "differ from its trial" in reasons["best row environment_id=1 problem_id=5000"]
        assert "does not match its trial" in reasons["best row environment_id=1 problem_id=3"]
        crafted_best = [d for d, _ in report.rejected if d.startswith("best row")]
        assert len(crafted_best) == len(INJECTED_CONFIGS) + 3 + len(expected) + 2

        # nothing of a rejected row reached the target
        for t in s.trials():
            cfg = KernelConfig.from_json(t["config_json"])
            assert (cfg.dtype, cfg.head_dim_qk, cfg.head_dim_v) == (t["dtype"], t["head_dim_qk"], t["head_dim_v"])
            assert "crafted" not in t["provenance"] and "import os" not in t["config_json"]
            assert t["source_hash"] not in {f"{v:016x}" for v in INJECTED_CONFIGS} | {"aaaaaaaaaaaaaaaa"}
        assert {b.key for b in s.best_entries()} == {key(), key(d=64)}  # not the lying one
        for b in s.best_entries():
            KernelConfig.from_json(b.config_json)
            assert "crafted" not in b.provenance
    assert sha256(crafted) == before  # the source is only read


def test_export_skips_damaged_rows_of_our_own_database(tmp_path):
    path = tmp_path / "mine.db"
    with open_store(path) as s:
        record(s, 1.0)
        record(s, 2.0, k=key(d=64), cfg=config(64))
    con = sqlite3.connect(path)
    with con:  # damage one stored config behind the store's back
        con.execute(
            'UPDATE variants SET config_json = \'{"softmax": "exact\\nimport os"}\' '
            "WHERE config_json LIKE '%\"head_dim_qk\":64%'"
        )
    con.close()
    with open_store(path) as s, pytest.warns(RuntimeWarning, match="export skips"):
        assert s.export(tmp_path / "out.db") == 1
    with open_store(tmp_path / "out.db", readonly=True) as e:
        assert [b.key for b in e.best_entries()] == [key()]
