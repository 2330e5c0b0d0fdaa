"""``process_hf_dataset``'s arguments, objects or configs, resolved into what the
stages use (the dataset, the map fns, the template), and where errors point
(the data files' names, the failing row of a map fn).

    >>> resolve_map_fn('alpaca_map_fn')          # a registered name
    <function alpaca_map_fn at ...>
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

from sfttool.dataset.data_path import data_source
from sfttool.dataset.errors import DatasetError
from sfttool.dataset.load import check_json_file, expand_data_files, local_json_files
from sfttool.dataset.source import DataSource, read_failure, reader_errors
from sfttool.errors import SfttoolError
from sfttool.registry import MAP_FUNC, ConfigBuildError, build, build_if_config, resolve_type, type_name


def dataset_config(dataset: Any) -> Any:
    """A dataset config with its own arguments built (``data_files=dict(type=builtin_data_file, ...)``
    becomes a path) but not itself, so the files can be checked before ``load_dataset`` runs. An
    argument its builder takes unbuilt (``validation_split``'s ``dataset``) stays a config, made
    the same way, so the files under it can be checked too."""
    if not (isinstance(dataset, dict) and "type" in dataset):
        return dataset
    unbuilt = getattr(resolve_type(dataset["type"], "dataset.type"), "build_args_lazily", ())
    return dict(type=dataset["type"], **{k: dataset_config(v) if k in unbuilt else build(v, f"dataset.{k}")
                                         for k, v in dataset.items() if k != "type"})


def rows_config(dataset_cfg: Any) -> Any:
    """The config of the dataset whose rows ``dataset_cfg`` holds: itself, or, for a builder that takes
    its rows from another dataset config and says which with ``rows_from`` (``validation_split``:
    the loaded data, or ``val_data_path`` for its held-out part), that one's. Files are checked,
    named in errors and hashed for the cache through it.

    >>> rows_config(dict(type=validation_split, dataset=dict(type=load_data_path, path='d.jsonl'),
    ...                  part='train', val_ratio=0.1))     # doctest: +SKIP
    {'type': <function load_data_path ...>, 'path': 'd.jsonl'}
    """
    while isinstance(dataset_cfg, dict) and "type" in dataset_cfg:
        try:
            rows_from = getattr(resolve_type(dataset_cfg["type"]), "rows_from", None)
        except ConfigBuildError:
            return dataset_cfg  # building it says what is wrong
        if rows_from is None:
            return dataset_cfg
        dataset_cfg = rows_from(dataset_cfg)
    return dataset_cfg


def resolve_dataset(dataset: Any, split: str, validate: bool = True):
    """A built ``datasets.Dataset`` from an object or a config (DatasetDict -> ``split``). Local JSON
    files are checked line by line first (``validate``); a file ``datasets`` still cannot read is
    one DatasetError naming it, not the library's traceback."""
    if validate:
        validate_json_source(dataset)
    return pick_split(build_loaded(dataset), split)


def build_loaded(dataset: Any) -> Any:
    """``build_if_config(dataset)`` with the data readers' failures (Arrow, ``datasets``' generation
    error) as one line naming the data (``source.read_failure``)."""
    try:
        return build_if_config(dataset, "dataset")
    except reader_errors() as exc:
        raise read_failure(exc, source_name(dataset)) from None


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
    ``dict(type=load_data_path, path=...)`` config reads, also under a ``validation_split``
    (``rows_config``); [] for any other dataset (the hub, a custom loader, a built dataset)."""
    dataset_cfg = rows_config(dataset_cfg)
    if not isinstance(dataset_cfg, dict) or "type" not in dataset_cfg:
        return []
    name = type_name(dataset_cfg["type"])
    if name == "load_data_path":
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
    field = rows_config(dataset_cfg).get("field") if isinstance(dataset_cfg, dict) else None
    for file in json_source_files(dataset_cfg):
        check_json_file(file, field=field)


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


def prompt_template_or_chat_template(prompt_template: Any) -> Any:
    """A ``prompt_template`` (a ``PROMPT_TEMPLATE`` entry or its name), or, for None, the tokenizer's own chat
    template (``PROMPT_TEMPLATE.hf_chat_template``): the default of preference, prompt and KTO data."""
    from sfttool.utils.templates import PROMPT_TEMPLATE
    return template_of({"template": prompt_template}) if prompt_template is not None \
        else PROMPT_TEMPLATE.hf_chat_template


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
    """The data file(s) a dataset config reads (``rows_config``), for error messages: a ``DataSource``
    that can read a row again from its file where the rows are read from local JSON files in order."""
    dataset_cfg = rows_config(dataset_cfg)
    if not isinstance(dataset_cfg, dict):
        return None
    files = dataset_cfg.get("data_files")
    if isinstance(files, dict):
        files = [f for v in files.values() for f in (v if isinstance(v, (list, tuple)) else [v])]
    if isinstance(files, (list, tuple)):
        name = ", ".join(map(str, files))
    else:
        name = str(files) if files else dataset_cfg.get("path")
    rows_files = _row_files(dataset_cfg)
    return DataSource(name, rows_files, dataset_cfg.get("field")) if name and rows_files else name


def _row_files(dataset_cfg: dict) -> list[str]:
    """The JSON files whose rows, in order, are the loaded rows (row N of the data is row N of them
    all); [] when that is not so (several splits' files, a file only ``datasets`` reads)."""
    files = json_source_files(dataset_cfg)
    data_files = dataset_cfg.get("data_files")
    if type_name(dataset_cfg.get("type")) == "load_data_path" and files:
        data_files = data_source(dataset_cfg.get("path")).get("data_files")
    if isinstance(data_files, dict) and len(data_files) > 1:
        return []
    return files if len(files) == len(expand_data_files(data_files)) else []


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
