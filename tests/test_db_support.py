"""Shared fixtures and helpers of the tuning-database tests (no tests here).

Test modules import what they use from here. `target` runs a test on SQLite and on PostgreSQL; the
PostgreSQL run needs $ZYFA_TEST_PG_URL (.ci/run starts a server and sets it) and gets a database
of its own, created for the test and dropped after it.
"""

from __future__ import annotations

import hashlib
import os
import uuid
from pathlib import Path

import pytest

from zyfa_tune.db import Fingerprint, ProblemKey, TrialResult, open_store
from zyfa_tune.generator import GENERATOR_VERSION, KernelConfig

PG_ENV = "ZYFA_TEST_PG_URL"
H200, H100 = "NVIDIA H200", "NVIDIA H100 80GB HBM3"


def fingerprint(gpu: str = H200, *, driver: str = "580.159.04", cc: str = "9.0") -> Fingerprint:
    return Fingerprint(
        gpu_name=gpu,
        compute_capability=cc,
        sm_count=132,
        memory_bytes=150_000_000_000,
        driver=driver,
        cuda="13.0",
        torch="2.13.0",
        triton="3.6.0",
        generator_version=GENERATOR_VERSION,
    )


def key(
    seqlen: int = 8192, *, d: int = 128, dtype: str = "fp8", batch: int = 2, heads: int = 32, kv_heads: int = 8
) -> ProblemKey:
    return ProblemKey.from_shape(
        dtype=dtype,
        head_dim_qk=d,
        head_dim_v=d,
        causal=True,
        batch=batch,
        heads=heads,
        kv_heads=kv_heads,
        seqlen=seqlen,
    )


def config(d: int = 128, dtype: str = "fp8", **changes) -> KernelConfig:
    base = KernelConfig(dtype=dtype, head_dim_qk=d, head_dim_v=d, p_scale_log2=8 if dtype == "fp8" else 0)
    return base.replace(**changes)


def fake_hash(cfg: KernelConfig) -> str:
    """Stands in for emit(cfg).source_hash (the store only needs a stable hex id per config)."""
    return hashlib.sha256(cfg.to_json().encode()).hexdigest()[:16]


def record(
    store,
    ms: float | None,
    *,
    status: str = "ok",
    fp: Fingerprint | None = None,
    k: ProblemKey | None = None,
    cfg: KernelConfig | None = None,
    **result,
) -> int:
    k = k or key()
    cfg = cfg or config(k.head_dim_qk, k.dtype, num_stages=2)
    return store.record_trial(
        fp or fingerprint(),
        k,
        cfg,
        TrialResult(status=status, median_ms=ms, **result),
        source_hash=fake_hash(cfg),
        study="test",
    )


def sha256(path: str | os.PathLike) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def many_trials(store, n: int, *, offset: int = 0, fastest_at: int | None = None) -> float:
    """Record n "ok" trials of one key over 8 configs; returns the fastest median recorded."""
    fastest = float("inf")
    for i in range(n):
        ms = 1.0 + ((i + offset) * 7919 % 997) / 997
        if i == fastest_at:
            ms = 0.25 + offset / 1e6
        cfg = config(num_stages=1 + i % 4, block_n=64 if i % 8 >= 4 else 128)
        store.record_trial(
            fingerprint(),
            key(),
            cfg,
            TrialResult(status="ok", median_ms=ms),
            source_hash=fake_hash(cfg),
            study=f"worker{offset}",
        )
        fastest = min(fastest, ms)
    return fastest


def process_worker(path: str, n: int, offset: int, fastest_at: int, barrier, queue) -> None:
    """Target of the multiprocessing test (importable by spawned children): all workers start
    writing at the same moment."""
    with open_store(path) as store:
        barrier.wait(timeout=120)
        queue.put(many_trials(store, n, offset=offset, fastest_at=fastest_at))


@pytest.fixture
def pg_url():
    """A fresh, empty PostgreSQL database for this test (dropped afterwards)."""
    base = os.environ.get(PG_ENV)
    if not base:
        pytest.skip(f"{PG_ENV} is not set: no PostgreSQL server to test against (.ci/run starts one and sets it)")
    from sqlalchemy import create_engine, make_url

    url = make_url(base)
    name = f"zyfa_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
        yield url.set(database=name).render_as_string(hide_password=False)
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        admin.dispose()


@pytest.fixture(params=["sqlite", "postgres"])
def target(request, tmp_path) -> str:
    """Where a store lives: an SQLite file path, or a fresh PostgreSQL database URL."""
    if request.param == "sqlite":
        return str(tmp_path / "tuning.db")
    return request.getfixturevalue("pg_url")
