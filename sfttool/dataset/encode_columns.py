"""The encoder's samples as flat numpy arrays, cut at ``max_length`` and counted into columns.

Both modes of ``encode`` end here. Template mode hands over each sample's pieces as ``(token ids,
trained)``; chat-template mode hands over each sample's ids with their character offsets and the
trained character spans. Either way every token of the batch is read once into one flat array
(``FlatSamples``: ids, labels and each sample's length, samples end to end, uncut), and the columns
are computed over the whole batch at once::

    >>> flat = piece_samples([[([1, 2], False), ([3], True)]])
    >>> columns = flat_columns(flat, 2, why_untrained=lambda i: -2)
    >>> columns = list_columns(columns)
    >>> columns['input_ids'], columns['labels'], columns['num_tokens'], columns['first_trained']
    ([[1, 2]], [[-100, -100]], [3], [2])

``input_ids`` and ``labels`` of ``flat_columns`` are the kept tokens of every sample, end to end;
``list_columns``, ``numpy_columns`` and ``arrow_columns`` split them per sample in the form each
reader wants (Python lists for the stream and the preference encoder, one numpy array per row or one
Arrow table for ``datasets.map`` to write as it is).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from sfttool.utils.constants import IGNORE_INDEX


@dataclass
class FlatSamples:
    """Samples laid end to end, uncut."""
    ids: np.ndarray      # [tokens] int32
    labels: np.ndarray   # [tokens] int32: the id where trained, else IGNORE_INDEX
    lengths: np.ndarray  # [samples] int64


def piece_samples(samples: Sequence[Sequence[tuple[Sequence[int], bool]]]) -> FlatSamples:
    """Samples given as pieces ``(token ids, trained)``: a piece's tokens are labelled with their ids when it
    is trained.

    >>> piece_samples([[([5, 6], False), ([7], True)]]).labels.tolist()
    [-100, -100, 7]
    """
    parts = [part for sample in samples for part in sample]
    part_lengths = np.fromiter((len(ids) for ids, _ in parts), np.int64, len(parts))  # [pieces]
    trained = np.fromiter((flag for _, flag in parts), bool, len(parts))
    ids = np.fromiter(itertools.chain.from_iterable(ids for ids, _ in parts), np.int32, int(part_lengths.sum()))
    labels = np.where(np.repeat(trained, part_lengths), ids, np.int32(IGNORE_INDEX))
    owner = np.repeat(np.arange(len(samples)), [len(sample) for sample in samples])  # [pieces]: its sample
    lengths = np.bincount(owner, weights=part_lengths, minlength=len(samples)).astype(np.int64)
    return FlatSamples(ids, labels, lengths)


def span_samples(encoded: Sequence[tuple[Sequence[int], Sequence[tuple[int, int]]]], texts: Sequence[str],
                 spans: Sequence[Sequence[tuple[int, int]]]) -> FlatSamples:
    """Samples given as token ids with their character offsets in ``texts``: a token is trained when it overlaps
    one of its sample's trained character spans (sorted, not overlapping). A token that straddles a span's
    edge (a BPE token ``" It"`` whose space ends the prompt) is trained: the model has to produce it.

    >>> span_samples([([1, 2, 3], [(0, 2), (2, 4), (4, 5)])], ['abcde'], [[(3, 5)]]).labels.tolist()
    [-100, 2, 3]
    """
    lengths = np.fromiter((len(ids) for ids, _ in encoded), np.int64, len(encoded))  # [samples]
    total = int(lengths.sum())
    ids = np.fromiter(itertools.chain.from_iterable(ids for ids, _ in encoded), np.int32, total)
    offsets = np.fromiter(itertools.chain.from_iterable(itertools.chain.from_iterable(o for _, o in encoded)),
                          np.int64, 2 * total).reshape(total, 2)  # [tokens, (start, end)]
    # Characters are numbered across the batch, each text after the one before it, so one sorted search
    # finds every token's span.
    base = np.cumsum([0] + [len(text) for text in texts], dtype=np.int64)[:-1]  # [samples]
    starts, ends = (offsets + np.repeat(base, lengths)[:, None]).T
    bounds = np.array([(b + start, b + end) for b, own in zip(base.tolist(), spans) for start, end in own],
                      np.int64).reshape(-1, 2)  # [spans, (start, end)]
    return FlatSamples(ids, _labels_inside(ids, starts, ends, bounds), lengths)


def byte_span_samples(encoded: Sequence[Sequence[int]], texts: Sequence[str],
                      spans: Sequence[Sequence[tuple[int, int]]], byte_lengths: np.ndarray) -> FlatSamples | None:
    """``span_samples`` from the ids alone, for a tokenizer whose tokens each stand for a known number of the
    text's UTF-8 bytes (``token_bytes.byte_lengths``): the tokens' positions are the running sum of their byte
    lengths, in bytes instead of characters (a token overlaps a span's bytes exactly when it overlaps its
    characters), and the tokenizer need not compute and hand over every token's offsets. None when a text's
    tokens do not add up to its bytes (the caller asks the tokenizer for offsets then).

    >>> byte_span_samples([[1, 2, 3]], ['abcde'], [[(3, 5)]], np.array([0, 2, 2, 1])).labels.tolist()
    [-100, 2, 3]
    """
    lengths = np.fromiter((len(ids) for ids in encoded), np.int64, len(encoded))  # [samples]
    total = int(lengths.sum())
    ids = np.fromiter(itertools.chain.from_iterable(encoded), np.int32, total)
    if total and int(ids.max()) >= len(byte_lengths):
        return None
    sizes_of_tokens = byte_lengths[ids]  # [tokens]
    ends = np.cumsum(sizes_of_tokens, dtype=np.int64)  # [tokens]: bytes numbered across the batch
    starts = ends - sizes_of_tokens
    ascii_text = [text.isascii() for text in texts]
    sizes = np.fromiter((len(t) if a else len(t.encode("utf-8")) for t, a in zip(texts, ascii_text)),
                        np.int64, len(texts))  # [samples]
    text_ends = np.cumsum(sizes)
    token_ends = ends[np.cumsum(lengths)[lengths > 0] - 1]  # [non-empty samples]: where its tokens end
    if not np.array_equal(token_ends, text_ends[lengths > 0]) or (total and ends[-1] != text_ends[-1]):
        return None
    base = (text_ends - sizes).tolist()

    def at(text: str, is_ascii: bool, char: int) -> int:
        return char if is_ascii else len(text[:char].encode("utf-8"))

    bounds = np.array([(b + at(t, a, start), b + at(t, a, end))
                       for b, t, a, own in zip(base, texts, ascii_text, spans) for start, end in own],
                      np.int64).reshape(-1, 2)  # [spans, (start, end)] in bytes
    return FlatSamples(ids, _labels_inside(ids, starts, ends, bounds), lengths)


def _labels_inside(ids: np.ndarray, starts: np.ndarray, ends: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """Each token's id where ``[start, end)`` overlaps one of ``bounds`` (sorted, not overlapping), else
    IGNORE_INDEX; positions numbered across the batch."""
    inside = np.zeros(len(ids), bool)
    if len(bounds):
        k = np.searchsorted(bounds[:, 1], starts, side="right")  # the first span ending after the token starts
        found = k < len(bounds)
        inside[found] = ends[found] > bounds[k[found], 0]
    return np.where(inside, ids, np.int32(IGNORE_INDEX))


def flat_columns(flat: FlatSamples, max_length: int | np.ndarray, why_untrained: Callable[[int], int]
                 ) -> dict[str, np.ndarray]:
    """The encoder's columns over every token of the batch at once: ``input_ids`` and ``labels`` of every
    sample kept at ``max_length`` (one for all, or one per sample: image rows are cut before an image
    that the cut would split), flat ([kept tokens]); per sample ([samples]): ``length`` (after the cut),
    ``num_tokens`` (before it), ``num_trained`` (kept tokens with a label) and ``first_trained``, the
    position of the first trained token of the whole sample (the prompt's length), or, when none is
    trained, ``why_untrained(sample)`` (a negative code)."""
    ids, labels, full = flat.ids, flat.labels, flat.lengths
    n, total = len(full), len(ids)
    sample = np.repeat(np.arange(n), full)  # [tokens]
    position = np.arange(total) - np.repeat(np.cumsum(full) - full, full)  # [tokens]: in its sample
    limit = max_length if np.isscalar(max_length) else np.repeat(max_length, full)  # [tokens] when per sample
    kept, trained = position < limit, labels != IGNORE_INDEX
    first = np.full(n, -1, np.int64)
    at = np.flatnonzero(trained)  # [trained tokens], in order
    owner = sample[at]  # sorted: each sample's first trained token is where the owner changes (no sort needed)
    starts = np.ones(len(at), bool)
    np.not_equal(owner[1:], owner[:-1], out=starts[1:])
    first[owner[starts]] = position[at[starts]]
    for i in np.flatnonzero(first < 0):
        first[i] = why_untrained(int(i))
    return {"input_ids": ids[kept], "labels": labels[kept],
            "length": np.minimum(full, max_length).astype(np.int32), "num_tokens": full.astype(np.int32),
            "num_trained": np.bincount(sample[trained & kept], minlength=n).astype(np.int32),
            "first_trained": first.astype(np.int32)}


def list_columns(columns: dict[str, np.ndarray]) -> dict[str, list]:
    """``flat_columns`` as Python lists: ``input_ids`` and ``labels`` one list per sample."""
    ends = np.cumsum(columns["length"], dtype=np.int64).tolist()
    starts = [0] + ends[:-1]
    # Each sample's slice made a list: one copy of the tokens, where the whole array's list sliced makes two.
    return {name: [values[a:b].tolist() for a, b in zip(starts, ends)] if name in ("input_ids", "labels")
            else values.tolist() for name, values in columns.items()}


def numpy_columns(columns: dict[str, np.ndarray]) -> dict[str, list | np.ndarray]:
    """``flat_columns`` with ``input_ids`` and ``labels`` split into one numpy array per sample
    (``datasets`` writes a list of numpy arrays as one Arrow list array)."""
    columns = dict(columns)
    cuts = np.cumsum(columns["length"])[:-1]
    for name in ("input_ids", "labels"):  # np.split of nothing gives one part
        columns[name] = np.split(columns[name], cuts) if len(columns["length"]) else []
    return columns


def arrow_columns(columns: dict[str, np.ndarray], extra: dict[str, Sequence]):
    """``flat_columns`` (and the ``extra`` columns, one value per sample) as one Arrow table: the token columns
    are list arrays over the flat tokens and their offsets, with no array per sample."""
    import pyarrow as pa
    columns = dict(columns)
    offsets = pa.array(np.concatenate([[0], np.cumsum(columns["length"], dtype=np.int64)]).astype(np.int32))
    for name in ("input_ids", "labels"):
        columns[name] = pa.ListArray.from_arrays(offsets, pa.array(columns[name]))
    return pa.table({**columns, **extra})
