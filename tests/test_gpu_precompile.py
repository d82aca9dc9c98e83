"""GPU: a kernel compiled ahead in a compile process is what the worker's JIT then finds in
Triton's on-disk cache (the point of compile-ahead, zyfa_tune/tuning/precompile.py), and its ptxas check
for serialised wgmmas is answered there too."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from zyfa_tune import flash_attn_func
from zyfa_tune.generator.defaults import default_config
from zyfa_tune.generator.emitted import KERNEL_NAME
from zyfa_tune.tuning.precompile import Precompiler
from zyfa_tune.tuning.verify import make_inputs

pytestmark = pytest.mark.gpu


def _compiled_kernels(cache: Path) -> set[str]:
    """Triton cache entries holding an attention kernel (not the V^T transpose kernel, which the
    launch compiles for its own shapes; launcher modules hold no cubin)."""
    return {p.parent.name for p in cache.rglob(f"{KERNEL_NAME}.cubin")}


def test_precompiled_kernel_is_a_cache_hit(tmp_path, monkeypatch):
    cache = tmp_path / "triton"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    monkeypatch.setenv("ZYFA_TUNE_CACHE", str(tmp_path / "zyfa"))
    cfg = default_config("fp8", 128, 128).replace(num_stages=2, maxnreg=184)  # used by no other test
    with Precompiler("gpu", [(2, 1000, 8, 2)], True) as pc:
        pc.submit(cfg)
        deadline = time.time() + 300
        while not (pc.compiled or pc.failed) and time.time() < deadline:
            time.sleep(0.2)
        assert pc.compiled == [cfg.to_json()], pc.failed
    ahead = _compiled_kernels(cache)
    assert ahead
    assert list((tmp_path / "zyfa" / "ptxas").glob("*.json"))  # the worker's ptxas check, made ahead
    args, kw = make_inputs("fp8", 128, 128, batch=2, heads=8, kv_heads=2, seqlen=1000, seed=0)
    flash_attn_func(*args, config=cfg, **kw)
    assert _compiled_kernels(cache) == ahead  # the JIT compiled nothing new: it loaded the precompiled one
