"""``build_preference_dataset``: load -> map fn -> encode pairs -> pack pairs.

XTuner 0.2's name and arguments; the stages reuse SFT's (loading and row
numbering from ``sfttool.dataset.pipeline``, encoding from
``sfttool.dataset.encode``, the best-fit-decreasing packer from
``sfttool.dataset.pack``)::

    train_dataset = dict(type=build_preference_dataset,
                         dataset=dict(type=load_dataset, path='json', data_files='pairs.jsonl'),
                         tokenizer=tokenizer, max_length=2048,
                         dataset_map_fn=orpo_dpo_mix_40k_map_fn,
                         max_packed_length=16384)

Every output row holds whole pairs, each as two consecutive sequences,
chosen then rejected: ``input_ids``, ``labels``, ``position_ids`` (restarting
at 0 at every sequence, which isolates them in attention), ``sample_lengths``
(one per sequence, an even count) and ``length``. Packed rows hold several
pairs (best fit decreasing over pair lengths, up to ``max_packed_length``
tokens); unpacked rows hold one pair. No pair is split, no token lost.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sfttool.dataset.errors import ROW_COLUMN, DatasetError, check_positive_int
from sfttool.dataset.pipeline import apply_map_fn, content_fingerprint, log
from sfttool.dataset.rows import default_num_proc, number_rows, select_rows
from sfttool.dataset.preference_encode import COLUMNS, encode_pair_batch
from sfttool.dataset.report import PipelineReport, change_lines, stage_recorder
from sfttool.dataset.resolve import (dataset_config, prompt_template_or_chat_template, resolve_dataset, resolve_map_fn,
                                     source_name)
from sfttool.dataset.stages import to_table
from sfttool.registry import build_if_config

PAIR_FIELDS = ("prompt", "chosen", "rejected")


@dataclass
class PreferenceReport:
    """What each stage did; ``stages`` keeps a dataset per stage when asked."""
    rows_in: int = 0
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> pairs
    truncated: dict[str, int] = field(default_factory=dict)  # how -> pairs
    pairs: int = 0
    tokens: int = 0
    rows_out: int = 0
    capacity: int = 0  # rows * max_packed_length when packed
    stages: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------
# Stages.

def require_pairs(dataset) -> None:
    """Raw data without the pair fields: say which map fn to set."""
    missing = [name for name in PAIR_FIELDS if name not in dataset.column_names]
    if missing:
        columns = ", ".join(c for c in dataset.column_names if c != ROW_COLUMN)
        raise DatasetError(f"preference rows need `prompt`, `chosen` and `rejected` (missing {', '.join(missing)}; "
                           f"columns: {columns}); set a dataset_map_fn such as orpo_dpo_mix_40k_map_fn, "
                           "intel_orca_dpo_map_fn, ultrafeedback_binarized_map_fn or preference_strings_map_fn")


def encode_pairs(dataset, tokenizer, max_length: int, template: Any, num_proc: int, source: str | None,
                 reward_token_id: int | None = None):
    from datasets import Features, List, Value
    tokens = List(Value("int32"))
    features = Features({**{name: tokens for name in COLUMNS[:4]},
                         **{name: Value("int32") for name in COLUMNS[4:7]},
                         "note": Value("string"), "drop": Value("string")})
    return dataset.map(encode_pair_batch, batched=True, with_indices=True, num_proc=num_proc,
                       remove_columns=dataset.column_names, features=features,
                       fn_kwargs=dict(tokenizer=tokenizer, max_length=max_length, template=template, source=source,
                                      reward_token_id=reward_token_id),
                       desc="Tokenizing preference pairs")


def count_and_drop(dataset, report: PreferenceReport):
    """Count each truncation and drop reason; keep the pairs without a drop reason."""
    table = dataset.select_columns(["note", "drop"]).with_format("arrow")[:]
    for note in table["note"].to_pylist():
        for how in filter(None, note.split("; ")):
            report.truncated[how] = report.truncated.get(how, 0) + 1
    drops = np.array(table["drop"].to_pylist(), dtype=object)
    for reason in sorted(set(drops) - {""}):
        report.dropped[reason] = int((drops == reason).sum())
    keep = drops == ""
    if not keep.any():
        raise DatasetError("no preference pairs left to train on: " + "; ".join(
            f"{n} dropped ({why})" for why, n in report.dropped.items()))
    return dataset if keep.all() else dataset.select(np.flatnonzero(keep))


def sequence_table(table):
    """The pairs' sequences interleaved, chosen then rejected: ``[c0, r0, c1, r1, ...]``."""
    import pyarrow as pa
    n = table.num_rows
    columns = {}
    for name in ("input_ids", "labels"):
        both = pa.concat_arrays([table[f"chosen_{name}"].combine_chunks(), table[f"rejected_{name}"].combine_chunks()])
        columns[name] = both.take(pa.array(np.stack([np.arange(n), np.arange(n) + n], 1).reshape(-1)))
    return pa.table(columns)


