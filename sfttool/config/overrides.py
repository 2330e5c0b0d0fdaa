"""``--cfg-options KEY=VALUE``: a setting's name re-runs the config, a dotted key edits the result.

A pure-Python config is a program: ``optim_wrapper = dict(optimizer=dict(lr=lr))`` copies the
value of ``lr``. So ``lr=1e-4`` replaces the value of the assignment ``lr = ...`` that decides
the final value (the config's own, else the last ``read_base`` part defining it, as in Python)
before mmengine executes the files, and everything computed from ``lr`` follows.

A dotted key (``model.lora.r=8``) keeps mmengine's meaning: it edits the executed config. That
still cannot reach a copy, so a dotted key into a dict the config only copies into others
(``train_dataset.max_length``: training reads ``train_dataloader.dataset``) is refused with the
keys to use instead.
"""
from __future__ import annotations

import ast
import difflib
import logging
from pathlib import Path
from typing import Any, Iterable, Iterator

from sfttool.config.settings import SETTINGS
from sfttool.errors import SfttoolError

# Top-level keys that mmengine's runner or the tools read themselves.
RUNNER_KEYS = frozenset({
    "model", "tokenizer", "train_dataloader", "optim_wrapper", "param_scheduler", "train_cfg",
    "default_hooks", "custom_hooks", "env_cfg", "log_level", "load_from", "resume", "randomness",
    "log_processor", "visualizer", "launcher", "model_wrapper_cfg", "find_unused_parameters",
    "val_dataloader", "val_cfg", "val_evaluator"})
# ... and with the PART 1 settings sfttool reads (config.settings): an override may always set them.
READ_KEYS = RUNNER_KEYS | frozenset(SETTINGS)

# Copied into the dicts training builds, but also read directly by a tool (convert saves `tokenizer`
# beside the weights): a dotted override is allowed, with a warning naming the copies training uses.
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


# ---------------------------------------------------------------------------
# Names: found in the source, substituted before execution.

def parameters(path: Path, options: dict) -> dict[str, tuple[tuple[Path, int], ast.expr]]:
    """``{name: ((file, line), value)}``: the assignment each undotted option replaces, and with what.

    Raises when a replaced name is read by nothing afterwards (a config dumped by a run holds
    values, not names), so the override would change nothing but itself.
    """
    chain = _chain(Path(path).resolve())
    found = {}
    for name, value in options.items():
        if "." in name or name in ("type", "_base_"):
            continue
        where = _winner(Path(path).resolve(), name)
        if where is None:
            continue
        if name not in READ_KEYS and not _read_after(chain, where, name):
            raise OverrideError(
                f"{path}: --cfg-options {name}: the config sets `{name}` ({where[0].name}:{where[1]}) but "
                "nothing in it reads the name afterwards, so the override would change nothing else (a config "
                "dumped by a run holds values, not names); override the dotted keys that hold the value")
        node = _literal(value)
        if node is None and name in READ_KEYS:
            continue  # an object from Python code, for a key the runner reads itself: set after loading
        if node is None:
            raise OverrideError(f"--cfg-options {name}: {value!r} is not a Python literal")
        found[name] = (where, node)
    return found


def _literal(value: Any) -> ast.expr | None:
    """``value`` as source the config can execute, or None when it is no literal."""
    try:
        node = ast.parse(repr(value), mode="eval").body
        ast.literal_eval(node)
    except (SyntaxError, ValueError):
        return None
    return node


def _parse(file: Path) -> ast.Module:
    return ast.parse(file.read_text(encoding="utf-8"), filename=str(file))


def _assigns(stmt: ast.stmt, name: str) -> bool:
    if isinstance(stmt, ast.Assign):
        return any(isinstance(t, ast.Name) and t.id == name for t in stmt.targets)
    return isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id == name \
        and stmt.value is not None


def _base_imports(file: Path, tree: ast.Module) -> Iterator[tuple[ast.stmt, Path, dict[str, str]]]:
    """``(with_stmt, base_file, {name here: name there})`` per import of a ``read_base()`` block,
    resolved the way mmengine resolves it; ``'*'`` maps to itself for a star import."""
    for stmt in tree.body:
        if not (isinstance(stmt, ast.With) and any(
                isinstance(i.context_expr, ast.Call) and getattr(i.context_expr.func, "id", None) == "read_base"
                for i in stmt.items)):
            continue
        for imp in stmt.body:
            if isinstance(imp, ast.ImportFrom) and imp.module:
                base = _base_file(file, imp)
                if base is not None and base.is_file():
                    yield stmt, base, {a.asname or a.name: a.name for a in imp.names}


def _base_file(file: Path, imp: ast.ImportFrom) -> Path | None:
    parts = imp.module.split(".")
    if imp.level:
        return file.parent.joinpath(*[".."] * (imp.level - 1), *parts).with_suffix(".py").resolve()
    if len(parts) < 2:
        return None
    from mmengine.config import config as mm_config  # its lookup, with sfttool.compat's fix applied
    try:
        return Path(mm_config.get_installed_path(parts[0]), *parts[1:]).with_suffix(".py").resolve()
    except Exception:  # not installed: mmengine reports it when it loads the config
        return None


