"""The "gpu" runner: the real measurement, on the one GPU the worker's child process sees.

Per shape: a probe (fresh inputs of `task.input_family` from `task.seed`, or `task.inputs`; packed
sequences where the shape has lengths, `tuning.packed`, timed through flash_attn_varlen_func; float64
reference; error limit = `task.gate` x `error_ref`, the reference error on the same inputs: FA3-fp8's
where `fa3_fwd_interface` imports, else the exact default config's on plainly quantised codes).
API "fp8" (`verify.make_probe`): the kernel alone on plainly quantised codes. API "bf16"
(`verify.make_recipe_probe`): bf16 inputs, reference on them unquantised; the timed call quantises
with the task's recipe and runs the kernel (`zyfa_tune.attention.run_recipe`), one timing. Probes are
cached in the child per (shape, dtype, head dims, causal, seed, gate, inputs, input family, api,
recipe), a few at a time. Then a warm call of the config, then `verify.check_config` (error gate,
CUDA-event timing with NVML clock/power/energy reads). Statuses:
  compile_error  the warm call raised from emission or from Triton's compiler / module loader
                 (CompilationError, PTXASError, OutOfResources, MLIR pass failures: anything raised
                 inside triton/compiler, the NVIDIA backend compiler or our generator), or the compiled
                 kernel uses local memory (spills), or ptxas serialised its wgmmas (warning C7514 and
                 siblings: the schedule is undone; one more ptxas run on the kernel's PTX finds it);
                 message = error tail; the remaining shapes get the same result without being tried;
  wrong          error above the probe's limit, or NaN/inf (error_rel_l2 None then);
  ok             median/p20/p80, TFLOP/s, errors, SM clock, power; energy and TFLOP/J only where the
                 timing lasted >= 1 s (timing.MIN_ENERGY_WINDOW_S; else None);
  crash          anything else raised (CUDA errors such as an illegal memory access, out of memory, a
                 failed launch): the exception propagates, the child exits.
Hangs and hard crashes (segfaults) are seen by the parent as timeout / crash.
"""

from __future__ import annotations

import math
import os
import re
import traceback
from collections import OrderedDict
from pathlib import Path
from typing import Any

from zyfa_tune.generator import ConfigError, KernelConfig

from .task import Reporter, Shape, Task, exception_text, task_flops

#: probes (inputs + float64 reference) kept in a GPU child
PROBE_CACHE = 6


def _finite(x: float | None) -> float | None:
    return float(x) if x is not None and math.isfinite(x) else None


_CUDA_ERROR = re.compile(
    r"CUDA error|CUDA_ERROR|cudaError|CUDA driver|Triton Error \[CUDA\]|illegal memory access|"
    r"illegal instruction|misaligned address|unspecified launch failure|launch timed out|"
    r"device-side assert|out of memory|CUBLAS_STATUS|CUDNN_STATUS|uncorrectable ECC",
    re.I,
)


def is_cuda_error(exc: BaseException) -> bool:
    """An error of the CUDA device or context (after which the process should not go on)."""
    if type(exc).__name__ in ("AcceleratorError", "OutOfMemoryError", "CudaError"):
        return True
    return bool(_CUDA_ERROR.search(f"{type(exc).__name__}: {exc}"))


def _compiler_dirs() -> tuple[str, ...]:
    """Where code that emits, compiles or loads a kernel lives (frames of a compile error)."""
    import triton

    import zyfa_tune.generator as generator
    from zyfa_tune.generator.build import cache_dir

    root = Path(triton.__file__).parent
    return (
        str(root / "compiler") + os.sep,  # triton.compile, module load checks
        str(root / "backends" / "nvidia" / "compiler.py"),  # ttir..cubin stages, ptxas
        str(Path(generator.__file__).parent) + os.sep,  # emission, import of the source
        str(cache_dir() / "kernels") + os.sep,
    )  # the emitted kernel module itself


def is_compile_error(exc: BaseException) -> bool:
    """Raised by emission, Triton's compiler pipeline or the module loader's resource checks —
    not by a CUDA error and not by the launch itself."""
    if is_cuda_error(exc) or not isinstance(exc, Exception):
        return False
    from triton.runtime.errors import TritonError  # CompilationError, PTXASError, OutOfResources

    if isinstance(exc, (TritonError, ConfigError, SyntaxError)):
        return True
    dirs = _compiler_dirs()
    for frame, _ in traceback.walk_tb(exc.__traceback__):
        if frame.f_code.co_filename.startswith(dirs):
            return True
    return False


