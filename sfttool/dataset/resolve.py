"""``process_hf_dataset``'s arguments, objects or configs, resolved into what the
stages use (the dataset, the map fns, the template), and where errors point
(the data files' names, the failing row of a map fn).

    >>> resolve_map_fn('alpaca_map_fn')          # a registered name
    <function alpaca_map_fn at ...>
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

from sfttool.dataset.errors import DatasetError
from sfttool.errors import SfttoolError
from sfttool.registry import MAP_FUNC, build_if_config, resolve_type, type_name


def dataset_config(dataset: Any) -> Any:
    """A dataset config with its own arguments built (``data_files=dict(type=builtin_data_file, ...)``
    becomes a path) but not itself, so the files can be checked before ``load_dataset`` runs."""
    from sfttool.registry import build
    if not (isinstance(dataset, dict) and "type" in dataset):
        return dataset
    return dict(type=dataset["type"], **{k: build(v, f"dataset.{k}") for k, v in dataset.items() if k != "type"})


def resolve_dataset(dataset: Any, split: str, validate: bool = True):
    """A built ``datasets.Dataset`` from an object or a config (DatasetDict -> ``split``)."""
    if validate:
        validate_json_source(dataset)
    return pick_split(build_if_config(dataset, "dataset"), split)


def pick_split(dataset: Any, split: str) -> Any:
    """``dataset[split]`` of a dict of splits (map-style or streamed); any other dataset as it is."""
    from datasets import DatasetDict, IterableDatasetDict
    if not isinstance(dataset, (DatasetDict, IterableDatasetDict)):
        return dataset
    if split not in dataset:
        raise DatasetError(f"dataset has no split {split!r} (it has {', '.join(dataset)}); set split=...")
    return dataset[split]


def json_source_files(dataset_cfg: Any) -> list[str]:
    """The local JSON files a ``dict(type=load_dataset, path='json', data_files=...)`` or a
    ``dict(type=load_data_path, path=...)`` config reads; [] for any other dataset (the hub, a
    custom loader, a built dataset)."""
    from sfttool.dataset.load import local_json_files
    if not isinstance(dataset_cfg, dict) or "type" not in dataset_cfg:
        return []
    name = type_name(dataset_cfg["type"])
    if name == "load_data_path":
        from sfttool.dataset.data_path import data_source
        try:
            source = data_source(dataset_cfg.get("path"))
        except DatasetError:
            return []  # a missing path: load_data_path names it when the dataset is built
        return local_json_files(source["path"], source.get("data_files"))
    if name != "load_dataset":
        return []
    return local_json_files(dataset_cfg.get("path"), dataset_cfg.get("data_files"))


def validate_json_source(dataset_cfg: Any) -> None:
    """Check every line of the local JSON files a dataset config reads, so a malformed one is
    reported by file and line, not by Arrow."""
    from sfttool.dataset.load import check_json_file
    for file in json_source_files(dataset_cfg):
        check_json_file(file, field=dataset_cfg.get("field"))


def resolve_map_fn(map_fn: Any) -> Callable | None:
    """A map fn from a function, a registered name or a config dict."""
    if map_fn is None or callable(map_fn):
        return map_fn
    if isinstance(map_fn, str):
        import sfttool.dataset.map_fns  # noqa: F401  (registers the built-in map fns)
        fn = MAP_FUNC.get(map_fn) if map_fn in MAP_FUNC else None
        if fn is None:
            import difflib
            known = sorted(MAP_FUNC.module_dict)
            close = difflib.get_close_matches(map_fn, known, n=3)
            raise DatasetError(f"unknown dataset_map_fn {map_fn!r}; valid names: "
                               f"{', '.join(close + [k for k in known if k not in close])}")
        return fn
    return build_if_config(map_fn, "dataset_map_fn")


def template_of(template_map_fn: Any) -> Any:
    """The template a template_map_fn (config dict or partial) was made from, or None."""
    if isinstance(template_map_fn, dict):
        template = template_map_fn.get("template")
    else:
        template = getattr(template_map_fn, "keywords", {}).get("template")
    if isinstance(template, str):
        from sfttool.utils.templates import get_template
        template = _user_value_error(get_template, template)
    return template


def resolve_template_map_fn(template_map_fn: Any) -> Callable | None:
    if template_map_fn is None or callable(template_map_fn):
        return template_map_fn
    return _user_value_error(build_if_config, template_map_fn, "template_map_fn")


def _user_value_error(fn: Callable, *args: Any) -> Any:
    """Turn a library's ValueError (e.g. an unknown template name) into a DatasetError."""
    try:
        return fn(*args)
    except DatasetError:
        raise
    except ValueError as exc:
        raise DatasetError(str(exc)) from None


def source_name(dataset_cfg: Any) -> str | None:
    """The data file(s) a dataset config reads, for error messages."""
    if not isinstance(dataset_cfg, dict):
        return None
    files = dataset_cfg.get("data_files")
    if isinstance(files, dict):
        files = [f for v in files.values() for f in (v if isinstance(v, (list, tuple)) else [v])]
    if isinstance(files, (list, tuple)):
        return ", ".join(map(str, files))
    return str(files) if files else dataset_cfg.get("path")


def skip_bad_rows_in(cfg: Any) -> int:
    """``--skip-bad-rows``: set ``skip_bad_rows=True`` on every dataset config in ``cfg`` whose builder takes it
    (``process_hf_dataset``, ``StreamingPackedDataset``; training and validation data, each part of a mix).
    Returns how many; none is an error (the flag would change nothing)."""
    found = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if "skip_bad_rows" in _parameters(node.get("type")):
                node["skip_bad_rows"] = True
                found.append(node)
            for key in list(node.keys()):
                walk(node[key])
        elif isinstance(node, (list, tuple)):
            for item in node:
                walk(item)
    walk(getattr(cfg, "_cfg_dict", cfg))
    if not found:
        raise DatasetError("--skip-bad-rows: no dataset of this config can skip rows (process_hf_dataset and "
                           "StreamingPackedDataset can); leave the flag out")
    return len(found)


def _parameters(type_: Any) -> tuple[str, ...]:
    """The keyword arguments a config's ``type`` takes (none when it names nothing importable)."""
    if type_ is None:
        return ()
    try:
        return tuple(inspect.signature(resolve_type(type_)).parameters)
    except (SfttoolError, TypeError, ValueError):
        return ()
