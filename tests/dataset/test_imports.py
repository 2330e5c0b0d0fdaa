"""The data pipeline's modules import one another in one direction (no cycle, lazy imports included)."""
from __future__ import annotations

import ast
from pathlib import Path

import sfttool

PACKAGE = Path(sfttool.__file__).parent


def module_name(path: Path) -> str:
    parts = ("sfttool",) + path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1]) if parts[-1] == "__init__" else ".".join(parts)


def imported(path: Path, name: str) -> set[str]:
    """Every ``sfttool.dataset`` module ``path`` imports, at the top or inside a function."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            found |= {base} | {f"{base}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return found


def test_no_import_cycle_between_the_pipeline_modules():
    paths = {module_name(p): p for p in (PACKAGE / "dataset").rglob("*.py")}
    # The packages' __init__ files re-export their modules; a cycle through them is the package's own.
    modules = {name for name, path in paths.items() if path.name != "__init__.py"}
    graph = {name: imported(paths[name], name) & modules - {name} for name in modules}
    assert "sfttool.dataset.pipeline" not in graph["sfttool.dataset.cache"]
    state: dict[str, str] = {}

    def visit(name: str, trail: list[str]) -> None:
        state[name] = "open"
        for dep in sorted(graph[name]):
            assert state.get(dep) != "open", " -> ".join(trail + [name, dep])
            if dep not in state:
                visit(dep, trail + [name])
        state[name] = "done"

    for name in sorted(modules):
        if name not in state:
            visit(name, [])
