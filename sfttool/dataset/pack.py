"""Pack encoded samples into rows of at most ``max_length`` tokens.

Strategies (``pack_strategy``):

* ``'bfd'`` (default): best-fit-decreasing bin packing of whole samples over
  the whole dataset. Rows are shuffled with ``seed`` first (when
  ``shuffle_before_pack``) so ties are broken deterministically; a sample is
  never split and no token is lost.
* ``'concat'``: XTuner's concat-and-cut: samples are concatenated and the
  stream is cut every ``max_length`` tokens. By nature this **splits samples**
  across rows (the continuation loses its prompt). Unlike XTuner, the last
  partial row is kept (no token is lost) and each piece's ``position_ids``
  restart at 0, so a piece attends only to itself.

The table packers work on Arrow columns directly: packing only reorders samples and draws new row
boundaries over the flat token arrays, so no token passes through a Python list; ``pack_stream`` packs a
stream with the same best fit, one buffer of samples at a time (``StreamingPackedDataset``). Each output
row has ``input_ids``, ``labels``, ``position_ids`` (restarting at 0 at every sample or piece),
``sample_lengths`` (summing to the row length) and ``length``.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np
import pyarrow as pa

from sfttool.dataset.errors import DatasetError
from sfttool.utils.constants import IGNORE_INDEX

STRATEGIES = ("bfd", "concat")


def packing_efficiency(tokens: int, rows: int, max_length: int | None) -> float | None:
    """The share of the rows' ``max_length`` slots that hold real tokens: ``tokens / (rows * max_length)``
    (None when there is no row or no length). The one definition every report uses.

    >>> packing_efficiency(300, 3, 128)
    0.78125
    """
    return tokens / (rows * max_length) if rows and max_length else None


@dataclass
class PackStats:
    samples: int
    rows: int
    tokens: int
    capacity: int            # rows * max_length
    split_samples: int       # samples spread over several rows (concat only)
    rows_without_labels: int  # rows with no trained token (concat only can create them)
    max_length: int = 0

    @property
    def efficiency(self) -> float:
        """Real tokens / row capacity (``packing_efficiency``)."""
        return packing_efficiency(self.tokens, self.rows, self.max_length) or 0.0


class _FirstSetIndex:
    """Segment tree over 0..n-1 answering "smallest set index >= i" in O(log n)."""

    def __init__(self, n: int):
        self.size = 1
        while self.size < n:
            self.size *= 2
        self.tree = [False] * (2 * self.size)

    def set(self, i: int, value: bool) -> None:
        j = i + self.size
        self.tree[j] = value
        j //= 2
        while j:
            new = self.tree[2 * j] or self.tree[2 * j + 1]
            if self.tree[j] == new:
                break
            self.tree[j] = new
            j //= 2

    def first_at_least(self, i: int) -> int | None:
        tree, j = self.tree, i + self.size
        if tree[j]:
            return i
        while j > 1:
            if j % 2 == 0 and tree[j + 1]:
                j += 1
                break
            j //= 2
        else:
            return None
        while j < self.size:  # descend to the leftmost set leaf
            j = 2 * j if tree[2 * j] else 2 * j + 1
        return j - self.size


def best_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Group sample indices into bins of total length <= ``capacity``.

    >>> best_fit_decreasing(np.array([3, 5, 2, 4]), 7)
    [[1, 2], [3, 0]]

    Longest first; each sample goes to the bin whose free space fits it most
    tightly (ties: the earliest index, via a stable sort). Deterministic.
    """
    order = np.argsort(-np.asarray(lengths), kind="stable")
    free_index = _FirstSetIndex(capacity + 1)
    by_free: list[list[int]] = [[] for _ in range(capacity + 1)]  # free space -> bin ids
    bins: list[list[int]] = []
    for i in order.tolist():
        length = int(lengths[i])
        if length > capacity:
            raise ValueError(f"sample {i} has {length} tokens > capacity {capacity}")
        free = free_index.first_at_least(length)
        if free is None:
            b, free = len(bins), capacity
            bins.append([])
        else:
            b = by_free[free].pop()
            if not by_free[free]:
                free_index.set(free, False)
        bins[b].append(i)
        left = free - length
        if left > 0:
            by_free[left].append(b)
            free_index.set(left, True)
    return bins


def _list_array(offsets: np.ndarray, values: pa.Array) -> pa.Array:
    if offsets[-1] < 2**31:
        return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), values)
    return pa.LargeListArray.from_arrays(pa.array(offsets, pa.int64()), values)


