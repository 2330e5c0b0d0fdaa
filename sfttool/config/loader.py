"""Find built-in configs and load any config with mmengine's ``Config``."""
from __future__ import annotations

import ast
import difflib
import importlib.resources
import os
from pathlib import Path
from typing import Any, Iterable

from sfttool import compat
from sfttool.config import overrides
from sfttool.config.bases import find_syntax_error
from sfttool.errors import SfttoolError


class ConfigError(SfttoolError):
    """A config cannot be found, parsed or used; the message names the file."""


def builtin_config_dir() -> Path:
    """The folder of built-in configs (``configs/`` in the repository)."""
    return Path(str(importlib.resources.files("sfttool.configs")))


def deepspeed_preset_dir() -> Path:
    return builtin_config_dir() / "deepspeed"


def list_configs(pattern: str | None = None) -> list[str]:
    """Names of built-in configs whose name contains ``pattern`` (any case)."""
    names = sorted(p.stem for p in builtin_config_dir().glob("*.py") if not p.stem.startswith("_"))
    if pattern:
        names = [n for n in names if pattern.lower() in n.lower()]
    return names


# The docstring line of a built-in config that `sfttool list-cfg` prints beside its name:
#     At a glance: QLoRA SFT | 7.6B | Alpaca, 52k instructions (hub) | one 16 GB GPU
AT_A_GLANCE = "At a glance:"
GLANCE_FIELDS = ("method", "model", "data", "memory (estimate)")


def config_at_a_glance(path: Path) -> list[str] | None:
    """The fields of the ``At a glance:`` line of a config's docstring (method, model size, data,
    memory estimate), read without executing the config; None when it has no such line of 4 fields.

        At a glance: LoRA SFT | 135M | 82 bundled conversations | CPU, ~2 GB RAM
        -> ['LoRA SFT', '135M', '82 bundled conversations', 'CPU, ~2 GB RAM']
    """
    try:
        docstring = ast.get_docstring(ast.parse(Path(path).read_text(encoding="utf-8"))) or ""
    except (OSError, SyntaxError, ValueError):
        return None
    for line in docstring.splitlines():
        if line.startswith(AT_A_GLANCE):
            fields = [field.strip() for field in line[len(AT_A_GLANCE):].split("|")]
            return fields if len(fields) == len(GLANCE_FIELDS) and all(fields) else None
    return None


def list_deepspeed_presets(pattern: str | None = None) -> list[str]:
    names = sorted(p.stem for p in deepspeed_preset_dir().glob("*.json"))
    if pattern:
        names = [n for n in names if pattern.lower() in n.lower()]
    return names


def _close_matches(name: str, choices: Iterable[str]) -> list[str]:
    choices = list(choices)
    close = difflib.get_close_matches(name, choices, n=5, cutoff=0.5)
    close += [c for c in choices if name.lower() in c.lower() and c not in close]
    return close[:5]


def find_config(name_or_path: str | Path) -> Path:
    """Resolve a config path, or the name of a built-in config, to a file."""
    path = Path(name_or_path)
    if path.suffix == ".py" and path.is_file():
        return path.resolve()
    if path.is_file():
        raise ConfigError(f"{path}: a config must be a Python file ending in .py")
    if "/" in str(name_or_path) or os.sep in str(name_or_path):  # a folder was named (`./` too):
        raise ConfigError(f"{name_or_path}: no such config file")  # never run a built-in of that name instead
    builtin = builtin_config_dir() / f"{path.stem if path.suffix == '.py' else name_or_path}.py"
    if builtin.is_file() and not builtin.stem.startswith("_"):
        return builtin
    close = _close_matches(str(name_or_path), list_configs())
    hint = ("\nClose matches: " + ", ".join(close)) if close else ""
    raise ConfigError(
        f"{name_or_path}: no such config file and no built-in config of that name "
        f"(see `sfttool list-cfg`).{hint}")


def parse_cfg_options(options: Iterable[str]) -> dict:
    """``['a.b=1', 'c=[1,2]']`` -> ``{'a.b': 1, 'c': [1, 2]}`` (values parsed as Python literals)."""
    try:
        return overrides.parse_cfg_options(options)
    except overrides.OverrideError as exc:
        raise ConfigError(str(exc)) from None


