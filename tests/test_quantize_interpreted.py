"""The quantiser's Triton passes (kernels/quantize_passes.py) run by Triton's interpreter on CPU against the
torch path, bitwise: balanced V (`quantize_tensors(..., balance_last=True)`, `quantize_fp8(...,
v_rounding="balanced")`) with programs of one and of several 16-key blocks (`BALANCE_BLOCKS`), key counts that
are not multiples of a program's keys, GQA, natural and K-major V. The interpreter's own e4m3 conversion
rounds wrongly (its float8 helper is not e4m3fn's), so the script converts with torch's, which is the
reference's; every other operation is the interpreter's."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

#: run in a fresh interpreter: TRITON_INTERPRET is read when triton is first imported
_SCRIPT = textwrap.dedent(
    """
    import sys
    import numpy as np
    import torch
    import triton.language as tl
    import triton.runtime.interpreter as interp
    import zyfa_tune.quantize as api
    from zyfa_tune.kernels import quantize as Q

    patch = interp._patch_lang_tensor

    def patched(tensor, scope):  # a loaded scalar is a 1-element array, which numpy 2 will not int()
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patched
    fp_to_fp = interp.InterpreterBuilder.create_fp_to_fp

    def e4m3_by_torch(self, src, dst_type, rounding_mode):
        data = np.asarray(src.data)
        if dst_type.scalar == tl.float8e4nv:
            out = torch.from_numpy(data.astype(np.float32).reshape(-1)).to(torch.float8_e4m3fn).view(torch.uint8)
            return interp.TensorHandle(out.numpy().reshape(data.shape), tl.float8e4nv)
        if src.dtype.scalar == tl.float8e4nv:
            out = torch.from_numpy(data.reshape(-1).copy()).view(torch.float8_e4m3fn).float().numpy()
            return interp.TensorHandle(out.reshape(data.shape).astype(interp._get_np_dtype(dst_type)), dst_type.scalar)
        return fp_to_fp(self, src, dst_type, rounding_mode)

    interp.InterpreterBuilder.create_fp_to_fp = e4m3_by_torch
    # launched as Triton's own path launches (the interpreter has no compiled kernel to bind)
    Q.run = lambda head, fn, grid, args, constexprs, options, device: fn[grid](*args, **constexprs, **options)
    Q.Bound = lambda compiled, grid, device: None

    def same(a, b):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))

    def inputs(shape, dtype, seed):
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3 + 0.5
        x[:, :1] *= 0.05  # a sink-like small first key: its block's other keys still move
        return x.to(dtype)

    Q.BALANCE_BLOCKS = int(sys.argv[1])
    bad = 0
    weight = torch.tensor([[0.0, 0.3], [1.7, 6.0]])  # (batch, kv head): each its own kappa
    for i, s in enumerate((1, 15, 17, 100, 300)):
        Q._plans.clear()
        k_major = i % 2 == 1
        v = inputs((2, s, 4, 48), torch.bfloat16 if s % 2 else torch.float32, s)  # 4 heads of 2 kv heads
        args = ([(v, False, None)], 2, k_major, True, weight)
        (got,), (got_d,) = Q._launch_tensors(*args)
        (want,), (want_d,) = Q.quantize_tensors(*args)  # (CPU: the torch reference)
        if not (same(got, want) and torch.equal(got_d, want_d)):
            bad += 1
            print("BAD", dict(s=s, k_major=k_major, dtype=v.dtype), int((got.view(torch.uint8) != want.view(torch.uint8)).sum()))
        if s == 300:  # (the balanced codes are not the nearest: the comparison means something)
            assert not same(want.contiguous(), Q.quantize_heads_reference(v, 2)[0])
    q, k, v = (inputs((1, 100, h, 64), torch.bfloat16, h) for h in (4, 2, 2))
    want = api.quantize_fp8(q, k, v, v_layout="k_major", v_rounding="balanced")
    api.quantize_tensors = Q._launch_tensors
    Q._plans.clear()
    got = api.quantize_fp8(q, k, v, v_layout="k_major", v_rounding="balanced")
    if not all(same(a, b) for a, b in zip(got, want)):
        bad += 1
        print("BAD quantize_fp8", [same(a, b) for a, b in zip(got, want)])
    print("bad", bad)
    """
)


@pytest.mark.parametrize("blocks", [1, 4])
def test_balanced_v_in_the_interpreter_is_the_reference(blocks):
    """The two passes' balanced V codes and descales are the torch path's bitwise for key counts 1, 15, 17, 100
    and 300 (a partial last program, blocks wholly past the keys), bf16 and float32, natural and K-major V, 4
    heads of 2 kv heads with a kappa each, a padded head dim (48); and quantize_fp8's six outputs (plain Q and
    K in the same launches) with balanced K-major V, GQA."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(blocks)], env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-2:] == ["bad", "0"], done.stdout[-3000:]