def assemble(table: pa.Table, order: np.ndarray, piece_lengths: np.ndarray,
             row_piece_counts: np.ndarray) -> pa.Table:
    """Build packed rows from samples taken in ``order``.

    The flat token stream of the ordered samples is cut into pieces
    (``piece_lengths``, summing to the stream length) and the pieces are
    grouped into rows (``row_piece_counts``). position_ids restart per piece.
    """
    piece_offsets = np.concatenate([[0], np.cumsum(piece_lengths)]).astype(np.int64)
    row_piece_offsets = np.concatenate([[0], np.cumsum(row_piece_counts)]).astype(np.int64)
    row_offsets = piece_offsets[row_piece_offsets]
    indices = pa.array(order)
    columns = {name: _list_array(row_offsets, _flat_taken(table[name], indices)) for name in ("input_ids", "labels")}
    columns["position_ids"] = _list_array(row_offsets, pa.array(_positions(piece_offsets, piece_lengths)))
    columns["sample_lengths"] = _list_array(row_piece_offsets, pa.array(piece_lengths.astype(np.int32)))
    columns["length"] = pa.array(np.diff(row_offsets).astype(np.int32))
    if "images" in table.column_names:  # image rows: each sample's images go with it, in sample order
        columns["images"] = _row_images(table["images"].take(indices), row_piece_offsets)
    return pa.table(columns)


def _row_images(images, row_piece_offsets: np.ndarray) -> pa.Array:
    """The samples' image lists (in packing order) joined per row: ``[[a], [], [b, c]]`` in rows of 2 and 1
    samples -> ``[[a], [b, c]]``. Whole samples only (``bfd``): a sample's images are its own."""
    import pyarrow.compute as pc
    images = images.combine_chunks() if isinstance(images, pa.ChunkedArray) else images
    counts = pc.list_value_length(images).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    per_row = np.add.reduceat(counts, row_piece_offsets[:-1]) if len(row_piece_offsets) > 1 else counts[:0]
    return _list_array(np.concatenate([[0], np.cumsum(per_row)]).astype(np.int64), images.flatten())


def _flat_taken(column, indices: pa.Array) -> pa.Array:
    """The tokens of the samples ``indices``, in that order, as one flat int32 array."""
    chunks = [chunk.flatten() for chunk in column.take(indices).chunks]
    if len(chunks) == 1:
        return chunks[0].cast(pa.int32())  # no concatenating copy: most takes come back as one chunk
    return (pa.concat_arrays(chunks) if chunks else pa.array([])).cast(pa.int32())


def _positions(piece_offsets: np.ndarray, piece_lengths: np.ndarray) -> np.ndarray:
    """0, 1, ... restarting at every piece start: ``[3, 2] -> [0, 1, 2, 0, 1]``."""
    total = int(piece_offsets[-1])
    positions = np.arange(total, dtype=np.int32)
    positions -= np.repeat(piece_offsets[:-1].astype(np.int32), piece_lengths)
    return positions


def _sample_order(n: int, shuffle: bool, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).permutation(n) if shuffle else np.arange(n)


def pack_table(table: pa.Table, max_length: int, strategy: str = "bfd", shuffle: bool = True,
               seed: int = 0, samples: np.ndarray | None = None) -> tuple[pa.Table, PackStats]:
    """Pack a table with ``input_ids``/``labels`` list columns; return (rows, stats). ``samples``: the
    samples to pack, as row indices of ``table`` (a mix of several sources' tables picks and repeats
    rows), taken with the packing's own take instead of a copy of its own; default: every row once."""
    if strategy not in STRATEGIES:
        raise ValueError(f"pack_strategy must be one of {STRATEGIES}, got {strategy!r}")
    lengths = _lengths(table)
    samples = np.arange(len(lengths)) if samples is None else np.asarray(samples, dtype=np.int64)
    lengths = lengths[samples]
    base = _sample_order(len(lengths), shuffle, seed)
    if strategy == "bfd":
        bins = best_fit_decreasing(lengths[base], max_length)
        order = np.array([base[i] for b in bins for i in b], dtype=np.int64)
        piece_lengths = lengths[order]
        counts = np.array([len(b) for b in bins], dtype=np.int64)
        split = 0
    else:
        order = base
        piece_lengths, counts, split = _concat_cuts(lengths[order], max_length)
    packed = assemble(table, samples[order], piece_lengths, counts)
    return packed, _stats(packed, len(lengths), max_length, split)


def unpacked_table(table: pa.Table, samples: np.ndarray | None = None) -> pa.Table:
    """One sample per row, in order (``samples``: row indices of ``table``, as ``pack_table`` takes them),
    with position_ids and sample_lengths added."""
    lengths = _lengths(table)
    samples = np.arange(len(lengths)) if samples is None else np.asarray(samples, dtype=np.int64)
    return assemble(table, samples, lengths[samples], np.ones(len(samples), dtype=np.int64))


