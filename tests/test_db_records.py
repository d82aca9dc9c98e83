"""Problem keys, buckets, fingerprints and trial results: validation without a database."""

from __future__ import annotations

import math
import sys

import pytest
import torch
from test_db_support import H200, fingerprint, key

from zyfa_tune.db import (
    TRIAL_STATUSES,
    Fingerprint,
    ProblemKey,
    TrialResult,
    bh_bucket,
    current_fingerprint,
    seqlen_bucket,
)
from zyfa_tune.generator import GENERATOR_VERSION


@pytest.mark.parametrize(
    "seqlen, bucket",
    [(1, 256), (255, 256), (256, 256), (257, 512), (4096, 4096), (5000, 8192), (131072, 131072), (10**7, 131072)],
)
def test_seqlen_bucket(seqlen, bucket):
    assert seqlen_bucket(seqlen) == bucket


@pytest.mark.parametrize("bh, bucket", [(1, 1), (3, 4), (64, 64), (65, 128), (1024, 1024), (5000, 1024)])
def test_bh_bucket(bh, bucket):
    assert bh_bucket(bh) == bucket


@pytest.mark.parametrize("bad", [0, -5, 1.5, True, "4096", None])
def test_buckets_reject_non_positive_ints(bad):
    with pytest.raises(ValueError):
        seqlen_bucket(bad)
    with pytest.raises(ValueError):
        bh_bucket(bad)


def test_key_from_shape():
    k = ProblemKey.from_shape(
        dtype="bf16", head_dim_qk=192, head_dim_v=128, causal=False, batch=3, heads=48, kv_heads=6, seqlen=3000
    )
    assert k == ProblemKey("bf16", 192, 128, False, 8, 4096, 256)
    assert k.to_dict() == dict(
        dtype="bf16",
        head_dim_qk=192,
        head_dim_v=128,
        causal=False,
        gqa_group=8,
        seqlen_bucket=4096,
        bh_bucket=256,
        api="fp8",
        tokens_bucket=0,
    )
    assert {k: 1}[ProblemKey(**k.to_dict())] == 1  # hashable, equal by value
    assert str(k) == "bf16 192/128 full gqa=8 seqlen<=4096 B*H<=256"


@pytest.mark.parametrize(
    "field, value",
    [
        ("dtype", "fp16"),
        ("dtype", 'fp8"; import os'),
        ("head_dim_qk", 84),
        ("head_dim_v", "128"),
        ("causal", 1),
        ("batch", 0),
        ("heads", -1),
        ("kv_heads", 5),
        ("seqlen", 0),
        ("seqlen", 2.0),
    ],
)
def test_key_from_shape_names_the_bad_field(field, value):
    shape = dict(dtype="fp8", head_dim_qk=128, head_dim_v=128, causal=True, batch=2, heads=32, kv_heads=8, seqlen=4096)
    shape[field] = value
    with pytest.raises(ValueError, match=field):
        ProblemKey.from_shape(**shape)


@pytest.mark.parametrize(
    "field, value",
    [("seqlen_bucket", 300), ("seqlen_bucket", 128), ("bh_bucket", 2048), ("gqa_group", 0), ("causal", "yes")],
)
def test_key_fields_validated_directly(field, value):
    fields = dict(key().to_dict(), **{field: value})
    with pytest.raises(ValueError, match=field):
        ProblemKey(**fields)


def test_fingerprint_digest_is_stable_and_covers_all_fields():
    fp = fingerprint()
    assert fp.digest() == fingerprint().digest() and len(fp.digest()) == 16
    int(fp.digest(), 16)
    assert fingerprint(driver="999.1").digest() != fp.digest()
    assert fingerprint(driver="999.1").device_key() == fp.device_key() == (H200, "9.0", GENERATOR_VERSION)
    # the digest must not change between releases: stored environments are found by it
    fixed = Fingerprint(
        gpu_name="NVIDIA H200",
        compute_capability="9.0",
        sm_count=132,
        memory_bytes=1,
        driver="1",
        cuda="1",
        torch="1",
        triton="1",
        generator_version="1",
    )
    assert fixed.digest() == "85f641b0a9cf5b9b"  # sha256 of the sorted compact JSON of the fields


