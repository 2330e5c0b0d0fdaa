"""Streaming datasets: encode and pack on the fly, for corpora too large to preprocess.

``StreamingPackedDataset`` wraps any source of raw rows that can be read more than
once (a list, a ``datasets.IterableDataset`` from ``load_dataset(..., streaming=True)``,
or the config of either; not a generator, which a second epoch would find empty) and
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
import logging
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import numpy as np
import torch

from sfttool.dataset.encode import check_conversation, encode_batch
from sfttool.dataset.errors import DatasetError, check_positive_int, where
from sfttool.dataset.pack import best_fit_decreasing
from sfttool.dataset.pipeline import log
from sfttool.dataset.resolve import SafeMapFn, dataset_config, fn_name, source_name
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


# ---------------------------------------------------------------------------
# Readers: who reads which rows.

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


def _shard(source: Iterable, rank: int, world: int, worker: int, workers: int,
           epoch: int = 0) -> Iterator[tuple[int, Any]]:
    """This reader's share of the raw rows as ``(row number, row)``; every row goes to exactly one reader.

    The number is the row's index in the source whatever the split, except for a
    ``datasets.IterableDataset`` read by several readers: datasets hands each reader
    whole files where it can, so there the number counts within the reader's share.
    """
    if _is_hf_iterable(source) and world > 1:
        # datasets splits by file shards when it can (rows otherwise) and, iterated
        # inside a dataloader worker, shares its shards among workers by itself.
        from datasets.distributed import split_dataset_by_node
        source = split_dataset_by_node(source, rank=rank, world_size=world)
    if hasattr(source, "set_epoch"):
        # Set here, on the copy this reader iterates: split_dataset_by_node's copy starts at
        # epoch 0, and a persistent worker's copy never sees the main process's set_epoch.
        source.set_epoch(epoch)
    if _is_hf_iterable(source):
        return enumerate(source)
    count, index = world * workers, rank * workers + worker
    return ((i, row) for i, row in enumerate(source) if i % count == index)


def chunks(rows: Iterable, size: int) -> Iterator[list]:
    """``[r0, r1, r2], 2 -> [r0, r1], [r2]``: rows are encoded a chunk at a time (batched tokenizer)."""
    it = iter(rows)
    while chunk := list(itertools.islice(it, size)):
        yield chunk


# ---------------------------------------------------------------------------
# Encoding, with what each pass dropped or cut counted.

DROP_EMPTY = "empty conversation"  # the reasons process_hf_dataset logs
DROP_UNTRAINED = "no trained token (answer empty, masked or truncated away)"


@dataclass
class PassStats:
    """What one reader's pass did; logged when the pass ends, as process_hf_dataset logs its stages."""
    rows_in: int = 0
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> rows
    truncated: int = 0
    tokens_cut: int = 0
    samples: int = 0
    rows_out: int = 0
    tokens: int = 0

    def drop(self, reason: str, count: int) -> None:
        if count:
            self.dropped[reason] = self.dropped.get(reason, 0) + count


def reader_name(reader: tuple[int, int, int, int]) -> str:
    """``(1, 2, 0, 2) -> 'rank 1, dataloader worker 0'``; empty for the only reader."""
    rank, world, worker, workers = reader
    parts = ([f"rank {rank}"] if world > 1 else []) + ([f"dataloader worker {worker}"] if workers > 1 else [])
    return ", ".join(parts)


def log_pass(stats: PassStats, epoch: int, reader: tuple[int, int, int, int], max_length: int) -> None:
    name = reader_name(reader)
    who = f"Stream epoch {epoch}" + (f" ({name})" if name else "")
    log(f"{who}: {stats.rows_in} rows in, {stats.samples} samples in {stats.rows_out} rows out, "
        f"{stats.tokens} tokens")
    for reason, count in stats.dropped.items():
        log(f"{who}: dropped {count} rows: {reason}", logging.WARNING)
    if stats.truncated:
        log(f"{who}: truncated {stats.truncated} samples at max_length={max_length} "
            f"({stats.tokens_cut} tokens cut)", logging.WARNING)


def _is_empty(conversation: Any) -> bool:
    """Dropped and counted, as process_hf_dataset drops an empty or null conversation."""
    return conversation is None or (isinstance(conversation, list) and not conversation)


