"""Several trials written in one transaction: all of a tuning trial's per-shape rows, or none.

A tuner killed between the per-shape writes of one trial would otherwise leave some shapes measured
and not others. `record_trials` runs `Store.record_trial`'s own checks and row building for every
row, then commits them together (one retryable transaction, like every other write).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy.orm import Session

from zyfa_tune.generator import KernelConfig

from .fingerprint import Fingerprint
from .keys import ProblemKey
from .records import TrialResult
from .store import Store


def record_trials(
    store: Store,
    fingerprint: Fingerprint,
    config: KernelConfig,
    results: Sequence[tuple[ProblemKey, TrialResult]],
    *,
    source_hash: str,
    study: str | None = None,
    provenance: str | None = None,
) -> list[int]:
    """`Store.record_trial` for each (key, result), committed as one transaction; the trials' ids."""
    works: list[Callable[[Session], Any]] = []
    collecting = copy.copy(store)  # the same engine; its writes are collected instead of run
    collecting._write = lambda op, work: works.append(work)  # type: ignore[method-assign]
    for key, result in results:
        collecting.record_trial(
            fingerprint, key, config, result, source_hash=source_hash, study=study, provenance=provenance
        )
    return store._write("record_trials", lambda session: [work(session) for work in works])
