"""The rows a pipeline reads: loaded, numbered in file order, and ``max_dataset_length``'s seeded subset;
and how many processes ``datasets.map`` gets for them. The map-style pipeline, lazy encoding, preference and
prompt datasets all start here."""
from __future__ import annotations

import os

import numpy as np

from sfttool.dataset.errors import ROW_COLUMN
from sfttool.dataset.report import DROP_SUBSET, PipelineReport
from sfttool.dataset.resolve import resolve_dataset


def default_num_proc(rows: int, map_num_proc: int | None) -> int:
    """Processes for ``map``: as configured (XTuner configs say 32), but no more than the CPUs,
    and one per 5000 rows at most (starting a process costs more than a small shard)."""
    cpus = os.cpu_count() or 1
    wanted = min(8, cpus) if map_num_proc is None else map_num_proc
    return max(1, min(wanted, cpus, rows // 5000 or 1))


def number_rows(dataset):
    """Add ``ROW_COLUMN`` (the row's index in the loaded data) unless it is there."""
    if ROW_COLUMN in dataset.column_names:
        return dataset
    if getattr(dataset, "_indices", None) is not None:  # a selected view: number what it shows
        dataset = dataset.flatten_indices()
    return dataset.add_column(ROW_COLUMN, np.arange(len(dataset)))


def select_rows(dataset, max_dataset_length: int | None, seed: int, report: PipelineReport):
    """Keep a seeded random subset of ``max_dataset_length`` rows (in file order)."""
    keep = subset_indices(len(dataset), max_dataset_length, seed)
    if keep is None:
        return dataset
    report.drop(DROP_SUBSET, [], count=len(dataset) - len(keep))
    return dataset.select(keep)


def subset_indices(rows: int, max_dataset_length: int | None, seed: int) -> np.ndarray | None:
    """The rows ``select_rows`` keeps, sorted, or None for all of them.

    >>> subset_indices(5, 3, seed=0).tolist(), subset_indices(5, None, seed=0)
    ([2, 3, 4], None)
    """
    if max_dataset_length is None or max_dataset_length >= rows:
        return None
    return np.sort(np.random.default_rng(seed).permutation(rows)[:max_dataset_length])


def load_rows(dataset, split: str, max_dataset_length: int | None, seed: int, validate: bool = True):
    """The rows the stages read, as ``run_pipeline`` loads them: built (local JSON checked line by line
    unless not ``validate``), numbered, and ``max_dataset_length``'s seeded subset kept (``lazy_encode``
    reads them from here)."""
    dataset = resolve_dataset(dataset, split, validate)
    return select_rows(number_rows(dataset), max_dataset_length, seed, PipelineReport())
