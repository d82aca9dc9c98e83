"""Load the PTX-generated FP8 GEMM cubins through the CUDA driver API (ctypes on libcuda),
build CUtensorMaps with cuTensorMapEncodeTiled, launch on torch tensors, check against a
float64 reference, time with CUDA events.

python3 run_gpu.py [build_dir]   (build_dir holds *.cubin and build.json from gen_ptx.py)
"""
from __future__ import annotations

import ctypes
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
BUILD = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "cubins")

cu = ctypes.CDLL("libcuda.so.1")
CUresult = ctypes.c_int
vp = ctypes.c_void_p


def _proto(name, *args):
    f = getattr(cu, name)
    f.restype = CUresult
    f.argtypes = list(args)
    return f


cuInit = _proto("cuInit", ctypes.c_uint)
cuGetErrorString = _proto("cuGetErrorString", CUresult, ctypes.POINTER(ctypes.c_char_p))
cuModuleLoadData = _proto("cuModuleLoadData", ctypes.POINTER(vp), vp)
cuModuleGetFunction = _proto("cuModuleGetFunction", ctypes.POINTER(vp), vp, ctypes.c_char_p)
cuFuncSetAttribute = _proto("cuFuncSetAttribute", vp, ctypes.c_int, ctypes.c_int)
cuFuncGetAttribute = _proto("cuFuncGetAttribute", ctypes.POINTER(ctypes.c_int), ctypes.c_int, vp)
cuLaunchKernel = _proto("cuLaunchKernel", vp, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                        ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, vp,
                        ctypes.POINTER(vp), ctypes.POINTER(vp))
cuTensorMapEncodeTiled = _proto(
    "cuTensorMapEncodeTiled", vp, ctypes.c_int, ctypes.c_uint32, vp,
    ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
    ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
    ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int)

CU_FUNC_ATTRIBUTE_NUM_REGS = 4
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
TM_UINT8, TM_INTERLEAVE_NONE, TM_SWIZZLE_128B, TM_L2_256B, TM_OOB_NONE = 0, 0, 3, 3, 0


def check(r, what):
    if r != 0:
        s = ctypes.c_char_p()
        cuGetErrorString(r, ctypes.byref(s))
        raise RuntimeError(f"{what}: CUresult {r} {s.value}")


class TensorMap:
    """128-byte, 64-byte aligned CUtensorMap for a row-major [rows, cols] uint8/fp8 tensor."""

    def __init__(self, t: torch.Tensor, box_cols: int, box_rows: int):
        assert t.dim() == 2 and t.element_size() == 1 and t.is_contiguous()
        self._buf = ctypes.create_string_buffer(128 + 64)
        self.addr = (ctypes.addressof(self._buf) + 63) & ~63
        rows, cols = t.shape
        gdim = (ctypes.c_uint64 * 2)(cols, rows)
        gstr = (ctypes.c_uint64 * 1)(cols)            # bytes, dims 1..rank-1
        box = (ctypes.c_uint32 * 2)(box_cols, box_rows)
        est = (ctypes.c_uint32 * 2)(1, 1)
        check(cuTensorMapEncodeTiled(vp(self.addr), TM_UINT8, 2, vp(t.data_ptr()), gdim, gstr, box, est,
                                     TM_INTERLEAVE_NONE, TM_SWIZZLE_128B, TM_L2_256B, TM_OOB_NONE),
              "cuTensorMapEncodeTiled")
        self.t = t  # keep alive


