"""The sm_90a compile a CPU runner makes of a config: compile errors, spills, serialised wgmmas and
shared memory above the Hopper limit all become the error text a GPU would have given.

The verdict is a function of the emitted source, `causal` and the toolchain, so it is kept
(build.memo_path "checks"): the precompile pool's check is the one the worker then reads, and a
config checked once is not compiled, run through ptxas again and disassembled in every later study
(Triton's own cache saves only the compile)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from zyfa_tune.generator import HOPPER, ConfigError, KernelConfig

from .task import exception_text


@dataclass(frozen=True)
class CompileCheck:
    error: str | None  # None: compiles, no spills, fits shared memory
    registers: int | None = None
    spill_bytes: int | None = None
    shared_bytes: int | None = None


def compile_check(config: KernelConfig, causal: bool) -> CompileCheck:
    """Compile for sm_90a on the CPU (kept per emitted source, see the module doc). Environment
    failures (a missing tool: OSError, ImportError) propagate."""
    from zyfa_tune.generator import emit
    from zyfa_tune.generator.build import memo_path, read_memo, write_memo

    try:
        path = memo_path("checks", f"{emit(config).source_hash}-{'causal' if causal else 'full'}")
    except Exception:  # emission failed: _compile_check words the error
        return _compile_check(config, causal)
    kept = read_memo(path)
    if _is_check(kept):
        return CompileCheck(**kept)
    check = _compile_check(config, causal)
    write_memo(path, asdict(check))
    return check


def _is_check(data: Any) -> bool:
    """Whether a kept memo has CompileCheck's fields and types (else it is redone)."""
    return (
        isinstance(data, dict)
        and set(data) == {f.name for f in fields(CompileCheck)}
        and (data["error"] is None or isinstance(data["error"], str))
        and all(data[k] is None or type(data[k]) is int for k in ("registers", "spill_bytes", "shared_bytes"))
    )


def _compile_check(config: KernelConfig, causal: bool) -> CompileCheck:
    from triton.runtime.errors import OutOfResources

    from zyfa_tune.generator import emit
    from zyfa_tune.generator.build import compile_for_target

    try:
        art = compile_for_target(emit(config), causal=causal)
    except (OSError, ImportError, MemoryError):
        raise
    except Exception as exc:
        return CompileCheck(exception_text(exc, with_traceback=not isinstance(exc, ConfigError)))
    if art.spill_bytes > 0:
        return CompileCheck(
            f"spills {art.spill_bytes} bytes (local memory per thread; {art.registers} registers)",
            art.registers,
            art.spill_bytes,
            art.shared_bytes,
        )
    if art.serialised_wgmma:
        return CompileCheck(
            f"ptxas serialises the wgmmas: {art.serialised_wgmma}", art.registers, art.spill_bytes, art.shared_bytes
        )
    limit = HOPPER.shared_memory_bytes
    if art.shared_bytes > limit:
        return CompileCheck(
            str(OutOfResources(art.shared_bytes, limit, "shared memory")),
            art.registers,
            art.spill_bytes,
            art.shared_bytes,
        )
    return CompileCheck(None, art.registers, art.spill_bytes, art.shared_bytes)