class StreamingEncoder:
    """``(row number, raw row)`` -> encoded samples through the same stages as ``process_hf_dataset``:
    dataset map fn, template map fn, encode (truncated to ``max_length``). Rows with an empty
    conversation or without a trained token are dropped; drops and cuts are counted in a ``PassStats``."""

    def __init__(self, tokenizer: Any, max_length: int, dataset_map_fn: Any = None,
                 template_map_fn: Any = None, input_ids_with_output: bool = True):
        from sfttool.dataset.resolve import resolve_map_fn, resolve_template_map_fn, template_of
        from sfttool.utils.templates import is_hf_chat_template

        self.tokenizer = build_if_config(tokenizer, "tokenizer")
        self.max_length = max_length
        self.dataset_map_fn = resolve_map_fn(dataset_map_fn)
        self.hf_chat_template = is_hf_chat_template(template_of(template_map_fn))
        self.template_map_fn = None if self.hf_chat_template else resolve_template_map_fn(template_map_fn)
        self.input_ids_with_output = input_ids_with_output

    def standard(self, row: Any, index: int, source: str | None) -> dict:
        """One raw row in the standard format; an error names the file, row and stage."""
        if not isinstance(row, Mapping):
            raise DatasetError(f"{where(index, source)}: expected a dict (one JSON object per row), "
                               f"got {type(row).__name__}")
        if self.dataset_map_fn is not None:
            mapped = SafeMapFn(self.dataset_map_fn, source)(row, index)
            if not isinstance(mapped, Mapping):
                raise DatasetError(f"{where(index, source)}: dataset_map_fn {fn_name(self.dataset_map_fn)} "
                                   f"returned {type(mapped).__name__}, not a dict")
            row = {**row, **mapped}
        if "conversation" not in row:
            raise DatasetError(f"{where(index, source)}: no `conversation` {self._conversation_hint(row)}")
        if self.template_map_fn is not None:
            if not _is_empty(row["conversation"]):  # a bad turn would fail in the template, unnamed
                check_conversation(row["conversation"], index, source, need_output=self.input_ids_with_output)
            row = {**row, **SafeMapFn(self.template_map_fn, source, role="template_map_fn")(row, index)}
        return row

    def _conversation_hint(self, row: Mapping) -> str:
        fields = ", ".join(map(str, row)) or "none"
        if self.dataset_map_fn is None:
            return (f"(fields: {fields}); data that is not in the standard format needs a dataset_map_fn "
                    "(e.g. alpaca_map_fn, sharegpt_map_fn)")
        return (f"after dataset_map_fn {fn_name(self.dataset_map_fn)} (fields: {fields}); it must return "
                "{'conversation': [{'input': ..., 'output': ...}]}")

    def __call__(self, rows: list[tuple[int, Any]], source: str | None, stats: PassStats) -> list[Sample]:
        conversations = [(index, self.standard(row, index, source)["conversation"]) for index, row in rows]
        stats.rows_in += len(rows)
        kept = [(index, c) for index, c in conversations if not _is_empty(c)]
        stats.drop(DROP_EMPTY, len(rows) - len(kept))
        if not kept:
            return []
        out = encode_batch({"conversation": [c for _, c in kept]}, [index for index, _ in kept], self.tokenizer,
                           self.max_length, self.input_ids_with_output, self.hf_chat_template, source)
        samples = []
        for ids, labels, full, trained in zip(out["input_ids"], out["labels"], out["num_tokens"], out["num_trained"]):
            if full > len(ids):
                stats.truncated += 1
                stats.tokens_cut += full - len(ids)
            if trained or not self.input_ids_with_output:  # process_hf_dataset keeps these too
                samples.append({"input_ids": ids, "labels": labels})
        stats.drop(DROP_UNTRAINED, len(kept) - len(samples))
        return samples


# ---------------------------------------------------------------------------
# Settings: process_hf_dataset's arguments, and what each means for a stream.

