"""``data_path``: what users pass for their data, loaded the way ``datasets`` needs it.

``datasets.load_dataset`` takes a hub name or a folder as ``path``, but a single file only
as ``load_dataset('json', data_files=...)``: given ``data.jsonl`` it fails with "Couldn't
find any data file". The built-in configs read ``data_path`` through ``load_data_path``,
which accepts each of these:

    >>> data_source('tatsu-lab/alpaca')                  # a hub dataset
    {'path': 'tatsu-lab/alpaca'}
    >>> data_source('data/train.jsonl')                  # doctest: +SKIP
    {'path': 'json', 'data_files': ['data/train.jsonl']}
    >>> data_source('data/*.parquet')                    # a glob, or a folder of files  # doctest: +SKIP
    {'path': 'parquet', 'data_files': ['data/a.parquet', 'data/b.parquet']}

XTuner-style ``dict(type=load_dataset, path='json', data_files=...)`` keeps working; this
is for the PART 1 setting.
"""
from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Any

from sfttool.dataset.errors import DatasetError
from sfttool.registry import BUILDER

# File suffix -> the `datasets` builder that reads it (compressed JSON too, as datasets does).
BUILDERS = {".json": "json", ".jsonl": "json", ".json.gz": "json", ".jsonl.gz": "json",
            ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}
_GLOB = "*?["


def _builder(file: str) -> str | None:
    name = file.lower()
    return next((b for suffix, b in BUILDERS.items() if name.endswith(suffix)), None)


def _one_builder(files: list[str], data_path: str, key: str = "data_path") -> str:
    first: dict[str | None, str] = {}
    for file in files:
        first.setdefault(_builder(file), Path(file).name)
    if None in first or len(first) != 1:
        found = ", ".join(first.values())
        raise DatasetError(f"{key} {data_path!r}: expected files of one kind ({', '.join(BUILDERS)}), "
                           f"found {found}; point {key} (PART 1 of the config) at files of one kind")
    return next(iter(first))


def _looks_local(path: str) -> bool:
    """A path the user meant as a local file: a hub name is ``owner/name``, without a data suffix,
    and its owner is no folder here (``data/train`` with a ``data/`` folder is local)."""
    return (path.startswith(("/", "./", "../", "~")) or _builder(path) is not None
            or (os.sep in path and os.path.isdir(path.split(os.sep)[0])))


def data_source(data_path: str | os.PathLike, key: str = "data_path") -> dict:
    """``load_dataset`` arguments for ``data_path``: a hub name, a local data file, a folder
    (its data files, recursively) or a glob. A missing local path is an error naming it and the
    setting ``key`` it came from."""
    text = os.path.expanduser(str(data_path))
    if any(c in text for c in _GLOB):
        files = sorted(f for f in glob.glob(text, recursive=True) if os.path.isfile(f))
        if not files:
            raise DatasetError(f"{key} {str(data_path)!r}: no file matches this pattern; set {key} "
                               "(PART 1 of the config) to your data file, folder or pattern")
        return {"path": _one_builder(files, str(data_path), key), "data_files": files}
    if os.path.isfile(text):
        return {"path": _one_builder([text], str(data_path), key), "data_files": [text]}
    if os.path.isdir(text):
        if any(os.path.isfile(os.path.join(text, f)) for f in ("dataset_dict.json", "state.json")):
            return {"path": text, "from_disk": True}  # written by Dataset(Dict).save_to_disk
        files = sorted(str(f) for f in Path(text).rglob("*") if f.is_file() and _builder(str(f)))
        if not files:  # a dataset repository checked out locally: datasets reads its layout
            return {"path": text}
        return {"path": _one_builder(files, str(data_path), key), "data_files": files}
    if _looks_local(text):
        raise DatasetError(f"{key} {str(data_path)!r}: no such file or folder; set {key} (PART 1 of "
                           "the config) to your data file, a folder or a glob, or a dataset name on the hub")
    return {"path": str(data_path)}


@BUILDER.register_module()
def load_data_path(path: str | os.PathLike, **kwargs: Any):
    """Load ``data_path`` (see ``data_source``); other arguments go to ``datasets.load_dataset``.

    Local JSON files are checked line by line first, so a malformed row is reported by file
    and line instead of by Arrow: the pipeline does it before building this (its
    ``json_source_files`` knows ``load_data_path``), and so does ``check-custom-dataset``.
    """
    import datasets

    source = data_source(path)
    if source.pop("from_disk", False):
        return datasets.load_from_disk(source["path"])
    return datasets.load_dataset(**source, **kwargs)


# Validation checks the extra arguments against it (sfttool.config.arguments).
load_data_path.forwards_kwargs_to = "datasets.load_dataset"
