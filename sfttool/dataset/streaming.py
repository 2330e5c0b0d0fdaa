"""Streaming datasets: encode and pack on the fly, for corpora too large to preprocess.

``StreamingPackedDataset`` wraps any iterable of raw rows (a list, a generator,
a ``datasets.IterableDataset`` from ``load_dataset(..., streaming=True)``) and
yields the same encoded rows as the map-style pipeline (contract: ``input_ids``,
``labels``, ``position_ids``, ``sample_lengths``). Memory is bounded by the
buffer: it reads ``buffer_size`` encoded samples, packs them best-fit-decreasing
into rows of at most ``max_length`` tokens, and yields the rows in a seeded
order. Nothing is split and nothing is dropped: the one row per buffer that is
at most half full (best fit leaves at most one) goes back into the next buffer,
and the last buffer is flushed whole.

    >>> ds = StreamingPackedDataset(rows, tokenizer, max_length=2048, template_map_fn=..., seed=0)
    >>> next(iter(ds))['sample_lengths']
    [1021, 640, 380, 7]
"""
from __future__ import annotations

import itertools
import random
from typing import Any, Iterable, Iterator

import numpy as np
import torch

from sfttool.dataset.errors import DatasetError
from sfttool.dataset.pack import best_fit_decreasing
from sfttool.registry import BUILDER, build_if_config

Sample = dict[str, Any]  # {'input_ids': [...], 'labels': [...]}: one encoded conversation


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
                rng: random.Random) -> Iterator[Sample]:
    """Pack an endless or finite stream buffer by buffer, rows shuffled within a buffer."""
    buffer: list[Sample] = []
    for sample in samples:
        buffer.append(sample)
        if len(buffer) >= buffer_size:
            rows, buffer = pack_buffer(buffer, max_length, final=False)
            rng.shuffle(rows)
            yield from rows
    rows, _ = pack_buffer(buffer, max_length, final=True)
    rng.shuffle(rows)
    yield from rows


def single_sample_row(sample: Sample) -> Sample:
    """An unpacked row: one sample, positions from 0."""
    return concat_samples([sample])


def _reader() -> tuple[int, int, int, int]:
    """(rank, world size, dataloader worker, workers) of this reader."""
    rank, world = 0, 1
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    info = torch.utils.data.get_worker_info()
    worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
    return rank, world, worker, workers


def _is_hf_iterable(source: Any) -> bool:
    try:
        import datasets
    except ImportError:
        return False
    return isinstance(source, datasets.IterableDataset)


def _shard(source: Iterable, rank: int, world: int, worker: int, workers: int) -> Iterable:
    """This reader's share of the raw rows; every row goes to exactly one reader."""
    if _is_hf_iterable(source):
        # datasets splits by file shards when it can (rows otherwise) and, iterated
        # inside a dataloader worker, shares its shards among workers by itself.
        if world == 1:
            return source
        from datasets.distributed import split_dataset_by_node
        return split_dataset_by_node(source, rank=rank, world_size=world)
    count, index = world * workers, rank * workers + worker
    return source if count == 1 else itertools.islice(source, index, None, count)


def chunks(rows: Iterable[dict], size: int) -> Iterator[list[dict]]:
    """``[r0, r1, r2], 2 -> [r0, r1], [r2]``: rows are encoded a chunk at a time (batched tokenizer)."""
    it = iter(rows)
    while chunk := list(itertools.islice(it, size)):
        yield chunk


