"""Training data composed from several sources: each source loaded, sliced, mapped and filtered on its
own, encoded with the one template, then mixed (concatenated by ratio or interleaved by probability)
and packed together.

    # PART 1
    data_sources = [dict(name='chat', data_path='chat.jsonl'),
                    dict(name='alpaca', data_path='tatsu-lab/alpaca', map_fn=alpaca_map_fn, slice=range(2000))]
    mix_strategy = 'interleave'            # or 'concat' (each source's rows in turn, by ratio)
    mix_probabilities = [0.7, 0.3]         # interleave: the chance of each source per sample drawn
    stopping_strategy = 'first_exhausted'  # or 'all_exhausted' (as datasets.interleave_datasets)
    # PART 3
    train_dataset = dict(type=process_data_sources, data_sources=data_sources, mix_strategy=mix_strategy,
                         mix_probabilities=mix_probabilities, stopping_strategy=stopping_strategy,
                         tokenizer=tokenizer, max_length=max_length, template_map_fn=..., seed=seed)

The stages are ``process_hf_dataset``'s (``pipeline.sample_table``), so one source gives the samples and
packed rows ``process_hf_dataset`` gives for the same ``data_path`` and map fn. Mixing works on encoded
samples, so a row used twice is encoded once. Packing runs after mixing: samples of different sources
may share a packed row (isolated as always by their position_ids); ``pack_per_source=True`` packs each
source's samples apart, as ``mix_datasets`` does.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from sfttool.dataset.errors import ROW_COLUMN, DatasetError
from sfttool.dataset.mix import mix_indices, unified_table
from sfttool.dataset.pack import PackStats
from sfttool.dataset.pipeline import SOURCE_COLUMN, apply_map_fn, check_settings, finish_rows, sample_table
from sfttool.dataset.rows import default_num_proc
from sfttool.dataset.report import PipelineReport, log, log_report
from sfttool.dataset.resolve import resolve_map_fn, template_of
from sfttool.dataset.source_stages import (apply_filter, check_sources, count_removed, load_source, source_label,
                                           validation_source)
from sfttool.dataset.stages import count_tokens, fn_name
from sfttool.registry import BUILDER, build_if_config


@dataclass
class SourceStats:
    """One source's counts: rows read (and after ``slice``), left after map_fn/filter_fn, samples encoded,
    samples used in the mix, their tokens; requested and realised shares of the samples used."""
    label: str
    read: int
    sliced: int
    kept: int = 0
    samples: int = 0
    used: int = 0
    tokens: int = 0
    trained_tokens: int = 0
    requested_share: float = 0.0
    realised_share: float = 0.0
    report: PipelineReport | None = None  # the source's own drops, changes and stages


def source_samples(index: int, source: dict, tokenizer: Any, max_length: int, template_map_fn: Any,
                   input_ids_with_output: bool, map_num_proc: int | None, keep_stages: bool,
                   skip_bad_rows: bool) -> tuple[Any, SourceStats]:
    """One source's encoded samples (an Arrow table of the token columns only: the sources' raw columns
    differ) and its counts."""
    dataset, name, read = load_source(index, source)
    stats = SourceStats(source_label(index, source), read, len(dataset))
    report = stats.report = PipelineReport(rows_in=len(dataset))
    if keep_stages:
        report.stages["loaded"] = dataset
    num_proc = default_num_proc(len(dataset), map_num_proc)
    num_proc = num_proc if num_proc > 1 else None
    map_fn = resolve_map_fn(source.get("map_fn"))
    if map_fn is not None:
        before = _numbers(dataset)
        dataset = apply_map_fn(dataset, map_fn, num_proc, name, report, role="map_fn", none_drops=True)
        count_removed(before, _numbers(dataset), f"map_fn {fn_name(map_fn)} returned None", report)
    if source.get("filter_fn") is not None:
        dataset = apply_filter(dataset, source["filter_fn"], num_proc, name, report)
    if keep_stages and (map_fn is not None or source.get("filter_fn") is not None):
        report.stages["map_fn"] = dataset  # what check-custom-dataset shows "after map_fn and filter_fn"
    stats.kept = len(dataset)
    if not len(dataset):
        raise DatasetError(f"{stats.label}: no rows left after map_fn and filter_fn: " + "; ".join(
            f"{n} dropped ({why})" for why, n in report.dropped.items()))
    table = sample_table(dataset, tokenizer, max_length, report, None, template_map_fn, (), True,
                         input_ids_with_output, map_num_proc, True, name, keep_stages, skip_bad_rows)
    stats.samples = len(table)
    return table, stats


def _numbers(dataset) -> np.ndarray:
    return dataset.select_columns([ROW_COLUMN]).with_format("arrow")[:][ROW_COLUMN].to_numpy()


# ---------------------------------------------------------------------------
# Mixing, packing and the report.

def tag_source(table, index: int):
    """The table with ``SOURCE_COLUMN`` = ``index`` on every sample."""
    import pyarrow as pa
    return table.append_column(SOURCE_COLUMN, pa.array(np.full(len(table), index, dtype=np.int32)))


def mixed_counts(unified, samples: np.ndarray):
    """The mixed samples' source, length and trained tokens (small columns, taken in mix order)."""
    return unified.select([SOURCE_COLUMN, "length", "num_trained"]).take(samples)


