"""Emitted source -> Triton JIT function (cached per source hash in memory and on disk), and
ahead-of-time compilation for a GPU target without a GPU (sm_90 from a CPU machine).

Triton's JIT reads a kernel's source with `inspect`, so each emitted kernel is written to a file
named by its source hash under the cache directory and imported from there. Triton keeps its own
on-disk cache of compiled binaries keyed by that source, so a kernel compiles once per machine.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from .emit_triton import KERNEL_NAME, EmittedKernel

_lock = threading.Lock()
_modules: dict[str, ModuleType] = {}


def cache_dir() -> Path:
    """Where emitted sources live: $ZYFA_TUNE_CACHE, else $XDG_CACHE_HOME/zyfa_tune, else ~/.cache."""
    root = os.environ.get("ZYFA_TUNE_CACHE")
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "zyfa_tune")
    return Path(root)


def load_module(kernel: EmittedKernel) -> ModuleType:
    """Import the emitted source as a module (once per source hash per process)."""
    with _lock:
        mod = _modules.get(kernel.source_hash)
        if mod is not None:
            return mod
        folder = cache_dir() / "kernels"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"zyfa_{kernel.source_hash}.py"
        if not path.exists() or path.read_text() != kernel.source:
            # write-then-rename: a concurrent reader never sees a half-written file
            fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
            with os.fdopen(fd, "w") as fh:
                fh.write(kernel.source)
            os.replace(tmp, path)
        name = f"zyfa_tune_kernels.k_{kernel.source_hash}"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        _modules[kernel.source_hash] = mod
        return mod


def jit_function(kernel: EmittedKernel):
    return getattr(load_module(kernel), KERNEL_NAME)


# ---- ahead-of-time compilation (no GPU needed) ------------------------------------------------

_PTR = {"fp8": "*fp8e4nv", "bf16": "*bf16"}


@dataclass(frozen=True)
class CompiledArtifacts:
    ttgir: str
    ptx: str
    cubin: bytes
    sass: str
    registers: int
    spill_bytes: int  # local memory per thread (stack frame / spills) from the cubin
    shared_bytes: int

    def count(self, opcode: str) -> int:
        """Number of SASS instructions whose mnemonic starts with `opcode` (e.g. 'MUFU.EX2')."""
        pattern = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?" + re.escape(opcode), re.M)
        return len(pattern.findall(self.sass))


def _tool(name: str) -> str:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if not path.exists():
        raise FileNotFoundError(f"{name} not found in the triton package at {path}")
    return str(path)


def compile_for_target(kernel: EmittedKernel, *, causal: bool = True, capability: int = 90) -> CompiledArtifacts:
    """Compile the kernel for `capability` (default sm_90a) with no GPU present.

    Integer arguments that a real launch marks as multiples of 16 (strides, with contiguous
    last dims) are marked the same way, so the code matches what runs on the GPU.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = jit_function(kernel)
    cfg = kernel.config
    ptr = _PTR[cfg.dtype]
    names = [p.name for p in fn.params]
    sig: dict[str, str] = {}
    for n in names:
        if n.startswith("desc_"):  # desc_<tensor>_<width>: block shapes as launch.py builds them
            _, tname, width = n.split("_")
            rows = cfg.block_m if tname == "q" else cfg.block_n
            block = [int(width), rows] if tname == "v" and cfg.v_layout == "transposed" else [rows, int(width)]
            sig[n] = f"tensordesc<{ptr[1:]}[{block[0]},{block[1]}]>"
        elif n in ("Q", "K", "V"):
            sig[n] = ptr
        elif n == "O":
            sig[n] = "*bf16"
        elif n in ("QD", "KD", "VD"):
            sig[n] = "*fp32"
        elif n == "sm_scale_log2":
            sig[n] = "fp32"
        elif n == "CAUSAL":
            sig[n] = "constexpr"
        else:
            sig[n] = "i32"
    div16 = [i for i, n in enumerate(names) if n.startswith("stride_") and not n.startswith("stride_d")]
    attrs = {(i,): [["tt.divisibility", 16]] for i in div16}
    for i, n in enumerate(names):
        if n in ("Q", "K", "V", "O", "QD", "KD", "VD"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, constexprs={"CAUSAL": bool(causal)}, attrs=attrs)
    module = load_module(kernel)
    compiled = triton.compile(
        src, target=GPUTarget("cuda", capability, 32),
        options={"num_warps": module.NUM_WARPS, "num_stages": module.NUM_STAGES, "maxnreg": module.MAXNREG})
    cubin = compiled.asm["cubin"]
    sass, usage = _disassemble(cubin)
    return CompiledArtifacts(ttgir=compiled.asm["ttgir"], ptx=compiled.asm["ptx"], cubin=cubin, sass=sass,
                             registers=usage["REG"], spill_bytes=usage["LOCAL"] + usage["STACK"],
                             shared_bytes=int(compiled.metadata.shared))


def _disassemble(cubin: bytes) -> tuple[str, dict[str, int]]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        cuobjdump = _tool("cuobjdump")
        sass = subprocess.run([cuobjdump, "-sass", str(path)], check=True, capture_output=True, text=True).stdout
        res = subprocess.run([cuobjdump, "-res-usage", str(path)], check=True, capture_output=True, text=True).stdout
    usage = {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", res)}
    for key in ("REG", "STACK", "SHARED", "LOCAL"):
        usage.setdefault(key, 0)
    return sass, usage