def _winner(file: Path, name: str, depth: int = 0) -> tuple[Path, int] | None:
    """The ``(file, line)`` of the assignment that gives ``name`` its final value in ``file``."""
    if depth > 20:  # a base importing itself: mmengine reports the loop
        return None
    tree, last = _parse(file), None
    imports = {id(stmt): [] for stmt in tree.body}
    for stmt, base, names in _base_imports(file, tree):
        imports[id(stmt)].append((base, names))
    for stmt in tree.body:
        if _assigns(stmt, name):
            last = (file, stmt.lineno)
        for base, names in imports.get(id(stmt), ()):
            source = names.get(name, name if "*" in names else None)
            found = _winner(base, source, depth + 1) if source else None
            last = found or last
    return last


def _chain(file: Path, depth: int = 0) -> list[tuple[Path, ast.Module]]:
    """The config and its ``read_base`` parts, parts first (the order mmengine executes them)."""
    tree = _parse(file)
    parts = [] if depth > 20 else [p for _, base, _ in _base_imports(file, tree) for p in _chain(base, depth + 1)]
    return parts + [(file, tree)]


def _read_after(chain: list[tuple[Path, ast.Module]], where: tuple[Path, int], name: str) -> bool:
    """Whether ``name`` is read after the assignment at ``where`` (in that file, or in another)."""
    for file, tree in chain:
        statements = [s for s in tree.body if file != where[0] or s.lineno > where[1]]
        if any(isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load)
               for s in statements for n in ast.walk(s)):
            return True
    return False


def has_base_key(path: Path) -> bool:
    """An old-style config (``_base_ = [...]``): mmengine merges its files; names are not re-run."""
    return any(_assigns(stmt, "_base_") for stmt in _parse(Path(path)).body)


# ---------------------------------------------------------------------------
# Dotted keys and new names: checked against the executed config.

def check_overrides(cfg: Any, options: dict, path: Path) -> None:
    """Refuse a new name nothing reads, or a dotted key into a dict training only reads copies of."""
    for key in options:
        root, _, rest = key.partition(".")
        if root not in cfg and root not in READ_KEYS:
            close = difflib.get_close_matches(root, [str(k) for k in cfg.keys()], n=3, cutoff=0.6)
            hint = f" (did you mean {' or '.join(close)}?)" if close else ""
            raise OverrideError(f"{path}: --cfg-options {key}: the config has no setting `{root}`{hint}; "
                                "a new name would be read by nothing")
        if not rest or root not in cfg or (root in READ_KEYS and root not in READ_BY_TOOLS):
            continue
        targets = copied_to(cfg, root)
        # Name the copies training reads, not those inside other building blocks (train_dataset).
        targets = [t for t in targets if t.partition(".")[0] in READ_KEYS] or targets
        copies = [f"{target}.{rest}" for target in targets]
        shown = ", ".join(copies[:6]) + (f" and {len(copies) - 6} more" if len(copies) > 6 else "")
        if copies and root in READ_BY_TOOLS:
            from mmengine.logging import print_log
            print_log(f"--cfg-options {key}: the tools (convert) read `{root}` itself, but training uses the "
                      f"copies the config made of it; to change training, override {shown}",
                      logger="current", level=logging.WARNING)
        elif copies:
            raise OverrideError(
                f"{path}: --cfg-options {key}: the config copied `{root}` into the dicts it builds, so changing "
                f"it alone has no effect; override where it was copied instead: {shown}")


def copied_to(cfg: Any, root: str) -> list[str]:
    """Keys (other than ``root``) holding ``cfg[root]``, or, for a dict, a dict made from all of it
    (``dict(**base_hooks, checkpoint=...)``).

    >>> copied_to({'opt': {'lr': 1, 'b': 2}, 'wrap': {'optimizer': {'lr': 1, 'b': 2}}}, 'opt')
    ['wrap.optimizer']
    """
    value = cfg[root]
    if not isinstance(value, (dict, list, tuple)) or len(value) < 2:
        return []  # a scalar or a one-item container equals too many unrelated values to tell
    found: list[str] = []

    def walk(node: Any, key: str) -> None:
        if key != root and (node == value or isinstance(node, dict) and isinstance(value, dict)
                            and _contains(node, value)):
            found.append(key)
        elif isinstance(node, dict):
            for k in node.keys():
                walk(dict.__getitem__(node, k), f"{key}.{k}" if key else str(k))
        elif isinstance(node, (list, tuple)):
            for i, item in enumerate(node):
                walk(item, f"{key}.{i}")

    walk(getattr(cfg, "_cfg_dict", cfg), "")
    return sorted(found)


def _contains(node: dict, part: dict) -> bool:
    return all(k in node and dict.__getitem__(node, k) == v for k, v in dict.items(part))

