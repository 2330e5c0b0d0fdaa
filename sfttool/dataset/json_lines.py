"""Local JSON Lines files read into the same ``datasets.Dataset`` as
``load_dataset('json', data_files=...)``, without its builder.

``load_dataset`` builds a ``DatasetBuilder`` (its first use in a process imports the streaming
patches, scipy among them: 0.3-0.4 s), then reads every file twice: once for the first chunk's
features, and again for the rows. The rows it reads come from its JSON reader
(``Json._generate_tables``: ``pyarrow.json`` plus the columns of mixed types re-encoded as ``Json``);
here that same reader runs once, the tables are written with ``datasets``' ``ArrowWriter`` into an
Arrow file in the ``datasets`` cache (keyed by the files' content), and the dataset is memory-mapped
from it, as ``load_dataset`` does: the same features, rows and cache behaviour (``map`` writes its cache
files beside it; a second load of the same files reuses it).

    >>> load_json_lines(['data.jsonl'])          # doctest: +SKIP
    Dataset({features: ['conversation'], num_rows: 1000})

Anything else (an array file, ``field=``, compressed files, globs, several splits, other
``load_dataset`` arguments, a ``datasets`` whose reader differs from the 5.x one this was written
against, data its reader refuses) goes to ``load_dataset`` as before.
"""
from __future__ import annotations

import hashlib
import os
import uuid
from pathlib import Path
from typing import Any

LOADER_VERSION = 1
# The config keys this path understands; any other (features, field, streaming, cache_dir...) means load_dataset.
_DATASET_KEYS = {"type", "path", "data_files", "split"}
_DATA_PATH_KEYS = {"type", "path", "split"}


def json_lines_files(dataset_cfg: Any) -> tuple[list[str], str] | None:
    """``(files, split name)`` when ``dataset_cfg`` (``dict(type=load_dataset, path='json', data_files=...)``
    or ``dict(type=load_data_path, path=...)``) reads plain local files into one split; else None."""
    from sfttool.dataset.load import data_file_list
    from sfttool.dataset.resolve import json_source_files
    if not isinstance(dataset_cfg, dict) or not (files := json_source_files(dataset_cfg)):
        return None
    type_ = dataset_cfg["type"]
    name = (type_ if isinstance(type_, str) else getattr(type_, "__name__", "")).rsplit(".", 1)[-1]
    allowed = _DATA_PATH_KEYS if name == "load_data_path" else _DATASET_KEYS
    data_files = dataset_cfg.get("data_files")
    if name != "load_data_path" and (dataset_cfg.get("path") != "json" or data_file_list(data_files) != files):
        return None  # a glob or an archive datasets resolves its own way, or a builder name it may refuse
    if set(dataset_cfg) - allowed:
        return None  # arguments only load_dataset understands
    if any(Path(f).suffix.lower() in (".gz", ".bz2", ".xz") for f in files):
        return None
    split = next(iter(data_files)) if isinstance(data_files, dict) else "train"
    if isinstance(data_files, dict) and len(data_files) != 1:
        return None  # several splits share the first one's features in load_dataset: not reproduced here
    return files, split


def load_json_config(dataset_cfg: Any, split: str):
    """The dataset ``dataset_cfg`` builds, read by ``load_json_lines``; None when it is not that kind of
    config (``json_lines_files``) or the files need ``load_dataset``."""
    found = json_lines_files(dataset_cfg)
    # load_dataset returns the config's split as a Dataset, or a dict of splits the pipeline picks from
    if found is None or (dataset_cfg.get("split") or split) != found[1]:
        return None
    return load_json_lines(found[0], found[1])


def load_json_lines(files: list[str], split: str = "train"):
    """``load_dataset('json', data_files=files, split=split)``'s dataset, or None when the files need it."""
    from datasets import Dataset, DatasetInfo, Features
    from datasets.table import MemoryMappedTable
    key = _content_key(files, split)
    target = _cache_dir() / "sfttool_json" / key / f"json-{split}.arrow"
    if not target.exists():
        try:
            written = _write_tables(files, target)
        except Exception:  # noqa: BLE001  (data or a datasets version its reader refuses: load_dataset decides)
            return None
        if not written:
            return None
    table = MemoryMappedTable.from_file(str(target))
    features = Features.from_arrow_schema(table.schema)
    return Dataset(table, info=DatasetInfo(features=features), split=split, fingerprint=key)


def _cache_dir() -> Path:
    import datasets.config
    return Path(datasets.config.HF_DATASETS_CACHE)


def _content_key(files: list[str], split: str) -> str:
    import datasets

    from sfttool.dataset.fingerprint import file_digest
    parts = [str(LOADER_VERSION), datasets.__version__, split]
    parts += [f"{os.path.abspath(f)}:{file_digest(f)}" for f in files]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def _reader(files: list[str]):
    """``datasets``' JSON reader without its builder: the state ``Json._generate_tables`` reads."""
    from datasets import DatasetInfo
    from datasets.packaged_modules.json import json as hf_json
    reader = object.__new__(hf_json.Json)
    reader.config, reader.info, reader.base_path = hf_json.JsonConfig(name="default"), DatasetInfo(), None
    paths = [os.path.abspath(f) for f in files]
    return reader, dict(base_files=paths, files_iterables=[[p] for p in paths], original_files=paths)


def _write_tables(files: list[str], target: Path) -> bool:
    """Read ``files`` as ``load_dataset`` does and write the rows to ``target``; False when they need it.

    ``load_dataset`` takes the features from the first chunk of the first file, then reads every chunk
    again and casts it to them. Read once here: when every chunk came out with the first one's schema,
    the second reading would give the same tables (same mixed-type paths, an identity cast)."""
    from datasets import Features
    from datasets.arrow_writer import ArrowWriter
    from datasets.packaged_modules.json.json import has_agent_traces_markers
    from sfttool.dataset.stages import gc_paused
    reader, sources = _reader(files)
    with gc_paused():  # the reader parses each chunk's rows into Python objects to find mixed types
        tables = [table for _, table in reader._generate_tables(**sources, allow_full_read=False)]
    if not tables or any(t.schema != tables[0].schema for t in tables[1:]):
        return False
    features = Features.from_arrow_schema(tables[0].schema)
    if has_agent_traces_markers(features):
        return False  # datasets reads such files as agent traces
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}")
    try:
        with ArrowWriter(features=features, path=str(partial)) as writer:
            for table in tables:
                writer.write_table(table)
            writer.finalize()
        os.replace(partial, target)  # a reader sees all of it or none
    finally:
        partial.unlink(missing_ok=True)
    return True
