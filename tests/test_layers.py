"""The package's layers hold: every import of an sfttool module, function-local ones included, reaches
its own layer or a lower one, and no sfttool modules import each other in a cycle.

    cli -> engine -> tools (and assets) -> model (and config) -> dataset -> parallel
        -> utils (and compat) -> registry -> errors
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "sfttool"

# Top to bottom; a module may import its own layer or one below it.
LAYERS = (("cli",), ("engine",), ("tools", "assets"), ("model", "config"), ("dataset",), ("parallel",),
          ("utils", "compat"), ("registry",), ("errors",))
RANK = {part: len(LAYERS) - i for i, parts in enumerate(LAYERS) for part in parts}
RANK["sfttool"] = RANK["compat"]  # the package root only runs compat's process-wide set-up

# Cycles tolerated for now; none.
ALLOWED_CYCLES: list[set[str]] = []


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer(module: str) -> int:
    parts = module.split(".")
    return RANK[parts[1] if len(parts) > 1 else parts[0]]


def _resolve(name: str) -> str | None:
    """The sfttool module ``name`` is, or lies in (``sfttool.x.f`` -> ``sfttool.x``)."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in MODULES:
            return ".".join(parts)
        parts.pop()
    return None


def imports(module: str) -> list[tuple[str, int]]:
    """``(imported sfttool module, line)`` for every import in ``module``, at any depth."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import sub` imports the submodule; `from pkg import name` the package
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for name in names:
            target = _resolve(name) if name.split(".")[0] == "sfttool" else None
            if target is not None and target != module:
                found.append((target, node.lineno))
    return found


GRAPH = {module: sorted({target for target, _ in imports(module)}) for module in MODULES}


def cycles(graph: dict[str, list[str]]) -> list[set[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in graph[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = set()
            while True:
                member = stack.pop()
                component.add(member)
                if member == module:
                    break
            if len(component) > 1:
                found.append(component)

    for module in graph:
        if module not in index:
            visit(module)
    return found


def test_the_scan_sees_the_package():
    assert len(MODULES) > 100 and "sfttool.engine.train" in MODULES
    assert "sfttool.engine.spec" in GRAPH["sfttool.engine.train"]
    assert {module.split(".")[1] for module in MODULES if "." in module} <= set(RANK)


def test_every_import_reaches_its_own_layer_or_a_lower_one():
    upward = [f"{MODULES[module].relative_to(PACKAGE.parent)}:{line} imports {target}"
              for module in MODULES for target, line in imports(module) if layer(target) > layer(module)]
    assert upward == []


def test_no_modules_import_each_other_in_a_cycle():
    assert [sorted(c) for c in cycles(GRAPH) if c not in ALLOWED_CYCLES] == []


@pytest.mark.parametrize("graph, expected", [
    ({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}, [{"a", "b", "c"}]),
    ({"a": ["b"], "b": [], "c": ["b"]}, []),
])
def test_the_cycle_finder(graph, expected):
    assert cycles(graph) == expected


def test_the_layer_check_catches_a_function_local_upward_import(tmp_path, monkeypatch):
    """An import inside a function counts like one at the top of the module, a relative one too."""
    fake = tmp_path / "fake.py"
    fake.write_text("def f():\n    from sfttool.engine import train\n    from ..model import sft\n")
    monkeypatch.setitem(MODULES, "sfttool.parallel.fake", fake)
    assert imports("sfttool.parallel.fake") == [("sfttool.engine.train", 2), ("sfttool.model.sft", 3)]
    assert [layer(t) > layer("sfttool.parallel.fake") for t, _ in imports("sfttool.parallel.fake")] == [True, True]
