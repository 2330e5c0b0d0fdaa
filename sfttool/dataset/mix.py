"""Mix several processed datasets into one, with optional sampling ratios.

    train_dataset = dict(type=mix_datasets,
                         datasets=[dict(type=process_hf_dataset, ...),   # chat data
                                   dict(type=process_hf_dataset, ...)],  # code data
                         ratios=[1.0, 0.25], seed=0)

A ratio is how many times each row of that dataset is used: 1.0 = every row
once, 0.25 = a seeded random quarter, 2.5 = every row twice plus a random
half (a fractional count of rows rounds half up: 0.5 of 5 rows is 3). Each
dataset is processed (and packed) on its own, then rows are concatenated, so
packed rows never mix sources. Every dataset's count is logged.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from sfttool.dataset.errors import DatasetError
from sfttool.registry import BUILDER, build_if_config


def sample_indices(n: int, ratio: float, rng: np.random.Generator) -> np.ndarray:
    """Row indices for using ``n`` rows ``ratio`` times.

    >>> sample_indices(4, 1.5, np.random.default_rng(0)).size
    6
    """
    whole, frac = int(ratio), ratio - int(ratio)
    extra = rng.permutation(n)[:math.floor(frac * n + 0.5)]  # half up: Python's round() goes to even
    return np.concatenate([np.tile(np.arange(n), whole), np.sort(extra)]).astype(np.int64)


def mix_datasets(datasets: Sequence[Any], ratios: Sequence[float] | None = None, seed: int = 0,
                 shuffle: bool = False):
    """Concatenate ``datasets`` (built or configs), each sampled by its ratio."""
    from datasets import concatenate_datasets
    if not datasets:
        raise DatasetError("mix_datasets needs at least one dataset")
    ratios = [1.0] * len(datasets) if ratios is None else list(ratios)
    if len(ratios) != len(datasets):
        raise DatasetError(f"mix_datasets: {len(datasets)} datasets but {len(ratios)} ratios; give one per dataset")
    if any(isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r) or r < 0 for r in ratios):
        raise DatasetError(f"mix_datasets: ratios must be finite numbers >= 0, got {ratios}")
    from sfttool.dataset.report import log
    rng = np.random.default_rng(seed)
    parts, sizes = [], []
    for i, (dataset, ratio) in enumerate(zip(datasets, ratios)):
        dataset = build_if_config(dataset, f"datasets[{i}]")
        indices = sample_indices(len(dataset), float(ratio), rng)
        sizes.append(len(dataset))
        log(f"Dataset mix: datasets[{i}]: {len(dataset)} rows x {ratio} -> {len(indices)} rows")
        if len(indices) == 0 and len(dataset) and ratio > 0:
            log(f"Dataset mix: datasets[{i}]: ratio {ratio} of {len(dataset)} rows selects none", logging.WARNING)
        if len(indices):
            parts.append(dataset.select(indices))
    if not parts:
        raise DatasetError(f"mix_datasets: no rows to train on (dataset sizes {sizes}, ratios {ratios})")
    mixed = concatenate_datasets(parts)
    log(f"Dataset mix: {len(mixed)} rows from {len(parts)} of {len(datasets)} datasets")
    return mixed.shuffle(seed=seed) if shuffle else mixed


def unified_table(tables: Sequence[Any]):
    """The tables one after another in one schema (int32 and int64 token columns, as encoders write them,
    meet as int64), without copying them."""
    import pyarrow as pa
    return pa.concat_tables(tables, promote_options="permissive")


def mix_indices(sizes: Sequence[int], strategy: str, ratios: Sequence[float],
                probabilities: Sequence[float] | None, stopping_strategy: str, seed: int) -> np.ndarray:
    """The samples of several sources' tables (``sizes`` samples each) mixed, as row indices of the tables
    one after another (``unified_table``): the samples themselves are taken once, by the packer.

    ``'concat'``: each table's samples ``ratio`` times (``sample_indices``, one seeded generator for all),
    table 0's first. ``'interleave'``: the indices ``datasets.interleave_datasets`` itself picks, with
    ``probabilities`` (None: one of each in turn), ``seed`` and ``stopping_strategy``.

    >>> mix_indices([3, 2], 'interleave', [1, 1], None, 'all_exhausted', 0).tolist()
    [0, 3, 1, 4, 2, 3]
    """
    offsets = np.cumsum([0] + list(sizes))
    if strategy == "concat":
        rng = np.random.default_rng(seed)
        return np.concatenate([offset + sample_indices(n, float(r), rng)
                               for offset, n, r in zip(offsets, sizes, ratios)]).astype(np.int64)
    from datasets import Dataset, interleave_datasets
    rows = [Dataset.from_dict({"row": np.arange(offset, offset + n)}) for offset, n in zip(offsets, sizes)]
    mixed = interleave_datasets(rows, probabilities=None if probabilities is None else list(probabilities),
                                seed=seed, stopping_strategy=stopping_strategy)
    return mixed.with_format("arrow")[:]["row"].to_numpy().astype(np.int64)


class _Source:
    """One source of ``interleave_streams``: its items with one looked ahead, so that taking its last item
    marks it exhausted at once (as ``datasets`` marks a map-style source after its last index). With
    ``restart`` an exhausted source starts a new pass on the next take."""

    def __init__(self, start: Callable[[], Iterable], restart: bool):
        self.start, self.restart, self.exhausted = start, restart, False
        self._begin()

    def _begin(self) -> None:
        self.items = iter(self.start())
        self.has_next = self._advance()

    def _advance(self) -> bool:
        try:
            self.head = next(self.items)
        except StopIteration:
            return False
        return True

    def take(self) -> Any:
        item = self.head
        self.has_next = self._advance()
        if not self.has_next:
            self.exhausted = True
            if self.restart:
                self._begin()
        return item


def interleave_streams(sources: Sequence[Callable[[], Iterable]], probabilities: Sequence[float] | None,
                       seed: int, stopping_strategy: str, skip_empty: bool = False) -> Iterator[tuple[int, Any]]:
    """``(source index, item)``, drawn from sources of unknown length as ``datasets.interleave_datasets``
    draws from map-style datasets of the same items: one of each in turn (``probabilities=None``; whole
    rounds only) or a source chosen per item by ``numpy.random.default_rng(seed).choice`` in blocks of 1000;
    ``'first_exhausted'`` stops once a source has given its last item, ``'all_exhausted'`` once every source
    has, starting the others again (each source is a function returning a new iterator over its items).
    An empty source is an error, as in ``datasets``; with ``skip_empty`` (a stream reader's share of a source
    may be empty) it is exhausted from the start: ``'first_exhausted'`` draws nothing, ``'all_exhausted'``
    draws from the others.

    >>> list(interleave_streams([lambda: 'ab', lambda: 'xyz'], None, 0, 'first_exhausted'))
    [(0, 'a'), (1, 'x'), (0, 'b'), (1, 'y')]
    """
    oversampling = stopping_strategy == "all_exhausted"
    weights = [1.0] * len(sources) if probabilities is None else list(probabilities)
    drawable = [i for i, p in enumerate(weights) if p > 0]
    streams = {i: _Source(sources[i], oversampling) for i in drawable}
    empty = [i for i in drawable if not streams[i].has_next]
    if empty and not skip_empty:
        raise DatasetError(f"interleave: source(s) {', '.join(map(str, empty))} hold no sample to draw")
    if empty and not oversampling:
        return
    drawable = [i for i in drawable if i not in empty]

    def done() -> bool:
        exhausted = [streams[i].exhausted for i in drawable]
        return not exhausted or (all(exhausted) if oversampling else any(exhausted))

    if probabilities is None:
        while not done():  # whole rounds, as datasets' index arithmetic gives
            for i in drawable:
                yield i, streams[i].take()
        return
    rng = np.random.default_rng(seed)
    while True:
        for i in rng.choice(len(sources), size=1000, p=weights):
            if done():
                return
            if int(i) in drawable:  # not an empty source (skip_empty)
                yield int(i), streams[int(i)].take()


BUILDER.register_module(name="mix_datasets", module=mix_datasets, force=True)
