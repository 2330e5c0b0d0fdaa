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

    >>> ds = StreamingPackedDataset(rows, tokenizer, max_length=2048, template_map_fn=..., seed=0)  # doctest: +SKIP
    >>> next(iter(ds))['sample_lengths']  # doctest: +SKIP
    [1021, 640, 380, 7]
"""
from __future__ import annotations

import itertools
import logging
import random
from typing import Any, Iterable, Iterator

import torch

from sfttool.dataset.chat_format import renderer
from sfttool.dataset.conversation import check_conversation, is_empty
from sfttool.dataset.encode import encode_batch
from sfttool.dataset.errors import ROW_COLUMN, DatasetError, check_positive_int, where
# concat_samples and pack_buffer are imported from here too (benchmarks).
from sfttool.dataset.pack import Sample, concat_samples, pack_buffer, pack_stream, single_sample_row  # noqa: F401
from sfttool.dataset.settings import check_settings as check_pipeline_settings
from sfttool.dataset.report import PipelineReport, count_split, log, split_lines, warning_lines
from sfttool.dataset.resolve import dataset_config, pick_split, source_name
from sfttool.dataset.source import read_explained
from sfttool.dataset.stages import (check_dicts, count_ignored_fields, count_notes, drop_empty_rows,
                                    drop_untrained_rows, gc_paused, map_rows, missing_conversation, note_emptied)
from sfttool.registry import BUILDER, build_if_config


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
# Encoding: process_hf_dataset's stages (``stages``, ``encode``) on each chunk of rows.

def reader_name(reader: tuple[int, int, int, int]) -> str:
    """``(1, 2, 0, 2) -> 'rank 1, dataloader worker 0'``; empty for the only reader."""
    rank, world, worker, workers = reader
    parts = ([f"rank {rank}"] if world > 1 else []) + ([f"dataloader worker {worker}"] if workers > 1 else [])
    return ", ".join(parts)


def log_pass(stats: PipelineReport, epoch: int, reader: tuple[int, int, int, int], max_length: int,
             kind: str = "Stream") -> None:
    name = reader_name(reader)
    who = f"{kind} epoch {epoch}" + (f" ({name})" if name else "")
    log(f"{who}: {stats.rows_in} rows in, {stats.samples} samples in {stats.rows_out} rows out, "
        f"{stats.tokens} tokens")
    for line in split_lines(stats):
        log(f"{who}: {line}")
    for line in warning_lines(stats, max_length):
        log(f"{who}: {line}", logging.WARNING)


class StreamingEncoder:
    """``(row number, raw row)`` chunks -> encoded samples through ``process_hf_dataset``'s stage
    functions: dataset map fn, template map fn, drop empty, encode (truncated to ``max_length``),
    drop rows without a trained token (and, with ``skip_bad_rows``, rows whose trained answers the template
    cannot render); counts go to a ``PipelineReport``."""

    def __init__(self, tokenizer: Any, max_length: int, dataset_map_fn: Any = None,
                 template_map_fn: Any = None, input_ids_with_output: bool = True, skip_bad_rows: bool = False):
        from sfttool.dataset.resolve import resolve_map_fn, resolve_template_map_fn, template_of
        from sfttool.utils.templates import chat_template_options, is_hf_chat_template

        self.tokenizer = build_if_config(tokenizer, "tokenizer")
        self.max_length = max_length
        self.dataset_map_fn = resolve_map_fn(dataset_map_fn)
        self.hf_chat_template = is_hf_chat_template(template_of(template_map_fn))
        self.chat_options = chat_template_options(template_of(template_map_fn))
        self.template_map_fn = None if self.hf_chat_template else resolve_template_map_fn(template_map_fn)
        self.input_ids_with_output = input_ids_with_output
        self.skip_bad_rows = skip_bad_rows

    def standard(self, rows: list[Any], numbers: list[int], source: str | None, stats: PipelineReport) -> list:
        """Raw rows -> their conversations (map fn, then template); errors name the file, row and stage."""
        check_dicts(rows, numbers, source)
        if self.dataset_map_fn is not None:
            mapped, notes = map_rows(rows, numbers, self.dataset_map_fn, source)
            count_notes(stats, notes, numbers)
            note_emptied(stats, [m.get("conversation") for m in mapped], notes, numbers)
            rows = [{**row, **m} for row, m in zip(rows, mapped)]
        for row, number in zip(rows, numbers):
            if "conversation" not in row:
                raise DatasetError(f"{where(number, source)}: " + missing_conversation(row, self.dataset_map_fn))
            if self.template_map_fn is not None and not is_empty(row["conversation"]):
                # A bad turn would fail in the template, unnamed.
                check_conversation(row["conversation"], number, source, need_output=self.input_ids_with_output)
        if self.template_map_fn is not None:
            templated, _ = map_rows(rows, numbers, self.template_map_fn, source, role="template_map_fn")
            rows = [{**row, **t} for row, t in zip(rows, templated)]
        return [row["conversation"] for row in rows]

    @gc_paused()  # the chunk's rows, turns and token lists are freed by reference counting (stages.gc_paused)
    def __call__(self, rows: list[tuple[int, Any]], source: str | None, stats: PipelineReport) -> list[Sample]:
        numbers = [number for number, _ in rows]
        conversations = self.standard([row for _, row in rows], numbers, source, stats)
        stats.rows_in += len(rows)
        keep = drop_empty_rows(stats, [is_empty(c) for c in conversations], numbers)
        numbers = [n for n, k in zip(numbers, keep) if k]
        if not numbers:
            return []
        kept = [c for c, k in zip(conversations, keep) if k]
        count_ignored_fields(stats, kept, numbers, renderer(self.tokenizer, self.chat_options), self.hf_chat_template)
        out = encode_batch({"conversation": kept}, numbers, self.tokenizer, self.max_length,
                           self.input_ids_with_output, self.hf_chat_template, source, self.chat_options,
                           skip_bad_rows=self.skip_bad_rows)
        numbers = out[ROW_COLUMN]  # one per sample: a conversation may become several (chat_targets)
        if self.hf_chat_template:
            count_split(stats, numbers)
        for full, kept in zip(out["num_tokens"], out["length"]):
            if full > kept:
                stats.truncated += 1
                stats.tokens_cut += full - kept
        if self.input_ids_with_output:  # else process_hf_dataset keeps rows without labels too
            keep = drop_untrained_rows(stats, out["num_trained"], out["first_trained"], numbers, self.max_length)
        else:
            keep = [True] * len(numbers)
        return [{"input_ids": ids, "labels": labels}
                for ids, labels, k in zip(out["input_ids"], out["labels"], keep) if k]


# ---------------------------------------------------------------------------
# Settings: process_hf_dataset's arguments, and what each means for a stream.

def check_settings(max_length: int, buffer_size: int, encode_chunk: int, rows_per_epoch: int | None,
                   pack_to_max_length: bool, use_varlen_attn: bool, pack_strategy: str,
                   with_image_token: bool) -> None:
    """process_hf_dataset's checks, and what a stream needs besides."""
    if pack_strategy == "concat":
        raise DatasetError("pack_strategy='concat' (XTuner's cut, which splits samples across rows) is not "
                           "available when streaming: rows are packed best-fit-decreasing within a buffer and "
                           "no sample is split; remove pack_strategy, or use process_hf_dataset")
    if pack_strategy != "bfd":
        raise DatasetError(f"pack_strategy must be 'bfd' when streaming, got {pack_strategy!r}")
    check_pipeline_settings(max_length, pack_to_max_length, use_varlen_attn, pack_strategy, with_image_token)
    check_positive_int(buffer_size, "buffer_size")
    check_positive_int(encode_chunk, "encode_chunk")
    if rows_per_epoch is not None:
        check_positive_int(rows_per_epoch, "rows_per_epoch", " (the packed rows one rank reads per pass)")


