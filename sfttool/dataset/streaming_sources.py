"""PART 1's ``data_sources`` streamed: each source read as it is needed, mapped, filtered and encoded on
its own, the sources' samples mixed (concatenated, or interleaved as ``datasets.interleave_datasets``
does) and packed in a buffer, in the dataloader workers.

Takes ``process_data_sources``' arguments and ``StreamingPackedDataset``'s, so a config switches by
changing ``type``::

    train_dataset = dict(type=StreamingDataSources, data_sources=data_sources, mix_strategy='interleave',
                         mix_probabilities=[0.7, 0.3], stopping_strategy='first_exhausted',
                         tokenizer=tokenizer, max_length=2048, template_map_fn=..., buffer_size=2000,
                         seed=0, rows_per_epoch=50_000)

A source is read with ``load_dataset(..., streaming=True)``. A stream has no length, so ``slice``, ``ratio``
and ``pack_per_source`` are refused; the one reader of a first pass draws what the map-style
``process_data_sources`` draws from the same sources (test), other passes and readers draw with the seed
``[seed, epoch, reader]``.
"""
from __future__ import annotations

import random
from typing import Any, Iterator

import torch

from sfttool.dataset.data_path import load_data_path
from sfttool.dataset.data_sources import merge_counts
from sfttool.dataset.errors import DatasetError
from sfttool.dataset.mix import interleave_streams
from sfttool.dataset.report import PipelineReport, log
from sfttool.dataset.resolve import resolve_dataset, resolve_map_fn
from sfttool.dataset.source import read_explained
from sfttool.dataset.source_stages import check_sources, error_name, map_and_filter_rows, source_label
from sfttool.dataset.streaming import (StreamingEncoder, StreamingPackedDataset, _reader, _shard, chunks, log_pass,
                                       pack_stream, single_sample_row)
from sfttool.dataset.streaming import check_settings as check_stream_settings
from sfttool.registry import BUILDER

STREAM_REFUSED = {  # a source's key -> why a stream cannot honour it
    "slice": "row indices need the source's length, which a stream does not know",
    "ratio": "a share of a source's rows needs its length, which a stream does not know (mix_strategy="
             "'interleave' with mix_probabilities sets shares)",
}


def stream_problems(data_sources: Any, pack_per_source: bool) -> list[str]:
    """What a stream of ``data_sources`` cannot do, one line each."""
    problems = [f"data_sources[{i}].{key} is not available when streaming: {why}; remove it, or use "
                "process_data_sources" for i, source in enumerate(data_sources) if isinstance(source, dict)
                for key, why in STREAM_REFUSED.items() if source.get(key) is not None]
    if pack_per_source:
        problems.append("pack_per_source=True is not available when streaming: the stream packs the mixed samples "
                        "in one buffer; remove it, or use process_data_sources")
    return problems


def load_stream(index: int, source: dict) -> tuple[Any, str]:
    """A source's rows as a ``datasets.IterableDataset`` (its split), and the name errors give it."""
    config = dict(type=load_data_path, path=source["data_path"], streaming=True)
    if source.get("subset"):
        config["name"] = source["subset"]
    try:
        return resolve_dataset(config, source.get("split") or "train"), error_name(index, source, config)
    except DatasetError as exc:
        raise DatasetError(f"{source_label(index, source)}: {exc}") from None