def pack_pairs(table, max_packed_length: int | None, shuffle: bool, seed: int):
    """An Arrow table of rows of whole pairs: best fit decreasing over pair lengths up to
    ``max_packed_length`` tokens (after a seeded shuffle), or one pair per row (None), in order."""
    import pyarrow.compute as pc
    from sfttool.dataset.pack import assemble, best_fit_decreasing
    pair_lengths = table["length"].to_numpy().astype(np.int64)
    n = len(pair_lengths)
    order = np.random.default_rng(seed).permutation(n) if shuffle and max_packed_length else np.arange(n)
    if max_packed_length is None:
        bins = [[i] for i in range(len(order))]
    else:
        bins = best_fit_decreasing(pair_lengths[order], max_packed_length)
    pairs = np.array([order[i] for b in bins for i in b], dtype=np.int64)
    sequences = np.stack([2 * pairs, 2 * pairs + 1], 1).reshape(-1)  # chosen, rejected of each pair
    seq_table = sequence_table(table)
    seq_lengths = pc.list_value_length(seq_table["input_ids"]).to_numpy(zero_copy_only=False).astype(np.int64)
    counts = np.array([2 * len(b) for b in bins], dtype=np.int64)
    return assemble(seq_table, sequences, seq_lengths[sequences], counts)


# ---------------------------------------------------------------------------
# The pipeline.

def run_preference_pipeline(dataset, tokenizer, max_length: int, dataset_map_fn=None, prompt_template=None,
                            max_packed_length=None, shuffle_before_pack=True, max_dataset_length=None,
                            split="train", map_num_proc=None, seed=0, source=None, keep_stages=False,
                            reward_token_id=None):
    """All stages in order; returns ``(dataset, PreferenceReport)``.

    ``prompt_template`` None means the tokenizer's own chat template;
    ``max_packed_length`` None means one pair per row; ``reward_token_id`` ends every sequence
    with that token (reward-model data).
    """
    from datasets import Dataset
    source = source or source_name(dataset)
    template = prompt_template_or_chat_template(prompt_template)
    tokenizer = build_if_config(tokenizer, "tokenizer")
    dataset = number_rows(resolve_dataset(dataset, split))
    report = PreferenceReport(rows_in=len(dataset))
    stage = stage_recorder(report, keep_stages)
    stage("loaded", dataset)
    num_proc = default_num_proc(len(dataset), map_num_proc)
    dataset = select_rows(dataset, max_dataset_length, seed, report)
    map_fn = resolve_map_fn(dataset_map_fn)
    if map_fn is not None:
        dataset = map_pairs(dataset, map_fn, num_proc, source)
        stage("map_fn", dataset)
    require_pairs(dataset)
    dataset = encode_pairs(dataset, tokenizer, max_length, template, num_proc, source, reward_token_id)
    dataset = count_and_drop(dataset, report)
    stage("encoded", dataset)
    table = to_table(dataset)
    rows = pack_pairs(table, max_packed_length, shuffle_before_pack, seed)
    report.pairs, report.tokens = table.num_rows, int(table["length"].to_numpy().sum())
    report.rows_out = rows.num_rows
    report.capacity = rows.num_rows * (max_packed_length or 0)
    dataset = Dataset(rows, fingerprint=content_fingerprint(rows))
    stage("packed" if max_packed_length else "rows", dataset)
    return dataset, report