@pytest.mark.parametrize(
    "field, value",
    [
        ("gpu_name", ""),
        ("gpu_name", "H200\nimport os"),
        ("compute_capability", "9"),
        ("compute_capability", 9.0),
        ("sm_count", True),
        ("sm_count", 0),
        ("memory_bytes", -1),
        ("driver", "5 80"),
        ("torch", None),
        ("generator_version", ""),
    ],
)
def test_fingerprint_fields_validated(field, value):
    with pytest.raises(ValueError, match=field):
        Fingerprint(**dict(fingerprint().to_dict(), **{field: value}))


def test_current_fingerprint_without_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="no CUDA GPU"):
        current_fingerprint()


def test_current_fingerprint_reads_the_device(monkeypatch):
    class Props:
        name, major, minor, multi_processor_count, total_memory = "NVIDIA H200", 9, 0, 132, 150_000_000_000

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props)
    monkeypatch.setitem(sys.modules, "pynvml", None)  # NVML absent: driver unknown, still works
    fp = current_fingerprint(0)
    assert fp.device_key() == ("NVIDIA H200", "9.0", GENERATOR_VERSION)
    assert (fp.sm_count, fp.memory_bytes, fp.driver, fp.torch) == (132, 150_000_000_000, "", torch.__version__)
    with pytest.raises(RuntimeError, match="device 1"):
        current_fingerprint(1)


def test_trial_result_validation():
    assert TRIAL_STATUSES == ("ok", "compile_error", "wrong", "timeout", "crash")
    r = TrialResult("ok", median_ms=2, tflops=500)
    assert type(r.median_ms) is float and r == TrialResult("ok", median_ms=2.0, tflops=500.0)
    TrialResult("compile_error", message="error: ptxas\n" * 3)  # failures need no timing
    with pytest.raises(ValueError, match="status"):
        TrialResult("great", median_ms=1.0)
    with pytest.raises(ValueError, match="median_ms"):
        TrialResult("ok")
    for field, bad in [
        ("median_ms", math.nan),
        ("median_ms", -1.0),
        ("median_ms", 0.0),
        ("p20_ms", math.inf),
        ("tflops", "1e3"),
        ("power_w", True),
        ("energy_j", -0.1),
        ("batch", 0),
        ("seqlen", 1.0),
    ]:
        with pytest.raises(ValueError, match=field):
            TrialResult("ok", **dict({"median_ms": 1.0}, **{field: bad}))
    with pytest.raises(ValueError, match="message"):
        TrialResult("crash", message=b"bytes")


def test_numpy_scalars_are_accepted_and_stored_as_plain_numbers():
    """A tuner's timings often are numpy scalars; they become plain floats/ints (which every
    database driver binds), and compare equal to the plain values."""
    np = pytest.importorskip("numpy")
    k = ProblemKey.from_shape(
        dtype="fp8",
        head_dim_qk=np.int64(128),
        head_dim_v=128,
        causal=True,
        batch=np.int32(2),
        heads=32,
        kv_heads=8,
        seqlen=np.int64(5000),
    )
    assert k == key(5000) and type(k.head_dim_qk) is int
    r = TrialResult("ok", median_ms=np.float32(1.5), tflops=np.float64(300.0), batch=np.int64(2))
    assert (type(r.median_ms), type(r.tflops), type(r.batch)) == (float, float, int)
    assert r == TrialResult("ok", median_ms=1.5, tflops=300.0, batch=2)
    with pytest.raises(ValueError, match="median_ms"):
        TrialResult("ok", median_ms=np.float64("nan"))