class Kernel:
    def __init__(self, info):
        self.info = info
        cfg = info["config"]
        self.bn, self.bm, self.threads = cfg["bn"], 64 * cfg["wgs"], info["threads"]
        self.smem, self.out = info["smem_bytes"], cfg["out"]
        with open(os.path.join(BUILD, info["name"] + ".cubin"), "rb") as f:
            self._image = f.read()
        self.mod = vp()
        check(cuModuleLoadData(ctypes.byref(self.mod), self._image), "cuModuleLoadData")
        self.fn = vp()
        check(cuModuleGetFunction(ctypes.byref(self.fn), self.mod, info["name"].encode()), "cuModuleGetFunction")
        check(cuFuncSetAttribute(self.fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, self.smem),
              "cuFuncSetAttribute")
        n = ctypes.c_int()
        check(cuFuncGetAttribute(ctypes.byref(n), CU_FUNC_ATTRIBUTE_NUM_REGS, self.fn), "cuFuncGetAttribute")
        self.regs = n.value

    def prepare(self, a, b, c):
        M, K = a.shape
        N = b.shape[0]
        assert M % self.bm == 0 and N % self.bn == 0 and K % 128 == 0
        tma, tmb = TensorMap(a, 128, self.bm), TensorMap(b, 128, self.bn)
        pc = ctypes.c_uint64(c.data_ptr())
        pk = ctypes.c_uint32(K)
        pldc = ctypes.c_uint32(N)
        keep = (tma, tmb, pc, pk, pldc)
        params = (vp * 5)(vp(tma.addr), vp(tmb.addr), vp(ctypes.addressof(pc)),
                          vp(ctypes.addressof(pk)), vp(ctypes.addressof(pldc)))
        grid = (N // self.bn, M // self.bm, 1)
        stream = vp(torch.cuda.current_stream().cuda_stream)

        def launch():
            check(cuLaunchKernel(self.fn, *grid, self.threads, 1, 1, self.smem, stream, params, None),
                  "cuLaunchKernel")
        launch.keep = keep
        return launch


def sync_or_die(timeout=20.0):
    ev = torch.cuda.Event()
    ev.record()
    t0 = time.time()
    while not ev.query():
        if time.time() - t0 > timeout:
            print("HANG: kernel did not finish in", timeout, "s", flush=True)
            os._exit(3)
        time.sleep(0.001)


def make(M, N, K, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(M, K, device="cuda", generator=g).to(torch.float8_e4m3fn)
    b = torch.randn(N, K, device="cuda", generator=g).to(torch.float8_e4m3fn)
    return a, b


def run_once(k: Kernel, a, b):
    M, N = a.shape[0], b.shape[0]
    dt = torch.float32 if k.out == "f32" else torch.bfloat16
    c = torch.full((M, N), float("nan"), device="cuda", dtype=dt)
    launch = k.prepare(a.view(torch.uint8), b.view(torch.uint8), c)
    launch()
    sync_or_die()
    return c


def verify(k: Kernel, M, N, K, seed):
    a, b = make(M, N, K, seed)
    c = run_once(k, a, b)
    ref = a.double() @ b.double().T
    c2 = run_once(k, a, b)
    err = (c.double() - ref)
    rel_l2 = (err.norm() / ref.norm()).item()
    return {"M": M, "N": N, "K": K, "nan": bool(torch.isnan(c).any().item()),
            "max_abs_err": err.abs().max().item(), "max_abs_ref": ref.abs().max().item(),
            "rel_l2": rel_l2, "bitwise_repeat": bool(torch.equal(c, c2))}


ITERS = int(os.environ.get("ITERS", "20"))


def sm_clock():
    try:
        import pynvml
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        return pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)
    except Exception as ex:  # noqa: BLE001
        return f"n/a ({ex})"


def bench(launch, iters=None):
    iters = iters or ITERS
    for _ in range(3):
        launch()
    sync_or_die()
    ts = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        launch()
        e.record()
        ts.append((s, e))
    sync_or_die(60)
    bench.clock = sm_clock()
    ms = sorted(s.elapsed_time(e) for s, e in ts)
    return ms[len(ms) // 2]


def time_case(k: Kernel, M, N, K):
    a, b = make(M, N, K, 1)
    dt = torch.float32 if k.out == "f32" else torch.bfloat16
    c = torch.empty((M, N), device="cuda", dtype=dt)
    launch = k.prepare(a.view(torch.uint8), b.view(torch.uint8), c)
    ms = bench(launch)
    return {"M": M, "N": N, "K": K, "ms": ms, "tflops": 2 * M * N * K / ms / 1e9, "sm_mhz": bench.clock}


def verify_scaled_mm(M, N, K, seed):
    a, b = make(M, N, K, seed)
    one = torch.tensor(1.0, device="cuda")
    ref = a.double() @ b.double().T
    res = {}
    for dt in (torch.float32, torch.bfloat16):
        try:
            c = torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=dt)
            err = c.double() - ref
            res[str(dt)] = {"max_abs_err": err.abs().max().item(), "rel_l2": (err.norm() / ref.norm()).item()}
        except Exception as ex:  # noqa: BLE001
            res[str(dt)] = f"error: {ex}"
    return res


def time_scaled_mm(M, N, K):
    a, b = make(M, N, K, 1)
    one = torch.tensor(1.0, device="cuda")
    ms = bench(lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    return {"M": M, "N": N, "K": K, "ms": ms, "tflops": 2 * M * N * K / ms / 1e9, "sm_mhz": bench.clock}


def main():
    torch.zeros(1, device="cuda")  # primary context current on this thread
    print(torch.cuda.get_device_name(), torch.__version__, "iters", ITERS, flush=True)
    build = json.load(open(os.path.join(BUILD, "build.json")))
    names = [n for n in os.environ.get("ONLY", "").split(",") if n]
    out = {"kernels": {}, "scaled_mm": {}}
    for info in build:
        if info["ptxas_rc"] or (names and info["name"] not in names):
            continue
        k = Kernel(info)
        r = {"regs_driver": k.regs, "verify": [], "time": []}
        print(f"== {info['name']}  threads={k.threads} smem={k.smem} regs={k.regs}", flush=True)
        for (M, N, K) in [(k.bm, k.bn, 128), (3 * k.bm, 2 * k.bn, 640), (2 * k.bm, 3 * k.bn, 4096)]:
            v = verify(k, M, N, K, seed=M + N + K)
            r["verify"].append(v)
            print("  verify", json.dumps(v), flush=True)
        for (M, N, K) in [(8192, 8192, 8192), (2048, 2048, 65536)]:
            t = time_case(k, M, N, K)
            r["time"].append(t)
            print(f"  time M={M} N={N} K={K}: {t['ms']:.4f} ms  {t['tflops']:.1f} TFLOP/s  sm={t['sm_mhz']} MHz", flush=True)
        out["kernels"][info["name"]] = r
    for (M, N, K) in [(8192, 8192, 8192), (2048, 2048, 65536)]:
        t = time_scaled_mm(M, N, K)
        out["scaled_mm"][f"{M}x{N}x{K}"] = t
        print(f"torch._scaled_mm M={M} N={N} K={K}: {t['ms']:.4f} ms  {t['tflops']:.1f} TFLOP/s  sm={t['sm_mhz']} MHz", flush=True)
    for (M, N, K) in [(128, 256, 128), (256, 768, 4096)]:
        v = verify_scaled_mm(M, N, K, seed=M + N + K)
        out["scaled_mm"][f"verify_{M}x{N}x{K}"] = v
        print(f"torch._scaled_mm verify M={M} N={N} K={K}:", json.dumps(v), flush=True)
    dst = os.environ.get("OUT", HERE)
    with open(os.path.join(dst, "run_gpu.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