def count_used(mixed, stats: list[SourceStats], requested: list[float]) -> None:
    """Samples, tokens and trained tokens each source has in the mix (``mixed_counts``), and its realised
    share of the samples."""
    which = mixed[SOURCE_COLUMN].to_numpy()
    used = np.bincount(which, minlength=len(stats))
    tokens = np.bincount(which, weights=mixed["length"].to_numpy(), minlength=len(stats))
    trained = np.bincount(which, weights=mixed["num_trained"].to_numpy(), minlength=len(stats))
    for i, source in enumerate(stats):
        source.used, source.tokens, source.trained_tokens = int(used[i]), int(tokens[i]), int(trained[i])
        source.requested_share, source.realised_share = requested[i], used[i] / max(1, used.sum())


def requested_shares(stats: list[SourceStats], strategy: str, ratios: list[float],
                     probabilities: list[float] | None) -> list[float]:
    """The share of the samples used each source was asked for: ``ratio x samples`` of the total (concat),
    ``mix_probabilities`` (interleave; equal shares, round-robin, when unset)."""
    if strategy == "interleave":
        return list(probabilities) if probabilities is not None else [1 / len(stats)] * len(stats)
    wanted = np.asarray([r * s.samples for r, s in zip(ratios, stats)], dtype=float)
    return (wanted / max(wanted.sum(), 1e-12)).tolist()


def merged_report(stats: list[SourceStats], mixed) -> PipelineReport:
    """One report for the run: every source's drops and changes under its label, the counts summed, the
    token counts of the samples used."""
    merged = PipelineReport(rows_in=sum(s.sliced for s in stats))
    for source in stats:
        merge_counts(merged, source.label, source.report)
    count_tokens(mixed, merged)
    merged.sources = stats
    return merged


def merge_counts(merged: PipelineReport, label: str, report: PipelineReport) -> None:
    """A source's drops and changes into ``merged``, under its ``label``; its sample counts added."""
    for why, n in report.dropped.items():
        merged.drop(f"{label}: {why}", report.drop_examples.get(why, []), count=n)
    for what, n in report.changed.items():
        merged.change(f"{label}: {what}", report.change_examples.get(what, []), count=n)
    merged.encoded += report.encoded
    merged.truncated += report.truncated
    merged.tokens_cut += report.tokens_cut
    for many, n in report.split.items():
        merged.split[many] = merged.split.get(many, 0) + n


def pack_sources(unified, samples: np.ndarray, per_source: bool, pack_to_max_length: bool, max_length: int,
                 strategy: str, shuffle: bool, seed: int, report: PipelineReport):
    """Pack the mixed ``samples`` (rows of ``unified``) together, or (``per_source``) each source's apart,
    source 0's rows first."""
    if not per_source:
        return finish_rows(unified, pack_to_max_length, max_length, strategy, shuffle, seed, report, samples)
    from datasets import concatenate_datasets
    which = unified[SOURCE_COLUMN].to_numpy()[samples]
    parts, packs = [], []
    for index in np.unique(which):
        parts.append(finish_rows(unified, pack_to_max_length, max_length, strategy, shuffle, seed, report,
                                 samples[which == index]))
        packs.append(report.pack)
    if pack_to_max_length:
        report.pack = PackStats(**{f.name: sum(getattr(p, f.name) for p in packs) for f in dataclasses.fields(PackStats)
                                   if f.name != "max_length"}, max_length=max_length)
    return concatenate_datasets(parts)


def source_lines(report: PipelineReport, strategy: str) -> list[str]:
    """One line per source: rows read, left after map/filter, samples used, tokens, share of the trained
    tokens, and the realised share of the samples next to the requested one."""
    total = max(1, sum(s.trained_tokens for s in report.sources))
    lines = []
    for s in report.sources:
        sliced = f" ({s.sliced} after slice)" if s.sliced != s.read else ""
        lines.append(f"{s.label}: {s.read} rows read{sliced}, {s.kept} after map/filter, {s.samples} samples, "
                     f"{s.used} used, {s.tokens} tokens, {100 * s.trained_tokens / total:.1f}% of the trained "
                     f"tokens; {strategy} share of samples {s.realised_share:.3f} (requested {s.requested_share:.3f})")
    return lines


