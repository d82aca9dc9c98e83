"""What a study starts from in tuning databases: the best configs they hold for its problem.

Two uses: the seeds of every study (`study_seeds`: the search space's seeds with the winners of the
shipped database, `SEED_DATABASES`, and their twins) and `--warm-start DB` (`stored_bests`: every best
entry of a database for the head dims, measured before the seeds). Configs read from a database are
validated (`KernelConfig.from_json`) before anything reads them.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from zyfa_tune.db import DatabaseError, open_store
from zyfa_tune.generator import ConfigError, KernelConfig
from zyfa_tune.search_spaces import SearchSpace
from zyfa_tune.tuning.runners import shipped_db

log = logging.getLogger("zyfa_tune.tuning.warm_start")

#: Databases whose best entries seed every study (known-good configs measured on an H200).
SEED_DATABASES: tuple[Path, ...] = (Path(shipped_db()),)


def stored_bests(
    space: SearchSpace,
    database: str | os.PathLike,
    head_dim_qk: int,
    head_dim_v: int,
    *,
    causal: bool = True,
    required: bool = False,
) -> list[tuple[KernelConfig, float | None]]:
    """(config, TFLOP/s) of each best entry a tuning database (path or URL) holds for the space's dtype,
    these head dims and `causal`, in the database's order, each config validated (an invalid one is
    skipped with a warning) and canonical in `space`. A database that is missing or does not open is
    skipped with a log line, or with `required` raises the DatabaseError."""
    if not required and not Path(database).exists():
        log.info("seed database %s does not exist", database)
        return []
    try:
        with open_store(database, readonly=True, create=False) as store:
            entries = store.best_entries(head_dims=(head_dim_qk, head_dim_v), dtype=space.dtype)
    except DatabaseError as exc:
        if required:
            raise
        log.warning("seed database skipped: %s", exc)
        return []
    out = []
    for entry in entries:
        if entry.key.causal != causal:
            continue
        try:
            config = space.canonical(KernelConfig.from_json(entry.config_json))
        except ConfigError as exc:
            log.warning("%s: skipping an invalid best config: %s", database, exc)
            continue
        if entry.backend != config.backend:
            log.warning("%s: skipping a best config stored under backend %r", database, entry.backend)
            continue
        if (config.dtype, config.head_dim_qk, config.head_dim_v) != (space.dtype, head_dim_qk, head_dim_v):
            continue
        out.append((config, entry.tflops))
    return out


def database_winners(
    space: SearchSpace, head_dim_qk: int, head_dim_v: int, databases: Iterable[str | os.PathLike] = SEED_DATABASES
) -> list[KernelConfig]:
    """The distinct best configs of causal problems with these head dims in `databases`, those that won
    the most problem classes first (ties in the databases' order)."""
    wins: Counter[KernelConfig] = Counter()
    for path in databases:
        for config, _ in stored_bests(space, path, head_dim_qk, head_dim_v):
            wins[config] += 1
    return [config for config, _ in sorted(wins.items(), key=lambda kv: -kv[1])]  # stable on ties


def study_seeds(
    space: SearchSpace,
    head_dim_qk: int,
    head_dim_v: int,
    *,
    databases: Iterable[str | os.PathLike] = SEED_DATABASES,
    loose: bool = False,
) -> list[KernelConfig]:
    """`space.seeds` with the winners of `databases` (default: the shipped database): what a new study
    enqueues after `--enqueue` and `--warm-start`."""
    winners = database_winners(space, head_dim_qk, head_dim_v, databases)
    return space.seeds(head_dim_qk, head_dim_v, winners=winners, loose=loose)
