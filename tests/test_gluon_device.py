"""The Gluon device modules (generator/gluon_sm90/device.py lists them) and the emitted kernel they make:
each module's body goes into the source verbatim and in order; every top-level name they define is
used; every name they read is defined in the emitted module; the config constants the emitter writes
are exactly the ones the kernel (or the host launcher) reads."""

from __future__ import annotations

import ast
import builtins
import importlib
import symtable

import pytest
from gluon_cases import GLUON, neighbours

from zyfa_tune.generator import emit
from zyfa_tune.generator.gluon_sm90 import device
from zyfa_tune.search_spaces.seeds import gluon_lean_f16_config, gluon_smem2_chunked_config

#: a few configs whose entry kernels differ (consumers, V layout, key parts, P tiles, f16 scores)
CONFIGS = [
    GLUON,
    *neighbours()[1:6],
    gluon_lean_f16_config("fp8", 128, 128),
    gluon_smem2_chunked_config("fp8", 192, 128),
]
#: module constants the host side reads (kernels/launch.py), not the kernel
HOST_CONSTANTS = {"NUM_WARPS", "PERSISTENT", "KERNEL_NAME"}


def top_level_names(source: str) -> set[str]:
    """Names a module binds at top level (definitions, assignments, imports)."""
    out: set[str] = set()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Assign):
            out |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return out


def globals_read(source: str) -> set[str]:
    """Names the functions of `source` read as globals (not their parameters or locals)."""
    out: set[str] = set()
    stack = [symtable.symtable(source, "<emitted>", "exec")]
    while stack:
        table = stack.pop()
        stack.extend(table.get_children())
        if table.get_type() == "function":
            out |= {s.get_name() for s in table.get_symbols() if s.is_global() and s.is_referenced()}
    return out


def names_loaded(source: str) -> set[str]:
    return {n.id for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def test_bodies_go_into_the_source_in_order():
    """The device code of every kernel is the modules' bodies, in MODULES order, each verbatim."""
    src = emit(GLUON).source
    at = [src.index(device.module_body(name)) for name in device.MODULES]
    assert at == sorted(at)
    assert device.source() in src
    assert device.source() == "\n\n".join(device.module_body(name) for name in device.MODULES)
    with pytest.raises(ValueError, match="name"):
        device.module_body("emit")


@pytest.mark.parametrize("name", device.MODULES)
def test_module_is_a_real_module(name):
    """Each module has a docstring and exactly one marker, and imports: the names it takes from its
    siblings (above its marker) exist there."""
    module = importlib.import_module(f"zyfa_tune.generator.gluon_sm90.{name}")
    assert module.__doc__ and module.__doc__.strip()
    assert module.__file__ and open(module.__file__).read().count(device.MARKER) == 1


def test_every_top_level_name_is_used():
    """No dead code: each function or constant the device modules define is read somewhere in the
    emitted module (the partitions by the entry kernel)."""
    defined = {name: m for m in device.MODULES for name in top_level_names(device.module_body(m))}
    loaded = set().union(*(names_loaded(emit(c).source) for c in CONFIGS))
    unused = {name: m for name, m in defined.items() if name not in loaded}
    assert not unused, f"defined in the device modules but never used: {unused}"


@pytest.mark.parametrize("config", CONFIGS)
def test_every_name_read_is_defined(config):
    """Every global the kernel's functions read is bound in the emitted module (device code, the
    config's constants or the entry kernel) or a builtin: no constant the emitter forgot."""
    src = emit(config).source
    missing = globals_read(src) - top_level_names(src) - set(dir(builtins))
    assert not missing, f"read by the device code, defined nowhere: {sorted(missing)}"


def schedule_constants(source: str) -> set[str]:
    """The names of the constants the emitter writes into `source` (between its marker and the entry)."""
    schedule = source[source.index("# ---- this kernel's schedule") :]
    return top_level_names(schedule[: schedule.index("@gluon.jit")])


def test_constants_emitted_are_read():
    """The emitter writes the same constants for every config, and only constants something reads:
    each is read by some kernel (CONSUMER_REGS only with two or three consumers), or is one of the
    host's."""
    sources = [emit(c).source for c in CONFIGS]
    written = schedule_constants(sources[0])
    assert all(schedule_constants(s) == written for s in sources)
    unread = written - set().union(*map(names_loaded, sources)) - HOST_CONSTANTS
    assert not unread, f"constants no code reads: {sorted(unread)}"
    assert HOST_CONSTANTS <= written