def run_sources(data_sources: list[dict], tokenizer: Any, max_length: int, template_map_fn: Any = None,
                mix_strategy: str = "concat", mix_probabilities: Any = None,
                stopping_strategy: str = "first_exhausted", pack_per_source: bool = False,
                shuffle_before_pack: bool = True,
                pack_to_max_length: bool = True, input_ids_with_output: bool = True, map_num_proc: int | None = None,
                seed: int = 0, pack_strategy: str = "bfd", keep_stages: bool = False,
                skip_bad_rows: bool = False):
    """Every source's samples, mixed, packed: ``(dataset, PipelineReport)`` with ``report.sources``."""
    check_sources(data_sources, mix_strategy, mix_probabilities, stopping_strategy)
    template_of(template_map_fn)  # an unknown template is said before the data is read
    tokenizer = build_if_config(tokenizer, "tokenizer")
    tables, stats = [], []
    for index, source in enumerate(data_sources):
        table, source_stats = source_samples(index, source, tokenizer, max_length, template_map_fn,
                                             input_ids_with_output, map_num_proc, keep_stages, skip_bad_rows)
        tables.append(tag_source(table, index))
        stats.append(source_stats)
    ratios = [1.0 if s.get("ratio") is None else float(s["ratio"]) for s in data_sources]
    unified = unified_table(tables)
    samples = mix_indices([len(t) for t in tables], mix_strategy, ratios, mix_probabilities, stopping_strategy, seed)
    if len(samples) == 0:
        raise DatasetError(f"data_sources: the mix selects no sample (ratios {ratios}); raise a ratio above 0")
    mixed = mixed_counts(unified, samples)
    count_used(mixed, stats, requested_shares(stats, mix_strategy, ratios, mix_probabilities))
    report = merged_report(stats, mixed)
    dataset = pack_sources(unified, samples, pack_per_source, pack_to_max_length, max_length, pack_strategy,
                           shuffle_before_pack, seed, report)
    if keep_stages:
        report.stages["packed" if pack_to_max_length else "rows"] = dataset
    report.rows_out = len(dataset)
    return dataset, report


@BUILDER.register_module()
def process_data_sources(data_sources: list[dict], tokenizer: Any = None, max_length: int | None = None,
                         template_map_fn: Any = None, mix_strategy: str = "concat", mix_probabilities: Any = None,
                         stopping_strategy: str = "first_exhausted", pack_per_source: bool = False,
                         part: str = "train", val_source: str | None = None, val_split: str = "test",
                         shuffle_before_pack: bool = True,
                         pack_to_max_length: bool = True, use_varlen_attn: bool = False,
                         input_ids_with_output: bool = True, map_num_proc: int | None = None, seed: int = 0,
                         pack_strategy: str = "bfd", skip_bad_rows: bool = False):
    """The training (``part='train'``) or validation (``part='val'``: the source named ``val_source``, its
    ``val_split``, every row once) rows of PART 1's ``data_sources``; the other arguments are
    ``process_hf_dataset``'s. Rows hold the token columns only (as with ``remove_unused_columns=True``):
    the sources' raw columns differ. See the module docstring."""
    check_settings(max_length, pack_to_max_length, use_varlen_attn, pack_strategy, False)
    check_sources(data_sources, mix_strategy, mix_probabilities, stopping_strategy)
    if part not in ("train", "val"):
        raise DatasetError(f"process_data_sources: part must be 'train' or 'val', got {part!r}")
    if part == "val":
        data_sources, mix_strategy, mix_probabilities = [validation_source(data_sources, val_source, val_split)], \
            "concat", None
    dataset, report = run_sources(
        data_sources, tokenizer, max_length, template_map_fn, mix_strategy=mix_strategy,
        mix_probabilities=mix_probabilities, stopping_strategy=stopping_strategy, pack_per_source=pack_per_source,
        shuffle_before_pack=shuffle_before_pack, pack_to_max_length=pack_to_max_length,
        input_ids_with_output=input_ids_with_output, map_num_proc=map_num_proc, seed=seed, pack_strategy=pack_strategy,
        skip_bad_rows=skip_bad_rows)
    log_report(report, max_length)
    for line in source_lines(report, mix_strategy):
        log(f"Dataset sources: {line}")
    return dataset
