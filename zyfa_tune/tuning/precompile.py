"""Compile ahead: the next trial's kernel is compiled in a CPU process pool while the GPU measures
the current one, so the worker finds it in Triton's on-disk cache instead of compiling it itself.

A compile here is only a cache warm-up: the worker still builds (or loads) whatever it runs, and a
failure here is logged and ignored, never recorded: the worker's own attempt is what counts. The
compile processes inherit the tuner's environment (TRITON_CACHE_DIR, ZYFA_TUNE_CACHE), as the workers do.

What is compiled is what the worker's first launch would compile:
- runner "gpu": the Triton JIT's own path (`warmup`: specialise, compile, no launch) on the
  arguments `kernels.launch.prepare` makes for each tuned shape, built from meta tensors (shapes,
  strides and dtypes, no memory; a real allocation's pointer is aligned like a meta tensor's null),
  and the worker's ptxas check of each kernel's PTX for serialised wgmmas (kept per PTX text, so the
  worker reads the answer instead of running ptxas with the GPU idle). Needs the CUDA driver (the
  target is read from the device), not GPU memory or time.
- any other runner (simulate, fault): `compile_check.compile_check`, the sm_90a compile those runners make
  (its verdict is stored under the cache folder, where the worker's own check then finds it).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

from zyfa_tune.generator import KernelConfig

log = logging.getLogger("zyfa_tune.tuning.precompile")

#: (config json, [(batch, seqlen, heads, kv_heads)], causal) -> seconds spent
CompileFn = Callable[[str, Sequence[tuple[int, int, int, int]], bool], float]


def compile_for_gpu(config_json: str, shapes: Sequence[tuple[int, int, int, int]], causal: bool) -> float:
    """Compile `config` through Triton's JIT for each shape's argument specialisation (no launch)."""
    import torch

    from zyfa_tune.generator.build import serialised_wgmma
    from zyfa_tune.kernels.launch import kernel, prepare

    t0 = time.perf_counter()
    cfg = KernelConfig.from_json(config_json)
    dt = torch.float8_e4m3fn if cfg.dtype == "fp8" else torch.bfloat16
    for b, s, h, hk in shapes:
        q = torch.empty(b, s, h, cfg.head_dim_qk, dtype=dt, device="meta")
        k = torch.empty(b, s, hk, cfg.head_dim_qk, dtype=dt, device="meta")
        v = torch.empty(b, s, hk, cfg.head_dim_v, dtype=dt, device="meta")
        out = torch.empty(b, s, h, cfg.head_dim_v, dtype=torch.bfloat16, device="meta")
        ds = (
            [torch.empty(b, hk, dtype=torch.float32, device="meta") for _ in range(3)]
            if cfg.dtype == "fp8"
            else [None] * 3
        )
        grid, args, options = prepare(cfg, q, k, v, out, cfg.head_dim_qk**-0.5, causal, *ds)
        compiled = kernel(cfg).warmup(*args, grid=grid, **options)
        if compiled is not None:  # the worker's ptxas check, answered here (kept per PTX text)
            serialised_wgmma(compiled.asm["ptx"])
    return time.perf_counter() - t0


def compile_for_simulation(config_json: str, shapes: Sequence[tuple[int, int, int, int]], causal: bool) -> float:
    """The sm_90a compile the simulate and fault runners make (shape-independent)."""
    from zyfa_tune.tuning.compile_check import compile_check

    t0 = time.perf_counter()
    compile_check(KernelConfig.from_json(config_json), causal)
    return time.perf_counter() - t0


def compile_fn_for(runner: str) -> CompileFn:
    return compile_for_gpu if runner == "gpu" else compile_for_simulation


class _Server:
    """One compile process, `python -m zyfa_tune.tuning.precompile`, JSON lines in and out. A fresh
    interpreter rather than multiprocessing: spawn would re-run the user's main script in it."""

    def __init__(self, env: dict[str, str]):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "zyfa_tune.tuning.precompile"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )

    def compile(self, job: dict) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"compile process exited ({self.proc.poll()})")
        return json.loads(line)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class Precompiler:
    """Compile processes fed by a queue; `submit` never raises and never blocks."""

    def __init__(
        self,
        runner: str,
        shapes: Sequence[tuple[int, int, int, int]],
        causal: bool,
        *,
        processes: int = 1,
        gpu: int | None = None,
        compile_fn: CompileFn | None = None,
    ):
        fn = compile_fn or compile_fn_for(runner)
        self._job = dict(fn=f"{fn.__module__}:{fn.__qualname__}", shapes=[list(s) for s in shapes], causal=bool(causal))
        self.submitted: list[str] = []
        self.compiled: list[str] = []
        self.failed: list[str] = []
        self._queue: queue.Queue = queue.Queue()
        self._closed = False
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(gpu)
        self._servers: list[_Server] = []
        self._threads = [
            threading.Thread(target=self._serve, args=(env,), daemon=True, name=f"zyfa-precompile{i}")
            for i in range(max(1, processes))
        ]
        for t in self._threads:
            t.start()

    def submit(self, config: KernelConfig) -> None:
        if not self._closed:
            key = config.to_json()
            self.submitted.append(key)
            self._queue.put(key)

    def _serve(self, env: dict[str, str]) -> None:
        server = None
        while True:
            key = self._queue.get()
            if key is None or self._closed:
                return
            try:
                if server is None:
                    server = _Server(env)
                    self._servers.append(server)
                reply = server.compile(dict(self._job, config=key))
            except Exception as exc:  # noqa: BLE001 -- the process died: the next job starts a new one
                if self._closed:  # killed by close(): not a failure
                    return
                reply = dict(ok=False, error=str(exc))
                server = None
            if reply.get("ok"):
                self.compiled.append(key)
                log.debug("precompiled in %.2f s: %s", reply.get("seconds", 0.0), key)
            else:  # the worker's own compile reports real errors
                self.failed.append(key)
                log.debug("precompile failed: %s", reply.get("error"))

    def close(self) -> None:
        """Stop: queued jobs are dropped and running compiles killed (their result is not needed)."""
        self._closed = True
        for _ in self._threads:
            self._queue.put(None)
        for server in list(self._servers):
            server.kill()

    def __enter__(self) -> "Precompiler":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _resolve(name: str) -> CompileFn:
    module, _, qualname = name.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _serve() -> None:
    """The compile process: one JSON job per stdin line, one JSON reply per stdout line."""
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever compilers print must not reach the protocol
    for line in sys.stdin:
        job = json.loads(line)
        try:
            seconds = _resolve(job["fn"])(job["config"], [tuple(s) for s in job["shapes"]], job["causal"])
            reply = dict(ok=True, seconds=seconds)
        except Exception as exc:  # noqa: BLE001 -- reported to the parent, which only logs it
            reply = dict(ok=False, error=f"{type(exc).__name__}: {exc}"[:2000])
        proto.write(json.dumps(reply) + "\n")
        proto.flush()


if __name__ == "__main__":
    _serve()
