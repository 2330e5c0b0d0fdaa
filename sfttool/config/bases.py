"""The base files a config pulls in with ``with read_base(): from .x import *``.

``copy-cfg`` copies them next to a copy, and the loader uses them to say which
file holds a syntax error (mmengine parses bases without a file name, so its
``SyntaxError`` reads ``<unknown>:1``).
"""
from __future__ import annotations

import ast
from pathlib import Path


def _relative_imports(path: Path, tree: ast.AST) -> list[Path]:
    """``from ._base_.peft import *`` in ``dir/cfg.py`` -> ``[dir/_base_/peft.py]``."""
    targets = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level > 0 and node.module:
            # Level 1 is the config's own folder, each further dot one folder up.
            folder = path.parent.joinpath(*[".."] * (node.level - 1))
            targets.append(folder.joinpath(*node.module.split(".")).with_suffix(".py").resolve())
    return targets


def relative_bases(config: Path) -> list[Path]:
    """Base files ``config`` imports relatively, recursively, relative to its folder.

    ``qwen2_5_7b_instruct_qlora_alpaca_e3.py`` -> ``[Path('_base_/peft.py'), Path('_base_/runtime.py')]``
    """
    config = Path(config).resolve()
    found: list[Path] = []
    todo = [config]
    while todo:
        current = todo.pop(0)
        tree = ast.parse(current.read_text(encoding="utf-8"), filename=str(current))
        for target in _relative_imports(current, tree):
            rel = Path(*target.parts[len(config.parent.parts):]) if target.is_relative_to(config.parent) \
                else target
            if rel not in found and target.is_file():
                found.append(rel)
                todo.append(target)
    return found


def find_syntax_error(config: Path) -> SyntaxError | None:
    """The first syntax error in ``config`` or a base it imports, with its real file name."""
    todo, seen = [Path(config).resolve()], set()
    while todo:
        current = todo.pop(0)
        if current in seen or not current.is_file():
            continue
        seen.add(current)
        try:
            tree = ast.parse(current.read_text(encoding="utf-8"), filename=str(current))
        except SyntaxError as exc:
            return exc
        todo += _relative_imports(current, tree)
    return None
