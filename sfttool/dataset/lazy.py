"""Lazy encoding of map-style data: ``process_hf_dataset(..., lazy_encode=True)``.

The data is loaded as ``process_hf_dataset`` loads it (Arrow, memory-mapped, rows numbered as in the
file, ``max_dataset_length``'s seeded subset; local JSON is not checked line by line first, each row is
checked when it is read), but nothing is mapped, templated or tokenized before training: the stream's
stages (``streaming.StreamingEncoder``) run a chunk of rows at a time when the dataloader asks for them,
in its workers, and packing is the stream's buffered best fit
(``pack.pack_stream``). A file of ten million rows starts training once it is loaded.

Each epoch reads every row once, in an order seeded by ``seed`` and the epoch (file order with
``shuffle_before_pack=False``), split between the ranks and then between the dataloader workers.
A row a stage drops is skipped and counted; each reader logs its pass's counts when the pass ends
(rows in, samples, rows out, every drop by cause with the first row numbers)::

    Lazy epoch 0: 10000 rows in, 9998 samples in 2412 rows out, 1843201 tokens
    Lazy epoch 0: dropped 2 rows: empty conversation (row 17, row 4410)

    train_dataset = dict(type=process_hf_dataset, dataset=..., tokenizer=tokenizer, max_length=2048,
                         template_map_fn=..., lazy_encode=True, buffer_size=1000, seed=seed)
    train_dataloader = dict(dataset=train_dataset, sampler=None, ...)  # the dataset orders itself
"""
from __future__ import annotations

import logging
import math
from typing import Any, Iterator

import numpy as np

from sfttool.dataset.errors import ROW_COLUMN, DatasetError
from sfttool.dataset.image_rows import IMAGES_COLUMN, LLAVA_COLUMN
from sfttool.dataset.pack import pack_stream
from sfttool.dataset.report import PipelineReport, log
from sfttool.dataset.resolve import source_name
from sfttool.dataset.rows import load_rows
from sfttool.dataset.settings import LAZY_SETTINGS, check_lazy_settings
from sfttool.dataset.streaming import StreamingPackedDataset, _reader

# Rows encoded when the dataset is built, to estimate the packed rows of an epoch (``rows_per_epoch``).
ESTIMATE_ROWS = 1000

# process_hf_dataset's arguments that only lazy encoding reads, with their defaults there.
# process_hf_dataset's pipeline arguments lazy encoding knows (reads, refuses or ignores); another one set is
# refused rather than ignored.
PIPELINE_ARGS = ("dataset", "tokenizer", "max_length", "dataset_map_fn", "template_map_fn", "max_dataset_length",
                 "split", "remove_unused_columns", "rename_maps", "shuffle_before_pack", "pack_to_max_length",
                 "input_ids_with_output", "map_num_proc", "seed", "pack_strategy", "do_dataset_tokenization",
                 "source", "skip_bad_rows")


def lazy_dataset(args: dict, lazy_encode: bool, buffer_size: int | None,
                 encode_chunk: int | None, rows_per_epoch: int | None, use_varlen_attn: bool,
                 cache_dir: str | None) -> "LazyEncodedDataset":
    """``process_hf_dataset(lazy_encode=True, ...)`` (``args``: its pipeline arguments): a
    ``LazyEncodedDataset`` of the rows ``rows.load_rows`` loads. What would change the rows is refused; what
    has no meaning here is ignored with one warning; a lazy-only setting without ``lazy_encode=True`` is an
    error."""
    given = dict(buffer_size=buffer_size, encode_chunk=encode_chunk, rows_per_epoch=rows_per_epoch)
    check_lazy_settings(lazy_encode, given, args["rename_maps"], args["do_dataset_tokenization"],
                        args["pack_strategy"])
    unknown = [name for name, value in args.items() if name not in PIPELINE_ARGS and value not in (None, False)]
    if unknown:
        raise DatasetError(f"{', '.join(unknown)}: not available with lazy_encode=True; remove lazy_encode")
    warn_ignored(args["map_num_proc"], cache_dir)
    settings = {name: LAZY_SETTINGS[name] if value is None else value for name, value in given.items()}
    source = args["source"] or source_name(args["dataset"])
    # Local JSON is not checked line by line first (a pass over the file in every process, as long as the
    # tokenizing it spares): each row is checked when it is read, and a line Arrow cannot read is named
    # by file and line when the file is converted (``source.read_failure``).
    rows = load_rows(args["dataset"], args["split"], args["max_dataset_length"], args["seed"], validate=False)
    refuse_image_rows(rows, source)
    keep = ("dataset_map_fn", "template_map_fn", "pack_to_max_length", "seed", "input_ids_with_output",
            "shuffle_before_pack", "skip_bad_rows")
    return LazyEncodedDataset(rows, args["tokenizer"], args["max_length"], source=source,
                              use_varlen_attn=use_varlen_attn, **{name: args[name] for name in keep}, **settings)


def refuse_image_rows(rows: Any, source: str | None) -> None:
    """Rows with an image column: their images need the image stage (``processor=...``), which runs eagerly."""
    columns = [name for name in (IMAGES_COLUMN, LLAVA_COLUMN) if name in rows.column_names]
    if columns:
        raise DatasetError(f"{source or 'dataset'}: rows with images (a {' and '.join(repr(c) for c in columns)} "
                           "column) are not encoded lazily; remove lazy_encode")