def refuse_changed_results(max_dataset_length: int | None, rename_maps: Any, do_dataset_tokenization: bool,
                           processor: Any = None) -> None:
    """process_hf_dataset's arguments a stream cannot honour: ignoring them would change the rows."""
    if processor is not None:
        raise DatasetError("image-text rows (processor=...) are not streamed; use process_hf_dataset, or "
                           "sfttool process-dataset to encode them once")
    if max_dataset_length is not None:
        raise DatasetError("max_dataset_length (a seeded random subset of a dataset of known length) is not "
                           "available when streaming; remove it, or stream a smaller source")
    if rename_maps:
        raise DatasetError("rename_maps is not available when streaming; rename the fields in a dataset_map_fn")
    if not do_dataset_tokenization:
        raise DatasetError("do_dataset_tokenization=False (pre-tokenized rows) is not available when streaming; "
                           "use process_hf_dataset or sfttool process-dataset")


NOT_APPLICABLE = {  # argument -> why a stream ignores it
    "map_num_proc": "rows are encoded as they are read, in the dataloader workers (num_workers)",
    "remove_unused_columns": "streamed rows hold only input_ids, labels, position_ids and sample_lengths",
    "cache_dir": "a stream is encoded anew every pass, nothing is cached",
    "lazy_encode": "a stream always encodes rows as it reads them",
}


