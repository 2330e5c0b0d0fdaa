"""What the data pipeline did, for the map-style pipeline and the stream alike:
rows in and out, rows dropped and rows changed (each by cause, with the first
row numbers), samples cut at ``max_length``, tokens, and packing.

    Dataset: dropped 2 rows: prompt longer than max_length=256 (row 7 (prompt of 301 tokens), row 19 (...))
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from sfttool.dataset.errors import EXAMPLES, examples

# Why a row is dropped (the keys of ``PipelineReport.dropped``).
DROP_EMPTY = "empty conversation"
DROP_EMPTY_ANSWER = "empty answer (no answer token to train)"
DROP_MASKED = "answer masked away (output_with_loss=False on every turn)"
DROP_SUBSET = "over max_dataset_length"


def drop_prompt_too_long(max_length: int) -> str:
    return f"prompt longer than max_length={max_length} (the answer was cut away)"


def drop_emptied(notes: Sequence[str] = ()) -> str:
    """Why a row with an empty conversation is dropped: ``DROP_EMPTY``, with what the dataset map fn
    changed when that emptied it, so the one cause is said (``train`` and ``check-custom-dataset`` alike).

    >>> drop_emptied(['conversation starts with an assistant message (dropped: nothing asked it)'])
    'empty conversation after dataset_map_fn: conversation starts with an assistant message (dropped: nothing asked it)'
    """
    return f"{DROP_EMPTY} after dataset_map_fn: {'; '.join(notes)}" if notes else DROP_EMPTY


def drop_unrendered(feature: str) -> str:
    """A row whose trained answer the template cannot render (``unrendered``), dropped by skip_bad_rows."""
    return f"the template does not render its {feature} (--skip-bad-rows)"


@dataclass
class PipelineReport:
    """Counts of one pipeline run or one reader's pass over a stream; ``stages`` keeps a dataset
    per stage when asked (``check-custom-dataset`` prints them)."""
    rows_in: int = 0
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> rows
    drop_examples: dict[str, list[str]] = field(default_factory=dict)  # reason -> the first rows
    changed: dict[str, int] = field(default_factory=dict)  # what a map fn changed -> rows
    change_examples: dict[str, list[str]] = field(default_factory=dict)
    encoded: int = 0  # samples tokenized (before rows without trained tokens are dropped)
    truncated: int = 0
    tokens_cut: int = 0
    tokens: int = 0
    trained_tokens: int = 0
    sample_lengths: list[int] = field(default_factory=list)
    pack: Any = None  # PackStats when packed (map-style)
    samples: int = 0  # samples kept (stream)
    rows_out: int = 0
    stages: dict[str, Any] = field(default_factory=dict)
    split: dict[int, int] = field(default_factory=dict)  # samples a conversation became (> 1) -> conversations
    # Rows the dataset map fn left with an empty conversation -> what it changed, until they are dropped.
    emptied: dict[int, list[str]] = field(default_factory=dict)
    sources: list[Any] = field(default_factory=list)  # data_sources.SourceStats, one per source of a mix

    def drop(self, reason: str, rows: list[str], count: int | None = None) -> None:
        """Count ``count`` (default: ``len(rows)``) dropped rows; keep the first rows' names."""
        _tally(self.dropped, self.drop_examples, reason, rows, len(rows) if count is None else count)

    def change(self, note: str, rows: list[str], count: int | None = None) -> None:
        _tally(self.changed, self.change_examples, note, rows, len(rows) if count is None else count)


def _tally(counts: dict[str, int], named: dict[str, list[str]], key: str, rows: list[str], count: int) -> None:
    if count:
        counts[key] = counts.get(key, 0) + count
        kept = named.setdefault(key, [])
        kept += rows[:EXAMPLES - len(kept)]


def log(message: str, level: int = logging.INFO) -> None:
    from mmengine.logging import print_log
    print_log(message, logger="current", level=level)


def drop_lines(report: PipelineReport) -> list[str]:
    """``dropped 2 rows: empty conversation (row 3, row 8)``, one per cause."""
    return [f"dropped {n} rows: {why}" + _named(report.drop_examples.get(why), n) for why, n in report.dropped.items()]


def change_lines(report: PipelineReport) -> list[str]:
    """``changed 4 rows: two user messages in a row (...) (row 1, ...)``, one per change."""
    return [f"changed {n} rows: {what}" + _named(report.change_examples.get(what), n)
            for what, n in report.changed.items()]


def _named(rows: list[str] | None, count: int) -> str:
    return f" ({examples(rows, count)})" if rows else ""


def split_lines(report: PipelineReport) -> list[str]:
    """``2 conversations became 3 samples each (...)``: HF chat-template conversations split so that every
    answer is trained in the form the model produces it (``chat_targets``)."""
    if not report.split:
        return []
    counts = ", ".join(f"{n} conversations became {samples} samples each"
                       for samples, n in sorted(report.split.items()))
    return [f"{counts} (the chat template renders earlier answers differently once later turns follow, "
            "e.g. Qwen3 drops past reasoning; each sample trains the answers it holds as the model produces them)"]


def count_split(report: PipelineReport, rows_of_samples) -> None:
    """Count conversations by the samples they became, from each sample's row number (in order): a
    conversation's samples are consecutive, so a run of one number is one conversation (a source's
    ``slice`` may use a row again further on: that is another conversation).

    >>> report = PipelineReport(); count_split(report, [0, 0, 1, 2, 2, 0, 0]); report.split
    {2: 3}
    """
    import numpy as np
    numbers = np.asarray(rows_of_samples)
    if not len(numbers):
        return
    starts = np.flatnonzero(np.r_[True, numbers[1:] != numbers[:-1]])
    samples = np.diff(np.r_[starts, len(numbers)])
    for many, n in zip(*np.unique(samples[samples > 1], return_counts=True)):
        report.split[int(many)] = report.split.get(int(many), 0) + int(n)


def warning_lines(report: PipelineReport, max_length: int) -> list[str]:
    """What both pipelines warn about: rows changed, rows dropped, samples cut."""
    lines = change_lines(report) + drop_lines(report)
    if report.truncated:
        lines.append(f"truncated {report.truncated} samples at max_length={max_length} "
                     f"({report.tokens_cut} tokens cut)")
    return lines


def log_report(report: PipelineReport, max_length: int) -> None:
    """The map-style pipeline's summary."""
    log(f"Dataset: {report.rows_in} rows in, {report.rows_out} rows out")
    for line in split_lines(report):
        log(f"Dataset: {line}")
    for line in warning_lines(report, max_length):
        log(f"Dataset: {line}", logging.WARNING)
    if report.tokens:
        log(f"Dataset: {report.tokens} tokens, {report.trained_tokens} trained "
            f"({100 * report.trained_tokens / report.tokens:.1f}%)")
    pack = report.pack
    if pack is not None:
        log(f"Dataset: packed {pack.samples} samples into {pack.rows} rows of <= {max_length} tokens, "
            f"packing efficiency {100 * pack.efficiency:.1f}%, {pack.split_samples} samples split")
        if pack.rows_without_labels:
            log(f"Dataset: {pack.rows_without_labels} packed rows have no trained token", logging.WARNING)


def stage_recorder(report: Any, keep_stages: bool) -> Callable[[str, Any], None]:
    """``stage(name, dataset)``: with ``keep_stages`` (check-custom-dataset) each stage's dataset is kept in
    ``report.stages`` under its name; otherwise nothing is kept."""
    return report.stages.__setitem__ if keep_stages else (lambda name, dataset: None)
