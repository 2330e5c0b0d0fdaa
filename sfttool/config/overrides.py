"""``--cfg-options KEY=VALUE``: parse them, and refuse the ones that would change nothing.

A pure-Python config is executed once: ``optim_wrapper = dict(optimizer=dict(lr=lr))``
copies the value of ``lr`` into ``optim_wrapper``. Overriding ``lr`` afterwards
changes the variable, not the copy the runner builds from, so training would
silently use the old value. The same holds for a whole dict that is copied
into another (``train_dataloader = dict(dataset=train_dataset)``: overriding
``train_dataset.max_length`` reaches nothing). This module reads the config's
source (and its ``read_base`` parts) to know which key was copied where, and
names the keys to override instead.
"""
from __future__ import annotations

import ast
import difflib
import logging
from pathlib import Path
from typing import Iterable
from sfttool.errors import SfttoolError

# Top-level keys that the runner, the train entry or the tools read themselves: an override may add them.
READ_KEYS = frozenset({
    "model", "tokenizer", "train_dataloader", "train_dataset", "optim_wrapper", "param_scheduler", "train_cfg",
    "default_hooks", "custom_hooks", "env_cfg", "log_level", "load_from", "resume", "randomness", "seed",
    "log_processor", "visualizer", "work_dir", "launcher", "model_wrapper_cfg", "find_unused_parameters",
    "experiment_name"})

# Copied into the dicts training builds, but also read directly by a tool (convert saves `tokenizer`
# beside the weights): an override is allowed, with a warning naming the copies training uses.
READ_BY_TOOLS = frozenset({"tokenizer"})


class OverrideError(SfttoolError, ValueError):
    """An override that cannot be parsed or would have no effect."""


def parse_cfg_options(options: Iterable[str]) -> dict:
    """``['a.b=1', 'c=[1,2]']`` -> ``{'a.b': 1, 'c': [1, 2]}`` (values parsed as Python literals)."""
    from mmengine.config import DictAction

    result: dict = {}
    for item in options:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part.strip() for part in key.split(".")):
            raise OverrideError(f"--cfg-options {item!r}: expected KEY=VALUE (e.g. train_cfg.max_epochs=1)")
        try:
            result[key] = DictAction._parse_iterable(value)
        except AssertionError as exc:  # mmengine asserts on unbalanced brackets and quotes
            raise OverrideError(f"--cfg-options {item!r}: cannot parse the value ({exc}); quote lists and "
                                "strings for the shell, e.g. 'a=[1,2]'") from None
    return result


def check_overrides(cfg, overrides: dict, path: Path) -> None:
    """Refuse an override of a key the config copied elsewhere, or of a top-level name it does not have."""
    copies = copied_keys(path)
    for key in overrides:
        root, _, rest = key.partition(".")
        if root not in cfg and root not in READ_KEYS:
            close = difflib.get_close_matches(root, [str(k) for k in cfg.keys()], n=3, cutoff=0.6)
            hint = f" (did you mean {' or '.join(close)}?)" if close else ""
            raise OverrideError(f"{path}: --cfg-options {key}: the config has no setting `{root}`{hint}; "
                                "a new name would be read by nothing")
        targets = [f"{target}.{rest}" if rest else target for target in copies.get(root, [])]
        shown = ", ".join(targets[:6]) + (f" and {len(targets) - 6} more" if len(targets) > 6 else "")
        if targets and root in READ_BY_TOOLS:
            from mmengine.logging import print_log
            print_log(f"--cfg-options {key}: the tools (convert) read `{root}` itself, but training uses the "
                      f"copies the config made of it; to change training, override {shown}",
                      logger="current", level=logging.WARNING)
        elif targets:
            raise OverrideError(
                f"{path}: --cfg-options {key}: the config copied `{root}` into the dicts it builds, so changing "
                f"it alone has no effect; override where it was copied instead: {shown}")


def copied_keys(path: Path) -> dict[str, list[str]]:
    """For each top-level name of a config, the keys its value was copied into, following copies of
    copies, ending at keys nothing copies further.

    >>> # lr = 1; opt = dict(lr=lr); runner = dict(optim=opt)
    >>> # -> {'lr': ['runner.optim.lr'], 'opt': ['runner.optim']}
    """
    direct: dict[str, set[str]] = {}
    for file in _config_files(path):
        try:
            tree = ast.parse(file.read_text(encoding="utf-8"))
        except (OSError, SyntaxError):
            continue
        for stmt in tree.body:
            if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
                target = stmt.targets[0].id
                for uses in direct.values():  # the old value of `target` is gone, and its copies with it
                    uses -= {u for u in uses if u == target or u.startswith(target + ".")}
                for name, dotted in _references(stmt.value, target):
                    if name != target:  # `hooks = dict(**hooks, ...)` extends the old value
                        direct.setdefault(name, set()).add(dotted)
    return {name: sorted(_final(name, direct, set())) for name in direct}


def _final(name: str, direct: dict[str, set[str]], seen: set[str]) -> set[str]:
    out = set()
    for dotted in direct.get(name, ()):
        root, _, rest = dotted.partition(".")
        if root in direct and root not in seen:  # copied again: follow it
            out |= {f"{d}.{rest}" if rest else d for d in _final(root, direct, seen | {name})}
        else:
            out.add(dotted)
    return out


def _references(node: ast.AST, dotted: str) -> Iterable[tuple[str, str]]:
    """``(name, key)`` for each name the value at ``dotted`` was computed from."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict":
        for kw in node.keywords:
            if kw.arg is None:  # **other: merged into this dict
                yield from ((n, dotted) for n in _names(kw.value))
            elif kw.arg != "type":
                yield from _references(kw.value, f"{dotted}.{kw.arg}")
    elif isinstance(node, ast.Dict):
        for key, value in zip(node.keys, node.values):
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                yield from _references(value, f"{dotted}.{key.value}")
            else:
                yield from ((n, dotted) for n in _names(value))
    elif isinstance(node, (ast.List, ast.Tuple)):
        for i, element in enumerate(node.elts):
            yield from _references(element, f"{dotted}.{i}")
    else:
        yield from ((n, dotted) for n in _names(node))


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def _config_files(path: Path) -> list[Path]:
    """The config and, first, the files its ``read_base()`` block imports (recursively)."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError):
        return []
    files = []
    for stmt in tree.body:
        if isinstance(stmt, ast.With) and any(isinstance(i.context_expr, ast.Call) and
                                              getattr(i.context_expr.func, "id", None) == "read_base"
                                              for i in stmt.items):
            for imp in (s for s in stmt.body if isinstance(s, ast.ImportFrom)):
                base = _base_path(path, imp)
                if base is not None and base.is_file():
                    files += _config_files(base)
    return files + [path]


def _base_path(path: Path, imp: ast.ImportFrom) -> Path | None:
    parts = (imp.module or "").split(".")
    if imp.level:
        folder = path.parent
        for _ in range(imp.level - 1):
            folder = folder.parent
        return folder.joinpath(*parts).with_suffix(".py")
    if parts[:2] == ["sfttool", "configs"]:
        from sfttool.config.loader import builtin_config_dir
        return builtin_config_dir().joinpath(*parts[2:]).with_suffix(".py")
    return None