def map_pairs(dataset, map_fn, num_proc: int, source: str | None):
    """The dataset map fn on every row, through the SFT pipeline's stage; what a map fn that takes
    ``notes`` changed in rows is logged the way SFT logs it."""
    changes = PipelineReport()
    dataset = apply_map_fn(dataset, map_fn, num_proc, source, changes)
    for line in change_lines(changes):
        log(f"Preference data: {line}", logging.WARNING)
    return dataset


def log_preference_report(report: PreferenceReport, max_length: int) -> None:
    log(f"Preference data: {report.rows_in} rows in, {report.pairs} pairs in {report.rows_out} rows out")
    for reason, count in report.dropped.items():
        log(f"Preference data: dropped {count} pairs: {reason}", logging.WARNING)
    for how, count in report.truncated.items():
        log(f"Preference data: {count} pairs over max_length={max_length}: {how}", logging.WARNING)
    if report.capacity:
        log(f"Preference data: {report.tokens} tokens, packing efficiency "
            f"{100 * report.tokens / report.capacity:.1f}%")


def build_preference_dataset(dataset, tokenizer=None, max_length=None, dataset_map_fn=None, is_dpo=True,
                             is_reward=False, reward_token_id=-1, num_proc=None, use_varlen_attn=False,
                             max_packed_length=16384, shuffle_before_pack=True, pack_to_max_length=True,
                             prompt_template=None, max_dataset_length=None, split="train", seed=0, source=None):
    """XTuner's ``build_preference_dataset``: a training ``datasets.Dataset`` of preference pairs.

    >>> ds = build_preference_dataset(rows, tokenizer, max_length=1024, max_packed_length=4096)  # doctest: +SKIP
    >>> ds[0]['sample_lengths']   # chosen, rejected, chosen, rejected, ...                   # doctest: +SKIP
    [212, 198, 87, 95]

    ``max_length`` bounds each sequence (prompt + answer), ``max_packed_length``
    each packed row (at least ``2 * max_length``, so every pair fits).
    New arguments: ``pack_to_max_length`` (XTuner packs only with varlen
    attention; here position_ids isolate packed sequences on every backend, so
    packing is the default), ``prompt_template`` (None: the tokenizer's chat
    template, as in XTuner; or a ``PROMPT_TEMPLATE`` entry), ``seed``.
    ``is_reward`` with ``reward_token_id >= 0`` ends every sequence with that
    token (XTuner's reward-model convention; the score is read there); ``is_dpo``
    and ``use_varlen_attn`` are accepted for XTuner configs and change nothing.
    """
    check_positive_int(max_length, "max_length")
    packed = max_packed_length if pack_to_max_length else None
    if packed is not None:
        check_positive_int(max_packed_length, "max_packed_length")
        if max_packed_length < 2 * max_length:
            raise DatasetError(f"max_packed_length={max_packed_length} is less than 2 * max_length="
                               f"{2 * max_length}: a pair of two full-length sequences would not fit a row; "
                               f"set max_packed_length >= {2 * max_length}")
    dataset, report = run_preference_pipeline(
        dataset_config(dataset), tokenizer, max_length, dataset_map_fn, prompt_template, packed,
        shuffle_before_pack, max_dataset_length, split, num_proc, seed, source,
        reward_token_id=reward_token(is_reward, reward_token_id))
    log_preference_report(report, max_length)
    return dataset


def reward_token(is_reward: bool, reward_token_id: int | None) -> int | None:
    """The token reward-model data ends its sequences with; None (XTuner's -1) for none."""
    return reward_token_id if is_reward and reward_token_id is not None and reward_token_id >= 0 else None


# As for process_hf_dataset: the registry hands `dataset` over as its config, so local JSON files are checked
# line by line before Arrow reads them and errors name the file.
build_preference_dataset.build_args_lazily = ("dataset",)
