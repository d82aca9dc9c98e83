"""Concurrent writers lose nothing: processes and threads recording into one database at once."""

from __future__ import annotations

import multiprocessing
import sqlite3
import threading
import time

from test_db_support import key, many_trials, process_worker, record

from zyfa_tune.db import open_store

pytest_plugins = ["test_db_support"]  # fixtures: target (sqlite + postgres), pg_url

N = 200


def test_two_processes_one_sqlite_file(tmp_path):
    path = str(tmp_path / "shared.db")
    open_store(path).close()  # both workers then open the same existing file
    ctx = multiprocessing.get_context("spawn")
    queue, barrier = ctx.Queue(), ctx.Barrier(2)
    workers = [ctx.Process(target=process_worker, args=(path, N, w, 17 + 50 * w, barrier, queue)) for w in (1, 2)]
    for p in workers:
        p.start()
    fastest = min(queue.get(timeout=120) for _ in workers)
    for p in workers:
        p.join(timeout=120)
        assert p.exitcode == 0
    with open_store(path, readonly=True) as s:
        assert s.count_trials() == 2 * N
        assert s.count_trials(status="ok", key=key()) == 2 * N
        studies = [t["study"] for t in s.trials()]
        assert studies.count("worker1") == studies.count("worker2") == N
        (best,) = s.best_entries()
        assert best.median_ms == fastest == 0.25 + 1 / 1e6
        assert best.provenance.startswith("study=worker1")


def test_threads_share_one_store(target):
    threads, results = 4, {}
    with open_store(target) as s:

        def work(w: int) -> None:
            results[w] = many_trials(s, 50, offset=w, fastest_at=w * 3)

        pool = [threading.Thread(target=work, args=(w,)) for w in range(1, threads + 1)]
        for t in pool:
            t.start()
        for t in pool:
            t.join(timeout=120)
        assert len(results) == threads
        assert s.count_trials() == threads * 50
        (best,) = s.best_entries()
        assert best.median_ms == min(results.values()) == 0.25 + 1 / 1e6


def test_threads_with_a_store_each(tmp_path):
    path = tmp_path / "t.db"
    results = {}

    def work(w: int) -> None:
        with open_store(path) as s:  # racing to create the file as well
            results[w] = many_trials(s, 40, offset=w, fastest_at=w)

    pool = [threading.Thread(target=work, args=(w,)) for w in range(1, 5)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(timeout=120)
    with open_store(path, readonly=True) as s:
        assert s.count_trials() == 160
        assert s.best_entries()[0].median_ms == min(results.values())


def test_readers_never_wait_and_writers_wait_their_turn(tmp_path):
    """Another connection holds SQLite's write lock: reads go on (WAL, deferred BEGIN); a write
    waits (busy_timeout / retry) and then succeeds instead of failing with "database is locked"."""
    path = tmp_path / "t.db"
    with open_store(path) as s:
        record(s, 1.0)
        holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        holder.execute("BEGIN IMMEDIATE")
        start = time.monotonic()
        try:
            assert s.best_entries()[0].median_ms == 1.0 and s.count_trials() == 1
            assert time.monotonic() - start < 5
            threading.Timer(0.5, holder.execute, ("COMMIT",)).start()
            record(s, 0.5)
            assert time.monotonic() - start >= 0.4
        finally:
            time.sleep(0.1)
            holder.close()
        assert s.best_entries()[0].median_ms == 0.5 and s.count_trials() == 2