def warn_ignored(map_num_proc: int | None, cache_dir: str | None) -> None:
    """Rows hold only the token columns whatever ``remove_unused_columns`` says (the collate fn reads no other)."""
    why = {"map_num_proc": (map_num_proc, "rows are encoded as they are read, in the dataloader workers "
                                          "(num_workers)"),
           "cache_dir": (cache_dir, "nothing is encoded ahead to cache")}
    ignored = [f"{name} ({reason})" for name, (value, reason) in why.items() if value is not None]
    if ignored:
        log("lazy_encode: ignoring what does not apply to lazy encoding: " + "; ".join(ignored), logging.WARNING)


def rank_rows(order: np.ndarray, rank: int, world: int) -> np.ndarray:
    """Rank ``rank``'s share of an epoch's row order: every ``world``-th row.

    >>> rank_rows(np.arange(7), 1, 2)
    array([1, 3, 5])
    """
    return order[rank::world]


class LazyEncodedDataset(StreamingPackedDataset):
    """Loaded rows (a numbered ``datasets.Dataset``, ``rows.load_rows``) encoded as they are read
    (module docstring).

    ``len()``: the rows one rank reads per epoch: without packing, its share of the rows (fewer come
    out when rows are dropped); with packing, ``rows_per_epoch`` or an estimate from the first
    ``ESTIMATE_ROWS`` rows of epoch 0, encoded and packed when the dataset is built. The train loop
    counts epochs with it; a resume lands on the exact batch either way (the loop checkpoints its
    data position).
    """

    pass_kind = "Lazy"

    def __init__(self, rows: Any, tokenizer: Any, max_length: int, dataset_map_fn: Any = None,
                 template_map_fn: Any = None, pack_to_max_length: bool = True, buffer_size: int = 1000,
                 seed: int = 0, input_ids_with_output: bool = True, encode_chunk: int = 64,
                 rows_per_epoch: int | None = None, source: str | None = None, shuffle_before_pack: bool = True,
                 use_varlen_attn: bool = False, skip_bad_rows: bool = False):
        if len(rows) == 0:
            raise DatasetError(f"{source or 'dataset'}: no rows to train on: the dataset is empty")
        super().__init__(rows, tokenizer, max_length, dataset_map_fn, template_map_fn,
                         pack_to_max_length=pack_to_max_length, buffer_size=buffer_size, seed=seed,
                         input_ids_with_output=input_ids_with_output, encode_chunk=encode_chunk,
                         rows_per_epoch=rows_per_epoch, source=source, shuffle_before_pack=shuffle_before_pack,
                         use_varlen_attn=use_varlen_attn, skip_bad_rows=skip_bad_rows)
        self.rows = len(rows)
        if pack_to_max_length and rows_per_epoch is None:
            self.rows_per_epoch = self.estimate_packed_rows()

    def order(self, epoch: int) -> np.ndarray:
        """The rows of an epoch, as indices of the loaded dataset: seeded by (seed, epoch)."""
        if not self.shuffle_before_pack:
            return np.arange(self.rows)
        return np.random.default_rng([self.seed, epoch]).permutation(self.rows)

    def _raw_rows(self, reader: tuple[int, int, int, int], epoch: int) -> Iterator[tuple[int, Any]]:
        """This reader's rows of the epoch: its rank's share, then every ``workers``-th row of it."""
        rank, world, worker, workers = reader
        mine = rank_rows(self.order(epoch), rank, world)[worker::workers]
        for start in range(0, len(mine), self.encode_chunk):
            yield from self._read(mine[start:start + self.encode_chunk])

    def _read(self, indices: np.ndarray) -> Iterator[tuple[int, dict]]:
        """``(row number as loaded, raw row)`` of the loaded dataset's rows ``indices`` (one Arrow take)."""
        columns = self.dataset[indices.tolist()]
        numbers = columns.pop(ROW_COLUMN)
        for k, number in enumerate(numbers):
            yield number, {name: values[k] for name, values in columns.items()}

    def __len__(self) -> int:
        return self.rank_share() if self.rows_per_epoch is None else self.rows_per_epoch

    def rank_share(self) -> int:
        """The rows this rank reads per epoch (``rank_rows``)."""
        rank, world, _, _ = _reader()
        return len(range(rank, self.rows, world))

    def estimate_packed_rows(self) -> int:
        """Packed rows one rank reads per epoch, from the first rows of epoch 0 encoded and packed as the
        epoch packs them (``buffer_size`` at a time): the rank's rows x tokens per row / tokens per packed row.
        Exact for one reader of a dataset of at most ``ESTIMATE_ROWS`` rows."""
        share = self.rank_share()
        first = self.order(0)[:min(self.rows, ESTIMATE_ROWS)]
        samples = self.encoder(list(self._read(first)), self.source, PipelineReport())
        if not samples:
            return share  # every row of the sample dropped: one packed row per row (each epoch logs its count)
        rows = sum(1 for _ in pack_stream(samples, self.max_length, self.buffer_size, None))
        tokens = sum(len(s["input_ids"]) for s in samples)
        estimate = max(1, math.ceil(share * rows / len(first)))
        log(f"Lazy encoding: {self.rows} rows; about {estimate} packed rows per rank per epoch (the first "
            f"{len(first)} rows encoded: {tokens / len(first):.1f} tokens per row, {tokens / rows:.1f} per packed "
            "row; rows_per_epoch sets it)")
        return estimate
