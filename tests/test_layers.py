"""The pipeline's layers, read from the source: each stage imports only the stages below it, and no
module takes part in an import cycle (lazy imports inside functions count too: they are a dependency
all the same, only a later one).

Lowest first: generator (configs -> kernel source) < search_spaces, db < kernels (what runs at call
time) < the public API < tuning, integrations (adapters for other libraries) < bench < cli; the package root (`zyfa_tune/__init__.py`) is the
public facade and nothing inside the package imports it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "zyfa_tune"

#: layer of each top-level part of the package (a higher layer may import a lower one, never back)
LAYERS = {
    "generator": 0,
    "search_spaces": 1,
    "db": 1,
    "kernels": 2,
    "api": 3,
    "quantize": 3,
    "varlen": 4,
    "attention": 5,  # (the packed call reuses varlen's checks)
    "kvcache": 5,  # (reuses varlen's checks)
    "tuning": 6,
    "integrations": 6,
    "bench": 7,
    "cli": 8,
}


def _package_dirs() -> dict[str, Path]:
    """Package name -> folder, from pyproject's package-dir mapping (the folders the wheel ships)."""
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {name: ROOT / meta["package-dir"].get(name, name.replace(".", "/")) for name in meta["packages"]}


def _modules() -> dict[str, Path]:
    """Every module of the package, by dotted name."""
    out = {}
    for pkg, folder in _package_dirs().items():
        for path in folder.glob("*.py"):
            out[pkg if path.stem == "__init__" else f"{pkg}.{path.stem}"] = path
    return out


def _imports(name: str, path: Path, modules: set[str]) -> set[str]:
    """The package's modules that `name` imports anywhere in its source (`from a import b` names a.b
    where that is a module, else a)."""
    is_pkg = path.stem == "__init__"
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = name.split(".")[: len(name.split(".")) - node.level + is_pkg]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        out.update(t for t in targets if t == PACKAGE or t.startswith(PACKAGE + "."))
    return {t for t in out if t in modules} - {name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, set(modules)) for name, path in modules.items()}


def _part(module: str) -> str:
    return module.split(".")[1] if module != PACKAGE else ""


def test_every_part_of_the_package_has_a_layer():
    parts = {_part(m) for m in _modules()} - {""}
    assert parts <= set(LAYERS), f"modules outside any layer: {sorted(parts - set(LAYERS))}"
    assert {"generator", "kernels", "db", "search_spaces", "tuning", "bench", "cli", "api"} <= parts


def test_no_stage_imports_a_stage_above_it_or_the_facade():
    bad = []
    for module, targets in _graph().items():
        if module == PACKAGE:
            continue
        for target in targets:
            if target == PACKAGE:
                bad.append(f"{module} imports the package facade (import the defining module instead)")
            elif _part(target) != _part(module) and LAYERS[_part(target)] >= LAYERS[_part(module)]:
                bad.append(f"{module} ({_part(module)}) imports {target} ({_part(target)})")
    assert not bad, "\n".join(sorted(bad))


def test_no_import_cycles():
    graph = _graph()
    index, low, on_stack, stack, cycles = {}, {}, set(), [], []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_the_layer_check_sees_a_violation(tmp_path):
    """The checks above read real imports: a lazy upward import and a cycle are both found."""
    mods = {"zyfa_tune.generator.a", "zyfa_tune.generator.b", "zyfa_tune.kernels.launch"}
    src = tmp_path / "a.py"
    src.write_text("def f():\n    from zyfa_tune.kernels import launch\n    from . import b\n")
    assert _imports("zyfa_tune.generator.a", src, mods) == {"zyfa_tune.kernels.launch", "zyfa_tune.generator.b"}
