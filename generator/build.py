"""Emitted source -> Triton / Gluon JIT function (cached per source hash in memory and on disk), and
ahead-of-time compilation for a GPU target without a GPU (sm_90 from a CPU machine).

Triton's JIT reads a kernel's source with `inspect`, so each emitted kernel is written to a file
named by its source hash under the cache directory and imported from there. Triton keeps its own
on-disk cache of compiled binaries keyed by that source, so a kernel compiles once per machine.
Verdicts of the toolchain on one input (a compile check, ptxas's warnings on one PTX) are kept beside
them as small JSON memos (`memo_path`), so that the one made in the precompile pool is the worker's.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from .emitted import EmittedKernel
from .ptx_pass import install as _install_ptx_pass

log = logging.getLogger("zyfa_tune.generator.build")
_lock = threading.Lock()
_modules: dict[str, ModuleType] = {}


def cache_dir() -> Path:
    """Where emitted sources live: $ZYFA_TUNE_CACHE, else $XDG_CACHE_HOME/zyfa_tune, else ~/.cache."""
    root = os.environ.get("ZYFA_TUNE_CACHE")
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "zyfa_tune")
    return Path(root)


def memo_path(kind: str, key: str) -> Path:
    """Where the toolchain's verdict `kind` on input `key` is kept: cache_dir()/<kind>/<key>-triton<version>.json
    (Triton's version fixes its compiler and the ptxas it ships)."""
    import triton

    version = re.sub(r"[^A-Za-z0-9_.+-]", "_", triton.__version__)
    return cache_dir() / kind / f"{key}-triton{version}.json"


def read_memo(path: Path):
    """The JSON value stored at `path`, or None if there is none or it does not parse (the caller
    checks its shape: a memo is redone, never trusted, when it does not read as one)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_memo(path: Path, value) -> None:
    """Keep `value` at `path` (_write_file); a memo that cannot be written only costs the next run of
    the tool."""
    try:
        _write_file(path, json.dumps(value))
    except OSError as exc:
        log.warning("not kept at %s: %s", path, exc)


def _write_file(path: Path, text: str) -> None:
    """Write-then-rename, so a concurrent reader (a worker, another compile process) never sees half
    a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


def load_module(kernel: EmittedKernel) -> ModuleType:
    """Import the emitted source as a module (once per source hash per process)."""
    with _lock:
        mod = _modules.get(kernel.source_hash)
        if mod is not None:
            return mod
        path = cache_dir() / "kernels" / f"zyfa_{kernel.source_hash}.py"
        if not path.exists() or path.read_text() != kernel.source:
            _write_file(path, kernel.source)
        name = f"zyfa_tune_kernels.k_{kernel.source_hash}"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        _modules[kernel.source_hash] = mod
        return mod


def jit_function(kernel: EmittedKernel):
    """The kernel's JIT function; every compile goes through it, so it also hooks generator/ptx_pass.py into
    Triton's ptx stage (for the kernels whose name asks for the pass)."""
    _install_ptx_pass()
    return getattr(load_module(kernel), kernel.kernel_name)


# ---- ahead-of-time compilation (no GPU needed) ------------------------------------------------

_PTR = {"fp8": "*fp8e4nv", "bf16": "*bf16"}
#: ptxas's warning when it gives up overlapping wgmmas (C7514 and its siblings): every wgmma of the
#: function then waits for the previous one, which undoes any hand-made schedule.
_SERIALISED_WGMMA = re.compile(r"^.*wgmma\.mma_async instructions are serialized.*$", re.M)


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

    @functools.cached_property
    def ptxas_log(self) -> str:
        """ptxas's verbose output and warnings for this PTX (Triton's own compile discards them);
        computed on first use (one more ptxas run)."""
        return ptxas_log(self.ptx)

    @property
    def serialised_wgmma(self) -> str | None:
        """The ptxas warning that it serialised the wgmmas (C7514 ...), or None (kept per PTX text)."""
        return serialised_wgmma(self.ptx)


def ptxas_log(ptx: str, capability: int = 90) -> str:
    """Run ptxas (the one Triton ships) on `ptx` for sm_<capability>a; its stdout and stderr."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        run = subprocess.run(
            [
                _tool("ptxas"),
                f"-arch=sm_{capability}a",
                "-v",
                "--warn-on-spills",
                str(src),
                "-o",
                str(Path(tmp) / "k.cubin"),
            ],
            capture_output=True,
            text=True,
        )
    return run.stdout + run.stderr


def serialised_wgmma(ptx: str) -> str | None:
    """The ptxas warning that it serialised a kernel's wgmmas (C7514 ...), or None. One ptxas run
    (about 2 s for the larger Gluon kernels) per PTX text: the answer is kept (memo_path "ptxas"), so
    the precompile pool runs it while the GPU measures the previous trial, not the worker."""
    path = memo_path("ptxas", hashlib.sha256(ptx.encode()).hexdigest()[:32])
    kept = read_memo(path)
    if (
        isinstance(kept, dict)
        and set(kept) == {"serialised"}
        and (kept["serialised"] is None or isinstance(kept["serialised"], str))
    ):
        return kept["serialised"]
    match = _SERIALISED_WGMMA.search(ptxas_log(ptx))
    verdict = match.group(0).strip() if match else None
    write_memo(path, {"serialised": verdict})
    return verdict


def _tool(name: str) -> str:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if not path.exists():
        raise FileNotFoundError(f"{name} not found in the triton package at {path}")
    return str(path)


def compile_for_target(
    kernel: EmittedKernel,
    *,
    causal: bool = True,
    capability: int = 90,
    descales: bool = True,
    serving: dict[str, bool] | None = None,
) -> CompiledArtifacts:
    """Compile the kernel for `capability` (default sm_90a) with no GPU present.

    Integer arguments that a real launch marks as multiples of 16 (strides, with contiguous
    last dims) are marked the same way, so the code matches what runs on the GPU. `descales=False`
    compiles the specialisation a call without descales gets (QD/KD/VD None). `serving`: the
    constexprs of a serving-variant kernel (VARLEN, WINDOW, RETURN_LSE, PAGED; all False where left out).
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if kernel.config.backend == "gluon":
        return _compile_gluon(kernel, causal=causal, capability=capability, descales=descales)
    fn = jit_function(kernel)
    cfg = kernel.config
    ptr = _PTR[cfg.dtype]
    names = [p.name for p in fn.params]
    sig, constexprs, attrs = _scalar_signature(names, causal, descales)
    for i, n in enumerate(names):
        if n.startswith("desc_"):  # desc_<tensor>_<width>: block shapes as launch.py builds them
            _, tname, width = n.split("_")
            rows = cfg.block_m if tname == "q" else cfg.block_n
            block = [int(width), rows] if tname == "v" and cfg.v_layout == "transposed" else [rows, int(width)]
            sig[n] = f"tensordesc<{ptr[1:]}[{block[0]},{block[1]}]>"
        elif n in ("Q", "K", "V", "O"):
            sig[n] = "*bf16" if n == "O" else ptr
            attrs[(i,)] = _DIV16
        elif n.startswith("stride_") and not n.startswith(("stride_d", "stride_l", "stride_p")):
            attrs[(i,)] = _DIV16
    if "VARLEN" in names:
        _serving_signature(names, dict(serving or {}), sig, constexprs, attrs)
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    module = load_module(kernel)
    compiled = triton.compile(
        src,
        target=GPUTarget("cuda", capability, 32),
        options={"num_warps": module.NUM_WARPS, "num_stages": module.NUM_STAGES, "maxnreg": module.MAXNREG},
    )
    return artifacts(compiled)


def _compile_gluon(kernel: EmittedKernel, *, causal: bool, capability: int, descales: bool = True) -> CompiledArtifacts:
    """The Gluon kernel for sm_<capability>a: descriptors typed from the config's blocks (their
    shared layouts are what the launcher builds); its integers are never specialised (gluon_sm90.emit's
    UNSPECIALISED), so plain i32 is exactly what a launch compiles. The varlen variant's pointers
    (VARLEN_PARAMS) and the LSE kernel's LSE are 16-byte aligned allocations, as a launch passes them; the
    window kernel's bounds (WINDOW_PARAMS) plain i32, as UNSPECIALISED; the paged twin's page table 16-byte
    aligned too, its stride and page size plain i32."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from .gluon_sm90.emit import VARLEN_PARAMS, descriptor_blocks, descriptor_type, kernel_params

    fn = jit_function(kernel)
    blocks = descriptor_blocks(kernel.config)
    names = [p.name for p in fn.params]
    varlen, lse, window, paged = "CU_Q" in names, "LSE" in names, "WIN_L" in names, "PAGE_TABLE" in names
    assert names == [*blocks, *kernel_params(kernel.config, varlen, lse, window, paged), "CAUSAL"], names
    sig, constexprs, attrs = _scalar_signature(names, causal, descales)
    sig.update({n: descriptor_type(*blocks[n]) for n in blocks})
    if varlen:
        for name in VARLEN_PARAMS:
            sig[name], attrs[(names.index(name),)] = ("*bf16" if name == "O_PTR" else "*i32"), _DIV16
    if lse:
        sig["LSE"], attrs[(names.index("LSE"),)] = "*fp32", _DIV16
    if paged:
        sig["PAGE_TABLE"], attrs[(names.index("PAGE_TABLE"),)] = "*i32", _DIV16
    src = GluonASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(
        src, target=GPUTarget("cuda", capability, 32), options={"num_warps": load_module(kernel).NUM_WARPS}
    )
    return artifacts(compiled)


_DIV16 = [["tt.divisibility", 16]]


def _serving_signature(names: list[str], flags: dict[str, bool], sig: dict, constexprs: dict, attrs: dict) -> None:
    """The serving variant's options as a launch passes them: its constexprs, int32 cumulative
    lengths, page table and cache lengths and a float32 LSE (16-byte aligned allocations), or None
    where the option is off (a paged call's keys need no CU_K)."""
    for name in ("VARLEN", "WINDOW", "RETURN_LSE", "PAGED"):
        sig[name], constexprs[name] = "constexpr", bool(flags.get(name, False))
    on = {**constexprs, "VARLEN_K": constexprs["VARLEN"] and not constexprs["PAGED"]}
    pointers = (
        ("CU_Q", "VARLEN", "*i32"),
        ("CU_K", "VARLEN_K", "*i32"),
        ("LSE", "RETURN_LSE", "*fp32"),
        ("PAGE_TABLE", "PAGED", "*i32"),
        ("CACHE_SEQLENS", "PAGED", "*i32"),
    )
    for name, flag, ptr in pointers:
        if on[flag]:
            sig[name], attrs[(names.index(name),)] = ptr, _DIV16
        else:
            sig[name], constexprs[name] = "constexpr", None


def _scalar_signature(names: list[str], causal: bool, descales: bool) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) of the parameters both backends share: descales (16-byte
    aligned float32 pointers, or None), the softmax scale, CAUSAL, and every other as plain i32."""
    sig: dict[str, str] = {}
    constexprs: dict[str, object] = {"CAUSAL": bool(causal)}
    attrs: dict[tuple, list] = {}
    for i, n in enumerate(names):
        if n in ("QD", "KD", "VD"):
            if descales:
                sig[n] = "*fp32"
                attrs[(i,)] = _DIV16
            else:
                sig[n] = "constexpr"
                constexprs[n] = None
        elif n == "sm_scale_log2":
            sig[n] = "fp32"
        elif n == "TILE_TABLE":  # a q_order="balanced" kernel's schedule: a fresh int32 torch tensor
            sig[n] = "*i32"
            attrs[(i,)] = _DIV16
        elif n == "CAUSAL":
            sig[n] = "constexpr"
        else:
            sig[n] = "i32"
    return sig, constexprs, attrs


def artifacts(compiled) -> CompiledArtifacts:
    """What a Triton CompiledKernel holds for the CPU checks: its IR, PTX, cubin, SASS and resources."""
    cubin = compiled.asm["cubin"]
    sass, usage = _disassemble(cubin)
    return CompiledArtifacts(
        ttgir=compiled.asm["ttgir"],
        ptx=compiled.asm["ptx"],
        cubin=cubin,
        sass=sass,
        registers=usage["REG"],
        spill_bytes=usage["LOCAL"] + usage["STACK"],
        shared_bytes=int(compiled.metadata.shared),
    )


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