@BUILDER.register_module()
class StreamingDataSources(StreamingPackedDataset):
    """``data_sources`` encoded and packed as they stream in (see the module docstring)."""

    def __init__(self, data_sources: list[dict], tokenizer: Any, max_length: int, template_map_fn: Any = None,
                 mix_strategy: str = "concat", mix_probabilities: Any = None,
                 stopping_strategy: str = "first_exhausted", pack_per_source: bool = False,
                 pack_to_max_length: bool = True, buffer_size: int = 1000, seed: int = 0,
                 input_ids_with_output: bool = True, encode_chunk: int = 64, rows_per_epoch: int | None = None,
                 shuffle_before_pack: bool = True, use_varlen_attn: bool = False, pack_strategy: str = "bfd",
                 skip_bad_rows: bool = False):
        torch.utils.data.IterableDataset.__init__(self)
        check_stream_settings(max_length, buffer_size, encode_chunk, rows_per_epoch, pack_to_max_length,
                              use_varlen_attn, pack_strategy, False)
        check_sources(data_sources, mix_strategy, mix_probabilities, stopping_strategy)
        problems = stream_problems(data_sources, pack_per_source)
        if problems:
            raise DatasetError("\n".join(problems))
        self.labels = [source_label(i, s) for i, s in enumerate(data_sources)]
        self.streams = [load_stream(i, s) for i, s in enumerate(data_sources)]
        self.map_fns = [resolve_map_fn(s.get("map_fn")) for s in data_sources]
        self.filter_fns = [s.get("filter_fn") for s in data_sources]
        self.encoder = StreamingEncoder(tokenizer, max_length, None, template_map_fn, input_ids_with_output,
                                        skip_bad_rows)
        self.mix_strategy, self.mix_probabilities, self.stopping_strategy = \
            mix_strategy, mix_probabilities, stopping_strategy
        self.max_length, self.pack_to_max_length, self.shuffle_before_pack = \
            max_length, pack_to_max_length, shuffle_before_pack
        self.buffer_size, self.seed, self.encode_chunk, self.rows_per_epoch = \
            buffer_size, seed, encode_chunk, rows_per_epoch
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()  # as StreamingPackedDataset's
        self.pass_stats: PipelineReport | None = None
        self.source_stats: list[PipelineReport] = []
        self.used: list[int] = []

    def _source_samples(self, index: int, reader: tuple[int, int, int, int], epoch: int,
                        stats: PipelineReport) -> Iterator[Any]:
        """One pass over a source's share of rows, as encoded samples (its drops counted in ``stats``)."""
        dataset, name = self.streams[index]
        rows = read_explained(_shard(dataset, *reader, epoch), name)
        for chunk in chunks(rows, self.encode_chunk):
            kept, numbers = map_and_filter_rows([row for _, row in chunk], [n for n, _ in chunk],
                                                self.map_fns[index], self.filter_fns[index], name, stats)
            stats.rows_in += len(chunk) - len(kept)  # the encoder counts the rows it is given
            samples = self.encoder(list(zip(numbers, kept)), name, stats)
            stats.samples += len(samples)
            yield from samples

    def _mixed(self, reader: tuple[int, int, int, int], epoch: int) -> Iterator[Any]:
        """The sources' samples mixed: ``(source, sample)`` in concat order or drawn by ``interleave_streams``."""
        def start(index: int):
            return lambda: self._source_samples(index, reader, epoch, self.source_stats[index])
        if self.mix_strategy == "concat":
            return ((i, sample) for i in range(len(self.streams)) for sample in start(i)())
        rank, world, worker, workers = reader
        number = rank * workers + worker
        seed = self.seed if (epoch, number) == (0, 0) else [self.seed, epoch, number]
        return interleave_streams([start(i) for i in range(len(self.streams))], self.mix_probabilities, seed,
                                  self.stopping_strategy, skip_empty=True)  # a reader's share may be empty

    def __iter__(self) -> Iterator[Any]:
        reader, epoch = _reader(), self.epoch
        stats = self.pass_stats = PipelineReport()
        self.source_stats = [PipelineReport() for _ in self.streams]
        self.used = [0] * len(self.streams)

        def counted() -> Iterator[Any]:
            for index, sample in self._mixed(reader, epoch):
                self.used[index] += 1
                stats.samples += 1
                yield sample
        if not self.pack_to_max_length:
            rows: Iterator[Any] = map(single_sample_row, counted())
        else:
            rng = random.Random(f"{self.seed}-{epoch}-{reader}") if self.shuffle_before_pack else None
            rows = pack_stream(counted(), self.max_length, self.buffer_size, rng)
        for row in rows:
            stats.rows_out += 1
            stats.tokens += len(row["input_ids"])
            yield row
        self._log_sources(stats, epoch, reader)

    def _log_sources(self, stats: PipelineReport, epoch: int, reader: tuple[int, int, int, int]) -> None:
        for label, report in zip(self.labels, self.source_stats):
            merge_counts(stats, label, report)
            stats.rows_in += report.rows_in
        log_pass(stats, epoch, reader, self.max_length)
        total = max(1, sum(self.used))
        for label, report, used in zip(self.labels, self.source_stats, self.used):
            log(f"Stream epoch {epoch}: {label}: {report.rows_in} rows read, {report.samples} samples, {used} used "
                f"({self.mix_strategy} share of samples {used / total:.3f})")
