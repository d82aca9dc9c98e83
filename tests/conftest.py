"""Shared test setup.

- Emitted kernel sources are written under $ZYFA_TUNE_CACHE. It is pointed at a fresh temporary
  directory here, at import of this file, i.e. before any test module imports zyfa_tune (pytest
  imports conftest.py first), so test runs never read or write the user's cache.
- Tests marked `gpu` (the marker is declared in pyproject.toml) are skipped without a CUDA device.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

_CACHE = tempfile.mkdtemp(prefix="zyfa_tune_test_cache_")
os.environ["ZYFA_TUNE_CACHE"] = _CACHE


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip_gpu)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutil.rmtree(_CACHE, ignore_errors=True)