def warn_not_applicable(given: dict[str, Any]) -> None:
    ignored = [f"{name} ({NOT_APPLICABLE[name]})" for name, value in given.items() if value is not None]
    if ignored:
        log("StreamingPackedDataset: ignoring what does not apply to streaming: " + "; ".join(ignored),
            logging.WARNING)


def resolve_source(dataset: Any, split: str) -> Any:
    """The built source of raw rows: ``split`` of a dict of splits, and never a one-shot iterator."""
    dataset = pick_split(build_if_config(dataset, "dataset"), split)
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
    batch only when ``len(dataloader)`` equals the batches of a pass. ``skip_bad_rows``: rows whose
    trained answers the template cannot render are dropped, counted, instead of stopping the run.
    """

    # The registry hands `dataset` over as its config, unbuilt, so that errors can name its files.
    build_args_lazily = ("dataset",)
    pass_kind = "Stream"  # what the end-of-pass log lines begin with

    def __init__(self, dataset: Any, tokenizer: Any, max_length: int, dataset_map_fn: Any = None,
                 template_map_fn: Any = None, pack_to_max_length: bool = True, buffer_size: int = 1000,
                 seed: int = 0, input_ids_with_output: bool = True, encode_chunk: int = 64,
                 rows_per_epoch: int | None = None, split: str = "train", source: str | None = None,
                 shuffle_before_pack: bool = True, use_varlen_attn: bool = False, pack_strategy: str = "bfd",
                 max_dataset_length: int | None = None, rename_maps: Any = (), with_image_token: bool = False,
                 do_dataset_tokenization: bool = True, remove_unused_columns: bool | None = None,
                 map_num_proc: int | None = None, cache_dir: str | None = None, skip_bad_rows: bool = False,
                 processor: Any = None, image_folder: str | None = None, lazy_encode: bool | None = None):
        refuse_changed_results(max_dataset_length, rename_maps, do_dataset_tokenization, processor)
        check_settings(max_length, buffer_size, encode_chunk, rows_per_epoch, pack_to_max_length,
                       use_varlen_attn, pack_strategy, with_image_token)
        warn_not_applicable(dict(map_num_proc=map_num_proc, remove_unused_columns=remove_unused_columns,
                                 cache_dir=cache_dir, lazy_encode=lazy_encode))
        dataset = dataset_config(dataset)
        self.source = source or source_name(dataset)  # the file(s) errors name
        self.dataset = resolve_source(dataset, split)
        self.encoder = StreamingEncoder(tokenizer, max_length, dataset_map_fn, template_map_fn,
                                        input_ids_with_output, skip_bad_rows)
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
        self.pass_stats: PipelineReport | None = None  # the last pass read in this process

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

    def _samples(self, rows: Iterable[tuple[int, Any]], source: str | None, stats: PipelineReport) -> Iterator[Sample]:
        for chunk in chunks(rows, self.encode_chunk):
            samples = self.encoder(chunk, source, stats)
            stats.samples += len(samples)
            yield from samples

    def _raw_rows(self, reader: tuple[int, int, int, int], epoch: int) -> Iterator[tuple[int, Any]]:
        """This reader's ``(row number, raw row)`` pairs of one pass."""
        return read_explained(_shard(self.dataset, *reader, epoch), self.source)  # a malformed line: one line

    def __iter__(self) -> Iterator[Sample]:
        reader, epoch = _reader(), self.epoch
        stats = self.pass_stats = PipelineReport()
        rows = self._raw_rows(reader, epoch)
        samples = self._samples(rows, self._share_name(reader), stats)
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
        log_pass(stats, epoch, reader, self.max_length, self.pass_kind)