def load_config(name_or_path: str | Path, cfg_options: dict | Iterable[str] | None = None):
    """Load a config file (or built-in name) and apply ``key=value`` overrides.

    A top-level name (``lr=1e-4``) re-runs the config with its assignment replaced, so every value
    computed from it follows; a dotted key (``model.lora.r=8``) edits the loaded config, as in
    mmengine. Errors while executing the config (syntax errors, failing imports, missing names)
    are re-raised as ``ConfigError`` naming the file and line.
    """
    compat.apply_all()
    path = find_config(name_or_path)
    options = cfg_options if isinstance(cfg_options, dict) else parse_cfg_options(cfg_options or [])
    try:
        # An old-style config (`_base_ = [...]`) keeps mmengine's meaning: every key edits the result.
        names = {} if overrides.has_base_key(path) else overrides.parameters(path, options)
        cfg = _read(path, {where: value for where, value in names.values()})
        rest = {key: value for key, value in options.items() if key not in names}
        overrides.check_overrides(cfg, rest, path)
    except overrides.OverrideError as exc:
        raise ConfigError(str(exc)) from None
    except SyntaxError as exc:
        # mmengine parses without a file name ('<unknown>'): find the real file.
        exc = find_syntax_error(path) or exc
        where = f"{exc.filename if exc.filename and exc.filename[0] != '<' else path}:{exc.lineno}"
        raise ConfigError(f"{where}: syntax error in config: {exc.msg}") from None
    if rest:
        try:
            cfg.merge_from_dict(rest)
        except Exception as exc:  # mmengine raises several types for bad keys
            raise ConfigError(f"{path}: --cfg-options could not be applied: {exc}") from None
    resolve_lazy_imports(cfg, path)
    return cfg


def _read(path: Path, values: dict):
    """Execute the config, with ``values`` replacing the assignments at ``(file, line)``."""
    from mmengine.config import Config
    from mmengine.config.utils import ConfigParsingError

    try:
        with compat.substituted_assignments(values):
            # A plain file is loaded the pure-Python way when a name in it is overridden.
            return Config.fromfile(str(path), lazy_import=True if values else None)
    except (ImportError, NameError, AttributeError, KeyError, TypeError, ValueError,
            ConfigParsingError) as exc:
        raise ConfigError(f"{path}: the config failed to load: {type(exc).__name__}: {exc}") from None


def resolve_lazy_imports(cfg, path: Path) -> None:
    """mmengine imports a pure-Python config's ``from x import y`` lazily, so a
    misspelt name would only fail deep inside a build. Touch every value now
    (reading a key of a ``ConfigDict`` performs its pending import) so the
    error names the config file and line instead, in the words an override of
    the same name gets (``misspelt_import``)."""
    def walk(node) -> None:
        if isinstance(node, dict):
            for key in list(node.keys()):
                try:
                    value = node[key]
                except ImportError as exc:
                    raise ConfigError(misspelt_import(dict.get(node, key), path) or f"{path}: {exc}") from None
                walk(value)
        elif isinstance(node, (list, tuple)):
            for item in node:
                walk(item)

    try:
        walk(cfg._cfg_dict)
    except ImportError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def misspelt_import(lazy: Any, path: Path) -> str | None:
    """``<file>, line <n>: unknown prompt template 'qwen_chatt'; valid names: qwen_chat, ...`` for a name a
    config imports from sfttool that does not exist (``PROMPT_TEMPLATE.qwen_chatt``, ``from
    sfttool.dataset.map_fns import alpaca_map_fnn``): what ``--cfg-options`` says for the same name,
    with the line. None for anything else (mmengine's own message stands)."""
    from mmengine.config.lazy import LazyAttr, LazyObject
    if isinstance(lazy, LazyAttr):
        owner, name, location = lazy.module, lazy.name, None
    elif isinstance(lazy, LazyObject) and isinstance(lazy._module, str) and lazy._imported:
        owner, name, location = lazy._module, lazy._imported, lazy.location
    else:
        return None
    if not owner.startswith("sfttool."):
        return None
    message = _unknown_name(owner, name)
    where = location or _first_use(path, f"{owner.rsplit('.', 1)[-1]}.{name}")
    return f"{where}: {message}" if message else None


def _unknown_name(owner: str, name: str) -> str | None:
    # Imported here, on this error path only: the data pipeline (and mmengine's registry under it) would
    # add a fifth of a second to every command that loads a config, `list-cfg` included.
    from sfttool.dataset.errors import DatasetError
    from sfttool.dataset.resolve import resolve_map_fn
    from sfttool.registry import resolve_type
    from sfttool.utils.templates import get_template
    try:
        if owner.endswith(".PROMPT_TEMPLATE"):
            get_template(name)
        elif owner == "sfttool.dataset.map_fns":
            resolve_map_fn(name)
        else:
            container = resolve_type(owner)
            names = container if isinstance(container, dict) else getattr(container, "__all__", dir(container))
            known = sorted(k for k in names if not k.startswith("_"))
            close = difflib.get_close_matches(name, known, n=3)
            return (f"{owner} has no {name!r}; valid names: "
                    f"{', '.join(close + [k for k in known if k not in close])}")
    except (ValueError, DatasetError) as exc:
        return str(exc)
    return None


def _first_use(path: Path, text: str) -> str:
    """``<file>, line <n>`` of the first line of ``path`` holding ``text`` (``<file>`` without one)."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    number = next((i for i, line in enumerate(lines, 1) if text in line), None)
    return f"{path}, line {number}" if number else str(path)
