"""Spike: V -> V^T with TMA and an in-register byte transpose (Gluon), against the Triton copy.

Why: the Triton copy (kernels/transpose.py) converts its tile through shared memory byte by byte
(per 16 bytes a thread issues 1 LDG.128, 4 STS, 16 LDS.U8, 1 STG.128) and runs at ~2.1 TB/s, ~5% of
the hd128 FP8 kernel's time at 8K (docs/PERF.md, session 5). Here a program TMA-loads a (128 keys, D)
tile of V, writes its transpose into a (D, 128) shared tile the way the Gluon producer does for
v_layout="natural" (each thread 4 keys x D/16 dims: LDS.64, PRMT, STS.32; GPU-verified there) and
TMA-stores it: global traffic without instructions, about half the shared-memory instructions.
Key order only (v_permute=False); D in {64, 128}.

    python3 gluon_copy.py          # no GPU: compile for sm_90a, print the shared-memory instructions
    python3 gluon_copy.py --gpu    # H200: bitwise check against transpose_v_reference, then device time
                                   # per call of both copies from CUDA-graph replays (METHOD.md)
"""

from __future__ import annotations

import re
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

BLOCK_K = 128


@gluon.jit
def _copy_kernel(desc_v, desc_vt, SEQ_K, HKV, BLOCK_K: gl.constexpr, D: gl.constexpr):
    """Program (key block, b * HKV + h): V rows [b*Sk + k0, k0 + BLOCK_K) x cols [h*D, h*D + D) ->
    V^T rows [(b*HKV + h)*D, + D) x cols [k0, k0 + BLOCK_K). TMA zero-fills keys past Sk on the load
    and clips them on the store."""
    dtype: gl.constexpr = gl.float8e4nv
    k0 = gl.program_id(0) * BLOCK_K
    bh = gl.program_id(1)
    b = bh // HKV
    h = bh % HKV
    raw = gl.allocate_shared_memory(dtype, [BLOCK_K, D], desc_v.layout)
    vt = gl.allocate_shared_memory(dtype, [D, BLOCK_K], desc_vt.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bar.index(0), count=1)
    mbarrier.expect(bar.index(0), desc_v.block_type.nbytes)
    tma.async_copy_global_to_shared(desc_v, [b * SEQ_K + k0, h * D], bar.index(0), raw)
    mbarrier.wait(bar.index(0), 0)
    rows: gl.constexpr = gl.BlockedLayout([4, D // 16], [8, 4], [1, 4], [1, 0])  # (keys, dims)
    for c in gl.static_range(BLOCK_K // 32):
        x = raw.slice(c * 32, 32, dim=0).load(rows)
        vt.slice(c * 32, 32, dim=1).store(x.permute((1, 0)))
    fence_async_shared()
    gl.thread_barrier()
    tma.async_copy_shared_to_global(desc_vt, [bh * D, k0], vt)
    tma.store_wait(0)


def descriptors(v: torch.Tensor, vt: torch.Tensor):
    b, sk, hk, d = v.shape
    lin = gl.NVMMASharedLayout.get_default_for([BLOCK_K, d], gl.float8e4nv)
    lout = gl.NVMMASharedLayout.get_default_for([d, BLOCK_K], gl.float8e4nv)
    return (TensorDescriptor(v, [b * sk, hk * d], [v.stride(1), 1], [BLOCK_K, d], lin),
            TensorDescriptor(vt, [b * hk * d, vt.shape[3]], [vt.stride(2), 1], [d, BLOCK_K], lout))


def copy(v: torch.Tensor) -> torch.Tensor:
    """(B, Sk, Hkv, D) contiguous -> (B, Hkv, D, Skp) with Skp = Sk padded to 16 (as transpose_v)."""
    from zyfa_tune.kernels.transpose import padded_keys

    b, sk, hk, d = v.shape
    vt = torch.empty(b, hk, d, padded_keys(sk, False), dtype=v.dtype, device=v.device)
    dv, dvt = descriptors(v, vt)
    _copy_kernel[(triton.cdiv(sk, BLOCK_K), b * hk)](dv, dvt, sk, hk, BLOCK_K, d, num_warps=4)
    return vt


def compile_only(d: int) -> None:
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from zyfa_tune.generator.build import _disassemble

    v = torch.zeros(1, 256, 2, d, dtype=torch.float8_e4m3fn)
    vt = torch.zeros(1, 2, d, 256, dtype=torch.float8_e4m3fn)
    dv, dvt = descriptors(v, vt)
    sig = {"desc_v": mangle_type(dv), "desc_vt": mangle_type(dvt), "SEQ_K": "i32", "HKV": "i32",
           "BLOCK_K": "constexpr", "D": "constexpr"}
    src = GluonASTSource(fn=_copy_kernel, signature=sig, constexprs={"BLOCK_K": BLOCK_K, "D": d})
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    sass, usage = _disassemble(ck.asm["cubin"])
    ops: dict[str, int] = {}
    for op in re.findall(r"\b((?:LDS|STS|LDG|STG|PRMT|SHFL|UTMALDG|UTMASTG)(?:\.[A-Z0-9.]+)?)", sass):
        ops[op] = ops.get(op, 0) + 1
    print(f"D={d}: registers {usage['REG']}, spills {usage['LOCAL'] + usage['STACK']} B, shared "
          f"{ck.metadata.shared} B, per program (128 x {d} bytes, 128 threads): {ops}")


def on_gpu() -> None:
    from zyfa_tune.tuning.timing import time_cuda, warm_gpu
    from zyfa_tune.kernels.transpose import transpose_v, transpose_v_reference

    for b, sk, hk, d in ((1, 1, 2, 128), (2, 1000, 3, 64), (2, 1000, 3, 128), (2, 8192, 32, 128)):
        v = torch.randn(b, sk, hk, d, device="cuda").to(torch.float8_e4m3fn)
        ok = torch.equal(copy(v).view(torch.uint8), transpose_v_reference(v).view(torch.uint8))
        print(f"B={b} Sk={sk} Hkv={hk} D={d}: bitwise equal to the reference: {ok}", flush=True)
    warm_gpu(3.0)
    for b, sk, hk in ((2, 8192, 32), (1, 16384, 32), (4, 1024, 16)):
        v = torch.randn(b, sk, hk, 128, device="cuda").to(torch.float8_e4m3fn)
        gib = 2 * v.numel() / 2**30
        for name, fn in (("triton copy", lambda: transpose_v(v)), ("gluon TMA copy", lambda: copy(v))):
            fn()
            graph = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()
            torch.cuda.current_stream().wait_stream(side)
            with torch.cuda.graph(graph):
                for _ in range(20):
                    fn()
            us = time_cuda([graph.replay], reps=30).median_ms * 1e3 / 20
            print(f"B={b} Sk={sk} Hkv={hk} D=128 {name}: {us:.1f} us per call, "
                  f"{gib * 2**30 / (us * 1e-6) / 1e12:.2f} TB/s", flush=True)


if __name__ == "__main__":
    if "--gpu" in sys.argv[1:]:
        on_gpu()
    else:
        for dim in (64, 128):
            compile_only(dim)