class GpuRunner:
    def __init__(self) -> None:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError(
                "runner 'gpu': no CUDA device is visible in the worker "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); without "
                "a GPU, runner 'simulate' (--runner simulate) runs the tuning loop on the CPU"
            )
        self.torch = torch
        torch.cuda.set_device(0)
        self._probes: OrderedDict[tuple, Any] = OrderedDict()

    def _probe(self, config: KernelConfig, shape: Shape, task: Task):
        from zyfa_tune.generator.recipe import PLAIN, Recipe
        from zyfa_tune.tuning.verify import make_probe, make_recipe_probe

        key = (
            shape,
            config.dtype,
            config.head_dim_qk,
            config.head_dim_v,
            task.causal,
            task.seed,
            task.gate,
            task.inputs,
            task.input_family,
            task.api,
            task.recipe,
        )
        probe = self._probes.get(key)
        if probe is None:
            while len(self._probes) >= PROBE_CACHE:
                self._probes.popitem(last=False)
                self.torch.cuda.empty_cache()
            where = dict(
                batch=shape.batch,
                heads=shape.heads,
                kv_heads=shape.kv_heads,
                seqlen=shape.seqlen,
                causal=task.causal,
                seed=task.seed,
                gate=task.gate,
                inputs=task.inputs,
                family=task.input_family,
            )
            if shape.lengths:
                from zyfa_tune.tuning.packed import make_packed_probe

                packed = {k: v for k, v in where.items() if k not in ("batch", "seqlen", "inputs")}
                probe = make_packed_probe(
                    config.dtype, config.head_dim_qk, config.head_dim_v, shape.lengths, fa3=True, **packed
                )
            elif task.api == "bf16":
                recipe = PLAIN if task.recipe is None else Recipe.from_json(task.recipe)
                probe = make_recipe_probe(config.head_dim_qk, config.head_dim_v, recipe, **where)
            else:
                probe = make_probe(config.dtype, config.head_dim_qk, config.head_dim_v, fa3=True, **where)
            self._probes[key] = probe
        self._probes.move_to_end(key)
        return probe

    def _warm_call(self, config: KernelConfig, probe) -> tuple[int | None, int | None]:
        """First call: emits, compiles and loads the kernel (and runs it once). Returns the
        (spill bytes, registers) of the kernels compiled for this config (as the probe's V runs it)."""
        from zyfa_tune.kernels import launch
        from zyfa_tune.tuning.verify import _call

        _call(config, probe)()
        self.torch.cuda.synchronize()
        kernels = launch.compiled_kernels(probe.runs(config))
        spills = [getattr(ck, "n_spills", None) for ck in kernels]
        regs = [getattr(ck, "n_regs", None) for ck in kernels]
        spills = [s for s in spills if s is not None]
        regs = [r for r in regs if r is not None]
        return (max(spills) if spills else None), (max(regs) if regs else None)

    @staticmethod
    def _serialised_wgmma(config: KernelConfig) -> str | None:
        """ptxas's C7514-style warning for a compiled kernel of this config, or None (one ptxas run
        per PTX text, kept: usually made by the precompile pool already)."""
        from zyfa_tune.generator.build import serialised_wgmma
        from zyfa_tune.kernels import launch

        for ck in launch.compiled_kernels(config):
            warning = serialised_wgmma(ck.asm["ptx"])
            if warning:
                return warning
        return None

    def _forget_kernels(self, configs: set[KernelConfig]) -> None:
        """Drop these configs' compiled kernels from the launcher's caches (a child serves hundreds
        of configs; each would otherwise stay loaded)."""
        from zyfa_tune.kernels import launch

        for config in configs:
            launch.forget(config)

    def run(self, config: KernelConfig, task: Task, reporter: Reporter) -> None:
        from zyfa_tune.tuning.verify import check_config

        probes = [self._probe(config, s, task) for s in task.shapes]
        reporter.setup_done()
        failed: str | None = None
        try:
            for i, (shape, probe) in enumerate(zip(task.shapes, probes)):
                if failed is not None:
                    reporter.result(i, dict(status="compile_error", message=failed))
                    continue
                try:
                    spills, regs = self._warm_call(config, probe)
                except Exception as exc:
                    if not is_compile_error(exc):
                        raise
                    failed = exception_text(exc)
                    reporter.result(i, dict(status="compile_error", message=failed))
                    continue
                if spills:
                    failed = f"spills {spills} bytes (local memory per thread; {regs} registers)"
                    reporter.result(i, dict(status="compile_error", message=failed))
                    continue
                serialised = self._serialised_wgmma(probe.runs(config))
                if serialised:
                    failed = f"ptxas serialises the wgmmas: {serialised}"
                    reporter.result(i, dict(status="compile_error", message=failed))
                    continue
                v = check_config(config, probe, reps=task.reps)
                self.torch.cuda.synchronize()
                reporter.result(i, self._fields(config, shape, task, v, probe.error_ref))
        finally:
            self._forget_kernels({config} | {p.runs(config) for p in probes})

    @staticmethod
    def _fields(config: KernelConfig, shape: Shape, task: Task, v, error_ref: float | None) -> dict[str, Any]:
        err, emax = _finite(v.error_rel_l2), _finite(getattr(v, "error_max", None))
        error_ref = _finite(error_ref) or None  # (a reference error of 0 cannot scale a gate)
        if not v.ok:
            return dict(
                status="wrong",
                error_rel_l2=err,
                error_max=emax,
                error_ref=error_ref,
                message=f"{v.reason} (limit = gate {task.gate:g} x the reference's error)",
            )
        t = v.timing
        flops = task_flops(config.head_dim_qk, config.head_dim_v, shape, task.causal)
        energy = _finite(t.energy_j_per_call) if t is not None else None
        return dict(
            status="ok",
            median_ms=v.median_ms,
            p20_ms=t.p20_ms if t else None,
            p80_ms=t.p80_ms if t else None,
            tflops=flops / (v.median_ms * 1e-3) / 1e12,
            error_rel_l2=err,
            error_max=emax,
            error_ref=error_ref,
            sm_clock_mhz=_finite(t.sm_clock_mhz) if t else None,
            power_w=_finite(t.power_w) if t else None,
            energy_j=energy or None,
            tflop_per_j=flops / 1e12 / energy if energy else None,
        )