def _lengths(table: pa.Table) -> np.ndarray:
    import pyarrow.compute as pc
    return pc.list_value_length(table["input_ids"]).to_numpy(zero_copy_only=False).astype(np.int64)


def _concat_cuts(lengths: np.ndarray, max_length: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Pieces and rows of concat-and-cut: boundaries = sample ends ∪ multiples of max_length.

    >>> _concat_cuts(np.array([3, 4]), 5)
    (array([3, 2, 2]), array([2, 1]), 1)
    """
    total = int(lengths.sum())
    sample_ends = np.cumsum(lengths)
    cuts = np.arange(max_length, total, max_length)
    bounds = np.union1d(sample_ends, cuts)
    bounds = bounds[bounds > 0]
    piece_lengths = np.diff(np.concatenate([[0], bounds])).astype(np.int64)
    row_of_piece = (bounds - 1) // max_length  # a piece lies in one row: its last token decides
    counts = np.bincount(row_of_piece, minlength=-(-total // max_length)).astype(np.int64)
    starts = sample_ends - lengths
    inner_cuts = np.searchsorted(cuts, sample_ends, "left") - np.searchsorted(cuts, starts, "right")
    return piece_lengths, counts, int((inner_cuts > 0).sum())


def _stats(packed: pa.Table, samples: int, max_length: int, split: int) -> PackStats:
    lengths = packed["length"].to_numpy()
    labels = pa.chunked_array(packed["labels"]).combine_chunks()
    trained = labels.flatten().to_numpy(zero_copy_only=False) != IGNORE_INDEX  # [tokens] bool
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    per_row = np.add.reduceat(trained, starts) if len(lengths) else np.zeros(0)
    return PackStats(samples=samples, rows=packed.num_rows, tokens=int(lengths.sum()),
                     capacity=packed.num_rows * max_length, split_samples=split,
                     rows_without_labels=int((per_row == 0).sum()), max_length=max_length)


# ---------------------------------------------------------------------------
# The stream's packer: the same best fit, a buffer at a time, on Python lists.

Sample = dict  # {"input_ids": [...], "labels": [...]}: one encoded conversation


def concat_samples(samples: list[Sample]) -> Sample:
    """Join encoded samples into one row with restarting ``position_ids``.

    >>> concat_samples([{'input_ids': [1, 2], 'labels': [-100, 2]}, {'input_ids': [3], 'labels': [3]}])
    {'input_ids': [1, 2, 3], 'labels': [-100, 2, 3], 'position_ids': [0, 1, 0], 'sample_lengths': [2, 1]}
    """
    row: Sample = {"input_ids": [], "labels": [], "position_ids": [], "sample_lengths": []}
    for s in samples:
        n = len(s["input_ids"])
        row["input_ids"].extend(s["input_ids"])
        row["labels"].extend(s["labels"])
        row["position_ids"].extend(range(n))
        row["sample_lengths"].append(n)
    return row


def pack_buffer(samples: list[Sample], max_length: int, final: bool) -> tuple[list[Sample], list[Sample]]:
    """Pack one buffer: return (full rows, samples carried into the next buffer).

    Unless ``final``, rows at most half full are carried over rather than
    emitted; best fit leaves at most one such row, so the carry is bounded by
    ``max_length`` tokens.
    """
    lengths = np.array([len(s["input_ids"]) for s in samples], dtype=np.int64)
    if len(lengths) and lengths.max() > max_length:
        raise DatasetError(f"an encoded sample has {lengths.max()} tokens, more than max_length={max_length}; "
                           "truncate to max_length when encoding")
    bins = best_fit_decreasing(lengths, max_length) if len(lengths) else []
    rows, carry = [], []
    for b in bins:
        members = [samples[i] for i in sorted(b)]  # keep stream order inside a row
        if not final and 2 * sum(len(s["input_ids"]) for s in members) <= max_length:
            carry.extend(members)
        else:
            rows.append(concat_samples(members))
    return rows, carry


def pack_stream(samples: Iterable[Sample], max_length: int, buffer_size: int,
                rng: random.Random | None) -> Iterator[Sample]:
    """Pack an endless or finite stream buffer by buffer, rows shuffled within a buffer by ``rng``
    (in packing order when it is None)."""
    buffer: list[Sample] = []
    for sample in samples:
        buffer.append(sample)
        if len(buffer) >= buffer_size:
            rows, buffer = pack_buffer(buffer, max_length, final=False)
            if rng is not None:
                rng.shuffle(rows)
            yield from rows
    rows, _ = pack_buffer(buffer, max_length, final=True)
    if rng is not None:
        rng.shuffle(rows)
    yield from rows


def single_sample_row(sample: Sample) -> Sample:
    """An unpacked row: one sample, positions from 0."""
    return concat_samples([sample])
