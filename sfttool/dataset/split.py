"""Validation rows: a separate file (``val_data_path``) or a seeded share of the training rows
(``val_ratio``), carved off the raw rows before any map fn, template or packing, so both parts then
go through the same ``process_hf_dataset`` (and its cache) and no sample is in both::

    raw = dict(type=load_dataset, path='json', data_files='data.jsonl')
    train_dataset = dict(type=process_hf_dataset, dataset=dict(type=validation_split, dataset=raw,
                         part='train', val_ratio=0.05, seed=42), ...)
    val_dataset = dict(train_dataset, dataset=dict(type=validation_split, dataset=raw,
                       part='val', val_ratio=0.05, seed=42))

With 100 raw rows and ``val_ratio=0.05`` the 'val' part is 5 rows drawn by ``seed`` and the 'train'
part the other 95, both in file order.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from sfttool.dataset.data_path import data_source, load_data_path
from sfttool.dataset.errors import DatasetError
from sfttool.dataset.pipeline import log
from sfttool.dataset.rows import number_rows
from sfttool.dataset.resolve import resolve_dataset
from sfttool.registry import BUILDER

PARTS = ("train", "val")


def held_out_count(rows: int, val_ratio: float, max_val_rows: int | None = None) -> int:
    """Rows ``val_ratio`` holds out of ``rows``: rounded, at least 1, at most ``max_val_rows``.

    >>> held_out_count(820, 0.05), held_out_count(10_000, 0.05, max_val_rows=200)
    (41, 200)
    """
    count = max(1, round(rows * val_ratio))
    return min(count, max_val_rows) if max_val_rows else count


def split_indices(rows: int, count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``(train indices, val indices)``: ``count`` rows drawn by ``seed``, each part in file order."""
    order = np.random.default_rng(seed).permutation(rows)
    return np.sort(order[count:]), np.sort(order[:count])


@BUILDER.register_module()
def validation_split(dataset: Any, part: str, val_ratio: float | None = None, val_data_path: Any = None,
                     max_val_rows: int | None = None, seed: int = 0, split: str = "train",
                     val_split: str | None = None):
    """One part of the raw rows: ``part='train'`` the rows to train on, ``part='val'`` the rows to
    validate on. ``val_data_path`` (read by the ``data_path`` rules: a hub name, a local file, a
    folder or a glob) wins over ``val_ratio``; with neither, 'train' is every row. ``split`` is the
    split of ``dataset`` and, unless ``val_split`` names another, of ``val_data_path``."""
    _check(part, val_ratio, max_val_rows)
    if part == "val" and val_data_path:
        return load_validation_data(val_data_path, val_split or split)
    if part == "val" and not val_ratio:
        raise DatasetError("validation_split(part='val') needs val_data_path or val_ratio; set one in PART 1 "
                           "of the config (or remove val_dataloader)")
    dataset = resolve_dataset(dataset, split)
    if val_data_path or not val_ratio:
        return dataset
    return _ratio_part(dataset, part, val_ratio, max_val_rows, seed)


def _rows_from(node: dict) -> Any:
    """The config of the data a ``validation_split`` node's part is drawn from (``resolve.rows_config``)."""
    if node.get("part") == "val" and node.get("val_data_path"):
        return dict(type=load_data_path, path=node["val_data_path"])
    return node.get("dataset")


# The registry hands `dataset` over unbuilt: its local JSON files are checked line by line before
# Arrow reads them (a traceback otherwise), and checks and errors see through this wrapper to them.
validation_split.build_args_lazily = ("dataset",)
validation_split.rows_from = _rows_from


def _ratio_part(dataset: Any, part: str, val_ratio: float, max_val_rows: int | None, seed: int):
    rows = len(dataset)
    count = held_out_count(rows, val_ratio, max_val_rows)
    if count >= rows:
        raise DatasetError(f"val_ratio={val_ratio} holds out {count} of the {rows} rows and leaves none to train "
                           "on; lower val_ratio (or set max_val_rows)")
    train, val = split_indices(rows, count, seed)
    if part == "train":
        log(f"Dataset: {count} of {rows} rows held out for validation (val_ratio={val_ratio}"
            f"{f', max_val_rows={max_val_rows}' if max_val_rows else ''}, seed {seed}); {rows - count} to train on")
    # Numbered first, so errors name a row's place in the loaded data, not in its part.
    return number_rows(dataset).select(train if part == "train" else val)


def load_validation_data(val_data_path: Any, split: str = "train"):
    """``val_data_path``, read by the ``data_path`` rules (a hub name, a local .json/.jsonl/.csv/.parquet
    file, a folder or a glob); local JSON files are checked line by line first, as training files are."""
    data_source(val_data_path, key="val_data_path")  # a missing file is named by its own setting
    return resolve_dataset(dict(type=load_data_path, path=val_data_path), split)


def _check(part: str, val_ratio: Any, max_val_rows: Any) -> None:
    if part not in PARTS:
        raise DatasetError(f"validation_split: part must be one of {', '.join(PARTS)}, got {part!r}")
    if val_ratio is not None and not (isinstance(val_ratio, (int, float)) and 0 <= val_ratio < 1):
        raise DatasetError(f"val_ratio must be a number from 0 (no validation rows) to below 1, got {val_ratio!r}")
    if max_val_rows is not None and not (isinstance(max_val_rows, int) and max_val_rows > 0):
        raise DatasetError(f"max_val_rows must be a positive integer or None, got {max_val_rows!r}")