def check_settings(max_length: int, buffer_size: int, encode_chunk: int, rows_per_epoch: int | None,
                   pack_to_max_length: bool, use_varlen_attn: bool, pack_strategy: str) -> None:
    check_positive_int(max_length, "max_length")
    check_positive_int(buffer_size, "buffer_size")
    check_positive_int(encode_chunk, "encode_chunk")
    if rows_per_epoch is not None:
        check_positive_int(rows_per_epoch, "rows_per_epoch", " (the packed rows one rank reads per pass)")
    if use_varlen_attn and not pack_to_max_length:
        raise DatasetError("use_varlen_attn=True needs pack_to_max_length=True (as in XTuner)")
    if pack_strategy == "concat":
        raise DatasetError("pack_strategy='concat' (XTuner's cut, which splits samples across rows) is not "
                           "available when streaming: rows are packed best-fit-decreasing within a buffer and "
                           "no sample is split; remove pack_strategy, or use process_hf_dataset")
    if pack_strategy != "bfd":
        raise DatasetError(f"pack_strategy must be 'bfd' when streaming, got {pack_strategy!r}")


def refuse_changed_results(max_dataset_length: int | None, rename_maps: Any, with_image_token: bool,
                           do_dataset_tokenization: bool) -> None:
    """process_hf_dataset's arguments a stream cannot honour: ignoring them would change the rows."""
    if max_dataset_length is not None:
        raise DatasetError("max_dataset_length (a seeded random subset of a dataset of known length) is not "
                           "available when streaming; remove it, or stream a smaller source")
    if rename_maps:
        raise DatasetError("rename_maps is not available when streaming; rename the fields in a dataset_map_fn")
    if with_image_token:
        raise DatasetError("with_image_token (multimodal data) is not supported")
    if not do_dataset_tokenization:
        raise DatasetError("do_dataset_tokenization=False (pre-tokenized rows) is not available when streaming; "
                           "use process_hf_dataset or sfttool process-dataset")


NOT_APPLICABLE = {  # argument -> why a stream ignores it
    "map_num_proc": "rows are encoded as they are read, in the dataloader workers (num_workers)",
    "remove_unused_columns": "streamed rows hold only input_ids, labels, position_ids and sample_lengths",
    "cache_dir": "a stream is encoded anew every pass, nothing is cached",
}


def warn_not_applicable(given: dict[str, Any]) -> None:
    ignored = [f"{name} ({NOT_APPLICABLE[name]})" for name, value in given.items() if value is not None]
    if ignored:
        log("StreamingPackedDataset: ignoring what does not apply to streaming: " + "; ".join(ignored),
            logging.WARNING)


def resolve_source(dataset: Any, split: str) -> Any:
    """The built source of raw rows: ``split`` of a dict of splits, and never a one-shot iterator."""
    from datasets import DatasetDict, IterableDatasetDict

    dataset = build_if_config(dataset, "dataset")
    if isinstance(dataset, (DatasetDict, IterableDatasetDict)):
        if split not in dataset:
            raise DatasetError(f"dataset has no split {split!r} (it has {', '.join(dataset)}); set split=...")
        dataset = dataset[split]
    try:
        one_shot = iter(dataset) is dataset
    except TypeError:
        raise DatasetError(f"dataset must be an iterable of rows, got {type(dataset).__name__}") from None
    if one_shot:
        raise DatasetError(f"dataset is a one-shot iterator ({type(dataset).__name__}), but a stream is read "
                           "again every epoch and on resume: a source must support several passes; give a list, "
                           "a datasets.IterableDataset (load_dataset(..., streaming=True)) or a config")
    return dataset


# ---------------------------------------------------------------------------
# The dataset.

