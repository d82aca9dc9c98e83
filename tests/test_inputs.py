"""Tuning on captured activations: loading .pt / .safetensors files of q, k, v safely and tuning
on their shape."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

from zyfa_tune.db import open_store
from zyfa_tune.kernels import dispatch
from zyfa_tune.tuning.spec import TuneSpec
from zyfa_tune.tuning.tuner import Tuner
from zyfa_tune.tuning.verify import load_activations

SHIPPED = str(Path(dispatch.TUNED_DIR) / "h200.db")


def qkv(b=1, s=64, h=4, hk=2, d=128, dv=128):
    return torch.randn(b, s, h, d), torch.randn(b, s, hk, d), torch.randn(b, s, hk, dv)


def test_dict_and_tuple_files(tmp_path):
    q, k, v = qkv()
    torch.save({"q": q, "k": k, "v": v, "extra": torch.zeros(1)}, tmp_path / "a.pt")
    torch.save((q.half(), k.half(), v.half()), tmp_path / "b.pt")
    for name in ("a.pt", "b.pt"):
        lq, lk, lv = load_activations(tmp_path / name)
        assert lq.dtype == torch.float32 and lq.shape == q.shape and lv.shape == v.shape
        assert torch.allclose(lq, q, atol=1e-2)


def test_safetensors(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    q, k, v = qkv()
    st.save_file({"q": q, "k": k, "v": v}, str(tmp_path / "a.safetensors"))
    assert torch.equal(load_activations(tmp_path / "a.safetensors")[2], v)


@pytest.mark.parametrize(
    "content,match",
    [
        ({"q": torch.zeros(1, 2, 2, 128), "k": torch.zeros(1, 2, 2, 128)}, "lacks"),
        ({"q": torch.zeros(2, 2, 128), "k": torch.zeros(1, 2, 2, 128), "v": torch.zeros(1, 2, 2, 128)}, "4-dim"),
        (
            {"q": torch.zeros(1, 2, 3, 128), "k": torch.zeros(1, 2, 2, 128), "v": torch.zeros(1, 2, 2, 128)},
            "inconsistent",
        ),
        (
            {
                "q": torch.zeros(1, 2, 2, 128, dtype=torch.int32),
                "k": torch.zeros(1, 2, 2, 128),
                "v": torch.zeros(1, 2, 2, 128),
            },
            "floating",
        ),
        ([torch.zeros(1)], "dict with q, k, v"),
    ],
)
def test_bad_files_name_the_problem(tmp_path, content, match):
    torch.save(content, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match=match):
        load_activations(tmp_path / "bad.pt")


class _Evil:
    def __reduce__(self):
        return (Path.touch, (Path(__file__).parent / "_pwned_by_pickle",))


def test_a_pickle_that_runs_code_is_refused(tmp_path):
    path = tmp_path / "evil.pt"
    path.write_bytes(pickle.dumps({"q": _Evil()}))
    with pytest.raises(ValueError, match="not a readable torch file"):
        load_activations(path)
    assert not (Path(__file__).parent / "_pwned_by_pickle").exists()


def test_wrong_suffix_and_missing_file(tmp_path):
    (tmp_path / "x.npy").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"\.pt, \.pth or \.safetensors"):
        load_activations(tmp_path / "x.npy")
    with pytest.raises(ValueError, match="not a file"):
        load_activations(tmp_path / "nope.pt")


def test_tuning_on_captured_inputs_uses_their_shape(tmp_path):
    q, k, v = qkv(b=2, s=4096, h=8, hk=2)
    torch.save({"q": q, "k": k, "v": v}, tmp_path / "acts.pt")
    spec = TuneSpec(
        dtype="fp8",
        head_dim_qk=128,
        head_dim_v=128,
        inputs=str(tmp_path / "acts.pt"),
        trials=3,
        storage=str(tmp_path / "t.db"),
        study_storage=str(tmp_path / "s.journal"),
        runner=f"simulate:{SHIPPED}",
        timeout_s=60.0,
    )
    (shape,) = spec.shapes
    assert (shape.batch, shape.seqlen, shape.heads, shape.kv_heads) == (2, 4096, 8, 2)
    Tuner(spec).run()
    with open_store(spec.storage, readonly=True, create=False) as store:
        rows = store.trials()
    assert rows and all((r["batch"], r["heads"], r["seqlen"]) == (2, 8, 4096) for r in rows)
    assert all(r["gqa_group"] == 4 for r in rows)
    with pytest.raises(ValueError, match="head dims"):
        TuneSpec(dtype="fp8", head_dim_qk=64, head_dim_v=64, inputs=str(tmp_path / "acts.pt"), trials=1)
    with pytest.raises(ValueError, match="one or the other"):
        TuneSpec(
            dtype="fp8", head_dim_qk=128, head_dim_v=128, inputs=str(tmp_path / "acts.pt"), seqlens=(4096,), trials=1
        )
