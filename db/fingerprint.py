"""Where a measurement was taken: GPU, driver and software versions.

A tuned entry is trusted as-is only on the same `device_key()` (GPU model, compute capability,
generator version): the other fields (driver, CUDA, torch, Triton) are recorded so that a slowdown
after an upgrade can be traced, and they make each environment's `digest()` distinct.

`runner` says what measured: "gpu", or a simulating runner (replay of stored numbers, fault
injection) that ran no kernel on any GPU. A simulated fingerprint is named "<runner> (no GPU)", so
its device key never equals a real GPU's and the dispatcher never serves its entries to one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from .checks import strict_int, text

#: Version strings: "2.13.0+cu130", "580.159.04", "3.6.0"; nothing else gets in.
VERSION_PATTERN = r"[0-9A-Za-z][0-9A-Za-z.+_-]*"
RUNNER_PATTERN = r"[a-z][a-z0-9_]{0,31}"
GPU_RUNNER = "gpu"
#: What ends the GPU name of a simulated fingerprint ("replay (no GPU)").
SIMULATED_SUFFIX = " (no GPU)"


@dataclass(frozen=True)
class Fingerprint:
    """Every field is checked on construction: rows read from a file come back through here."""

    gpu_name: str
    compute_capability: str
    sm_count: int
    memory_bytes: int
    driver: str
    cuda: str
    torch: str
    triton: str
    generator_version: str
    runner: str = GPU_RUNNER

    def __post_init__(self) -> None:
        text("gpu_name", self.gpu_name, max_len=128, allow_empty=False)
        text(
            "compute_capability",
            self.compute_capability,
            max_len=8,
            allow_empty=False,
            pattern=r"[0-9]{1,2}\.[0-9]{1,2}",
        )
        object.__setattr__(self, "sm_count", strict_int("sm_count", self.sm_count, lo=1, hi=100_000))
        object.__setattr__(self, "memory_bytes", strict_int("memory_bytes", self.memory_bytes, lo=1, hi=1 << 60))
        for name in ("driver", "cuda", "torch", "triton"):  # "" = unknown (no NVML, no Triton)
            text(name, getattr(self, name), max_len=64, pattern=VERSION_PATTERN)
        text("generator_version", self.generator_version, max_len=64, allow_empty=False, pattern=VERSION_PATTERN)
        object.__setattr__(self, "runner", _runner(self.gpu_name, self.runner))

    @property
    def simulated(self) -> bool:
        """Measured by a runner that timed nothing on a GPU: never to be served to one."""
        return self.runner != GPU_RUNNER

    def device_key(self) -> tuple[str, str, str]:
        """What must match for a tuned entry to be trusted as-is."""
        return (self.gpu_name, self.compute_capability, self.generator_version)

    def digest(self) -> str:
        """Stable id of the whole fingerprint: first 16 hex digits of a sha256 of its fields. The
        runner is left out: the GPU name already implies it, and stored digests stay valid."""
        fields = {k: v for k, v in self.to_dict().items() if k != "runner"}
        blob = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _runner(gpu_name: str, runner: object) -> str:
    """The checked runner: the one a "<runner> (no GPU)" name implies (databases written before the
    runner was recorded name it only there), else "gpu"; any other pairing is an error."""
    runner = text("runner", runner, max_len=32, allow_empty=False, pattern=RUNNER_PATTERN)
    if gpu_name.endswith(SIMULATED_SUFFIX):
        implied = gpu_name[: -len(SIMULATED_SUFFIX)]
        if runner == GPU_RUNNER and re.fullmatch(RUNNER_PATTERN, implied) and implied != GPU_RUNNER:
            runner = implied
        if runner != implied:
            raise ValueError(f"runner: {runner!r} does not match the simulated GPU name {gpu_name!r}")
    elif runner != GPU_RUNNER:
        raise ValueError(
            f"runner: {runner!r} is simulated, so gpu_name must be "
            f"{runner + SIMULATED_SUFFIX!r}, not the name of a GPU ({gpu_name!r})"
        )
    return runner


def current_fingerprint(device: int = 0) -> Fingerprint:
    """The fingerprint of CUDA device `device` of this process (RuntimeError without a GPU)."""
    import torch

    from zyfa_tune.generator import GENERATOR_VERSION

    if not torch.cuda.is_available():
        raise RuntimeError(
            f"current_fingerprint: no CUDA GPU is visible (torch {torch.__version__}, CUDA build "
            f"{torch.version.cuda or 'none'}); tuning results can only be recorded on a GPU"
        )
    count = torch.cuda.device_count()
    if type(device) is not int or not 0 <= device < count:
        raise RuntimeError(f"current_fingerprint: device {device!r} does not exist ({count} visible)")
    props = torch.cuda.get_device_properties(device)
    return Fingerprint(
        gpu_name=str(props.name),
        compute_capability=f"{props.major}.{props.minor}",
        sm_count=int(props.multi_processor_count),
        memory_bytes=int(props.total_memory),
        driver=_nvml_driver_version(),
        cuda=str(torch.version.cuda or ""),
        torch=str(torch.__version__),
        triton=_triton_version(),
        generator_version=GENERATOR_VERSION,
    )


def _nvml_driver_version() -> str:
    """Driver version from NVML (package nvidia-ml-py, optional); "" when unavailable."""
    try:
        import pynvml
    except ImportError:
        return ""
    try:
        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # NVML missing or failing must not stop a tuning run: the field is optional
        return ""
    return version.decode() if isinstance(version, bytes) else str(version)


def _triton_version() -> str:
    try:
        import triton
    except ImportError:
        return ""
    return str(getattr(triton, "__version__", ""))