@BUILDER.register_module()
class StreamingPackedDataset(torch.utils.data.IterableDataset):
    """Encode raw rows as they stream in and pack them into rows of at most ``max_length``.

    Takes ``process_hf_dataset``'s arguments, so a config switches by changing ``type``
    (docs/scale.md lists what each means for a stream)::

        train_dataset = dict(type=StreamingPackedDataset,
                             dataset=dict(type=load_dataset, path='json', data_files='big.jsonl',
                                          split='train', streaming=True),
                             tokenizer=tokenizer, max_length=2048,
                             template_map_fn=dict(type=template_map_fn_factory, template=prompt_template),
                             buffer_size=2000, seed=0, rows_per_epoch=50_000)

    ``buffer_size`` samples are packed together: larger packs tighter and holds
    more in memory. ``seed`` fixes the order; ``set_epoch(e)`` varies it per epoch
    (``shuffle_before_pack=False``: rows in packing order). ``encode_chunk`` rows are
    tokenized per call. ``rows_per_epoch`` is the length the train loop counts
    iterations and epochs with (a stream has no length of its own): the packed rows
    *one rank* reads per pass, all its dataloader workers together. An estimate is
    fine; the stream itself always runs to its end, and a resume lands on the exact
    batch only when ``len(dataloader)`` equals the batches of a pass.
    """

    # The registry hands `dataset` over as its config, unbuilt, so that errors can name its files.
    build_args_lazily = ("dataset",)

    def __init__(self, dataset: Any, tokenizer: Any, max_length: int, dataset_map_fn: Any = None,
                 template_map_fn: Any = None, pack_to_max_length: bool = True, buffer_size: int = 1000,
                 seed: int = 0, input_ids_with_output: bool = True, encode_chunk: int = 64,
                 rows_per_epoch: int | None = None, split: str = "train", source: str | None = None,
                 shuffle_before_pack: bool = True, use_varlen_attn: bool = False, pack_strategy: str = "bfd",
                 max_dataset_length: int | None = None, rename_maps: Any = (), with_image_token: bool = False,
                 do_dataset_tokenization: bool = True, remove_unused_columns: bool | None = None,
                 map_num_proc: int | None = None, cache_dir: str | None = None):
        check_settings(max_length, buffer_size, encode_chunk, rows_per_epoch, pack_to_max_length,
                       use_varlen_attn, pack_strategy)
        refuse_changed_results(max_dataset_length, rename_maps, with_image_token, do_dataset_tokenization)
        warn_not_applicable(dict(map_num_proc=map_num_proc, remove_unused_columns=remove_unused_columns,
                                 cache_dir=cache_dir))
        dataset = dataset_config(dataset)
        self.source = source or source_name(dataset)  # the file(s) errors name
        self.dataset = resolve_source(dataset, split)
        self.encoder = StreamingEncoder(tokenizer, max_length, dataset_map_fn, template_map_fn,
                                        input_ids_with_output)
        self.max_length = max_length
        self.pack_to_max_length = pack_to_max_length
        self.shuffle_before_pack = shuffle_before_pack
        self.buffer_size = buffer_size
        self.seed = seed
        self.encode_chunk = encode_chunk
        self.rows_per_epoch = rows_per_epoch
        # In shared memory: persistent dataloader workers keep their copy of this dataset
        # between passes and must still see the epoch the main process sets.
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()
        self.pass_stats: PassStats | None = None  # the last pass read in this process

    def __len__(self) -> int:
        if self.rows_per_epoch is None:
            raise TypeError("StreamingPackedDataset has no length: set rows_per_epoch=N (an estimate of the "
                            "packed rows one rank reads per pass) so the train loop can count iterations and epochs")
        return self.rows_per_epoch

    @property
    def epoch(self) -> int:
        return int(self._epoch)

    def set_epoch(self, epoch: int) -> None:
        """Called by samplers/loops between epochs: a new, reproducible order (a shuffled
        ``datasets.IterableDataset`` source is reshuffled too, by each reader)."""
        self._epoch.fill_(epoch)

    def _share_name(self, reader: tuple[int, int, int, int]) -> str | None:
        """What errors name: the file(s), and whose share a row number counts in when datasets
        split the source (see ``_shard``)."""
        if _is_hf_iterable(self.dataset) and reader_name(reader):
            return f"{self.source or 'dataset'}, the rows read by {reader_name(reader)}"
        return self.source

    def _samples(self, rows: Iterable[tuple[int, Any]], source: str | None, stats: PassStats) -> Iterator[Sample]:
        for chunk in chunks(rows, self.encode_chunk):
            samples = self.encoder(chunk, source, stats)
            stats.samples += len(samples)
            yield from samples

    def __iter__(self) -> Iterator[Sample]:
        reader, epoch = _reader(), self.epoch
        stats = self.pass_stats = PassStats()
        samples = self._samples(_shard(self.dataset, *reader, epoch), self._share_name(reader), stats)
        if not self.pack_to_max_length:
            rows: Iterator[Sample] = map(single_sample_row, samples)
        else:
            # One generator per (seed, epoch, reader): reruns give identical rows.
            rng = random.Random(f"{self.seed}-{epoch}-{reader}") if self.shuffle_before_pack else None
            rows = pack_stream(samples, self.max_length, self.buffer_size, rng)
        for row in rows:
            stats.rows_out += 1
            stats.tokens += len(row["input_ids"])
            yield row
        log_pass(stats, epoch, reader, self.max_length)