class StreamingEncoder:
    """Raw rows -> encoded samples through the same stages as ``process_hf_dataset``:
    dataset map fn, template map fn, encode (truncated to ``max_length``).
    Samples without a trained token are skipped and counted in ``skipped``."""

    def __init__(self, tokenizer: Any, max_length: int, dataset_map_fn: Any = None,
                 template_map_fn: Any = None, input_ids_with_output: bool = True):
        from sfttool.dataset.pipeline import resolve_map_fn, resolve_template_map_fn, template_of
        from sfttool.utils.templates import is_hf_chat_template

        self.tokenizer = build_if_config(tokenizer, "tokenizer")
        self.max_length = max_length
        self.dataset_map_fn = resolve_map_fn(dataset_map_fn)
        self.hf_chat_template = is_hf_chat_template(template_of(template_map_fn))
        self.template_map_fn = None if self.hf_chat_template else resolve_template_map_fn(template_map_fn)
        self.input_ids_with_output = input_ids_with_output
        self.skipped = 0

    def _standard(self, row: dict) -> dict:
        for fn in (self.dataset_map_fn, self.template_map_fn):
            if fn is not None:
                row = {**row, **fn(row)}
        return row

    def __call__(self, rows: list[dict], first_index: int = 0) -> list[Sample]:
        from sfttool.dataset.encode import encode_batch

        batch = {"conversation": [self._standard(r)["conversation"] for r in rows]}
        out = encode_batch(batch, range(first_index, first_index + len(rows)), self.tokenizer,
                           self.max_length, self.input_ids_with_output, self.hf_chat_template, "stream")
        samples = [{"input_ids": ids, "labels": labels}
                   for ids, labels, trained in zip(out["input_ids"], out["labels"], out["num_trained"]) if trained]
        self.skipped += len(rows) - len(samples)
        return samples


@BUILDER.register_module()
class StreamingPackedDataset(torch.utils.data.IterableDataset):
    """Encode raw rows as they stream in and pack them into rows of at most ``max_length``.

    Takes ``process_hf_dataset``'s arguments, so a config switches by changing ``type``::

        train_dataset = dict(type=StreamingPackedDataset,
                             dataset=dict(type=load_dataset, path='json', data_files='big.jsonl',
                                          split='train', streaming=True),
                             tokenizer=tokenizer, max_length=2048,
                             template_map_fn=dict(type=template_map_fn_factory, template=prompt_template),
                             buffer_size=2000, seed=0)

    ``buffer_size`` samples are packed together: larger packs tighter and holds
    more in memory. ``seed`` fixes the order; ``set_epoch(e)`` varies it per epoch.
    ``encode_chunk`` rows are tokenized per call. ``rows_per_epoch`` is the
    length the train loop counts iterations and epochs with (a stream has no
    length of its own): an estimate is fine, e.g. tokens / (max_length x 0.95);
    the stream itself always runs to its end.
    """

    def __init__(self, dataset: Any, tokenizer: Any, max_length: int, dataset_map_fn: Any = None,
                 template_map_fn: Any = None, pack_to_max_length: bool = True, buffer_size: int = 1000,
                 seed: int = 0, input_ids_with_output: bool = True, encode_chunk: int = 64,
                 rows_per_epoch: int | None = None):
        if buffer_size < 1 or encode_chunk < 1:
            raise DatasetError(f"buffer_size and encode_chunk must be at least 1, got {buffer_size}, {encode_chunk}")
        self.dataset = build_if_config(dataset, "dataset")
        self.encoder = StreamingEncoder(tokenizer, max_length, dataset_map_fn, template_map_fn,
                                        input_ids_with_output)
        self.max_length = max_length
        self.pack_to_max_length = pack_to_max_length
        self.buffer_size = buffer_size
        self.seed = seed
        self.encode_chunk = encode_chunk
        self.rows_per_epoch = rows_per_epoch
        self.epoch = 0

    def __len__(self) -> int:
        if self.rows_per_epoch is None:
            raise TypeError("StreamingPackedDataset has no length: set rows_per_epoch=N (an estimate of the "
                            "packed rows per epoch) so the train loop can count iterations and epochs")
        return self.rows_per_epoch

    def set_epoch(self, epoch: int) -> None:
        """Called by samplers/loops between epochs: a new, reproducible order."""
        self.epoch = epoch
        if hasattr(self.dataset, "set_epoch"):  # a shuffled datasets.IterableDataset reshuffles too
            self.dataset.set_epoch(epoch)

    def _samples(self, reader: tuple[int, int, int, int]) -> Iterator[Sample]:
        seen = 0
        for chunk in chunks(_shard(self.dataset, *reader), self.encode_chunk):
            yield from self.encoder(chunk, seen)
            seen += len(chunk)

    def __iter__(self) -> Iterator[Sample]:
        reader = _reader()
        samples = self._samples(reader)
        if not self.pack_to_max_length:
            return map(single_sample_row, samples)
        # One generator per (seed, epoch, reader): reruns give identical rows.
        rng = random.Random(f"{self.seed}-{self.epoch}-{reader}")
        return pack_stream(samples, self.max_length, self.buffer_size, rng)
