"""Registries and the one `build()` that turns config dicts into objects.

A config node is built when it is a dict with a ``type`` key. ``type`` may be
a class or function (what pure-Python configs import), a name registered in
``BUILDER`` or ``MAP_FUNC``, or a dotted import path such as
``'torch.optim.AdamW'`` (what ``Config.dump`` writes back). Nested nodes are
built depth-first, so a callee receives ready objects. Errors say which
config key failed and why, instead of a bare ``TypeError`` from ``cls(**kw)``.
"""
from __future__ import annotations

import difflib
import importlib
import os
from typing import Any

from mmengine.registry import Registry
from sfttool.errors import SfttoolError

# Datasets, models, collate fns, hooks' helpers: anything a config builds.
BUILDER = Registry("builder")
# Dataset map fns (raw format -> standard `conversation` rows), by name.
MAP_FUNC = Registry("map_fn")


class ConfigBuildError(SfttoolError):
    """A config node could not be built; the message names the key path."""


def _import_dotted(path: str) -> Any:
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise ImportError(path)
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        # 'pkg.Class.method' -> import pkg, then walk attributes.
        obj = _import_dotted(module_name)
        return getattr(obj, attr)
    return getattr(module, attr)


def type_name(type_: Any) -> str:
    """A config ``type``'s short name: a class's or function's ``__name__``, or the last part of a
    dotted path (``'mmengine.optim.AmpOptimWrapper'`` -> ``'AmpOptimWrapper'``); ``''`` for anything else."""
    name = type_ if isinstance(type_, str) else getattr(type_, "__name__", "")
    return name.rsplit(".", 1)[-1]


def resolve_type(type_: Any, key: str = "type") -> Any:
    """Return the callable a config's ``type`` names."""
    if callable(type_):
        return type_
    if not isinstance(type_, str):
        raise ConfigBuildError(f"{key}: `type` must be a class, a function or a name, got {type_!r}")
    for registry in (BUILDER, MAP_FUNC):
        obj = registry.get(type_) if type_ in registry else None
        if obj is not None:
            return obj
    if "." in type_:
        try:
            return _import_dotted(type_)
        except (ImportError, AttributeError) as exc:
            raise ConfigBuildError(f"{key}: cannot import {type_!r} ({exc})") from None
    known = list(BUILDER.module_dict) + list(MAP_FUNC.module_dict)
    close = difflib.get_close_matches(type_, known, n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise ConfigBuildError(
        f"{key}: unknown type {type_!r}: not registered in sfttool's builder or map_fn "
        f"registries and not a dotted import path{hint}")


def build(cfg: Any, key: str = "cfg", **default_args: Any) -> Any:
    """Build ``cfg`` recursively.

    >>> dict(build(dict(type='collections.OrderedDict', a=dict(type=dict, b=1))))
    {'a': {'b': 1}}

    Dicts without ``type`` and lists are walked and their typed children built;
    everything else is returned as is. ``default_args`` fill missing arguments
    of the top-level node only.
    """
    if isinstance(cfg, dict) and "type" in cfg:
        args = {k: v for k, v in cfg.items() if k != "type"}
        for name, value in default_args.items():
            args.setdefault(name, value)
        fn = resolve_type(cfg["type"], f"{key}.type")
        # A component may take some config arguments unbuilt, to normalise them
        # first (e.g. SupervisedFinetune's `llm`: dtype strings, quantization).
        unbuilt = getattr(fn, "build_args_lazily", ())
        args = {k: (v if k in unbuilt else build(v, f"{key}.{k}")) for k, v in args.items()}
        try:
            return fn(**args)
        except ConfigBuildError:
            raise
        except (TypeError, OSError) as exc:
            # TypeError: a misspelt or missing argument. OSError: a path or model id that
            # cannot be read (no such folder, hub unreachable, disk full) -- say which key.
            name = getattr(fn, "__qualname__", repr(fn))
            hint = _os_error_hint(args) if isinstance(exc, OSError) else ""
            raise ConfigBuildError(f"{key}: building {name} failed: {exc}{hint}") from exc
    if isinstance(cfg, dict):
        return type(cfg)({k: build(v, f"{key}.{k}") for k, v in cfg.items()}) if _has_typed(cfg) else cfg
    if isinstance(cfg, (list, tuple)):
        built = [build(v, f"{key}[{i}]") for i, v in enumerate(cfg)]
        return type(cfg)(built) if isinstance(cfg, tuple) else built
    return cfg


def _os_error_hint(args: dict) -> str:
    path = args.get("pretrained_model_name_or_path")
    if isinstance(path, str) and not os.path.exists(path):
        return (f"\n  {path!r} is not a local folder; without access to the model hub, set "
                "pretrained_model_name_or_path (PART 1 of the config) to a local copy")
    return ""


def _has_typed(node: Any) -> bool:
    if isinstance(node, dict):
        return "type" in node or any(_has_typed(v) for v in node.values())
    if isinstance(node, (list, tuple)):
        return any(_has_typed(v) for v in node)
    return False


def build_if_config(obj: Any, key: str = "cfg") -> Any:
    """Build ``obj`` when it is a typed config dict; return it unchanged otherwise.

    Components accept either a built object or its config, as XTuner's do.
    """
    if isinstance(obj, dict) and "type" in obj:
        return build(obj, key)
    return obj
