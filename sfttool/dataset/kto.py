"""Unpaired preference data for KTO: ``{"prompt", "completion", "label"}`` rows -> one encoded example each.

    {"prompt": [{"role": "user", "content": "2+2?"}],
     "completion": [{"role": "assistant", "content": "4"}], "label": true}

``prompt`` is a conversation ending with a user message (or a string: one user message);
``completion`` one assistant message (or a string); ``label`` true (desirable) or false
(undesirable). Each row is the conversation ``prompt + [completion]``, encoded exactly as one side
of a preference pair (``sfttool.dataset.preference_encode``): only the completion and its
end-of-turn token are trained. Rows are not packed: ``kto_collate_fn`` pairs each example with
another row's completion in the same micro-batch (KTO's KL baseline), which needs each example's
prompt length (``prompt_length``).

A row longer than ``max_length`` has its completion cut at ``max_length`` when the prompt leaves
room for at least one completion token; otherwise it is dropped. Both are counted and logged.
"""
from __future__ import annotations

import logging
from typing import Any

from sfttool.dataset.errors import ROW_COLUMN, DatasetError, where
from sfttool.dataset.pipeline import apply_map_fn, log
from sfttool.dataset.rows import default_num_proc, number_rows
from sfttool.dataset.preference_encode import encode_conversations, pair_conversations, prompt_length
from sfttool.dataset.report import PipelineReport
from sfttool.dataset.resolve import (dataset_config, prompt_template_or_chat_template, resolve_dataset, resolve_map_fn,
                                     source_name)
from sfttool.registry import build_if_config

KTO_FIELDS = ("prompt", "completion", "label")
NOTE_CUT = "completion cut at max_length"
DROP_PROMPT_TOO_LONG = "prompt alone fills max_length (no room for the completion)"


def example_conversation(row: dict, source: str | None) -> list[dict]:
    """The conversation of one unpaired row (strings become one user / assistant message).

    >>> example_conversation({"prompt": "Q", "completion": "A", "label": True, "__row": 0}, None)
    [{'input': 'Q', 'output': 'A'}]
    """
    number = row.get(ROW_COLUMN)
    if not isinstance(row.get("label"), bool):
        raise DatasetError(f"{where(number, source, 'label')}: expected true (desirable) or false (undesirable), "
                           f"got {row.get('label')!r:.40}")
    prompt = row.get("prompt")
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    completion = _completion(row.get("completion"), number, source)
    conversation, _ = pair_conversations(prompt, completion, completion, number, source)
    return conversation


def _completion(value: Any, number: int | None, source: str | None) -> list[dict]:
    """A row's completion as one assistant message (a string is its content)."""
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    messages = [value] if isinstance(value, dict) else value
    if not (isinstance(messages, list) and len(messages) == 1 and isinstance(messages[0], dict)
            and messages[0].get("role") == "assistant" and isinstance(messages[0].get("content"), str)):
        raise DatasetError(f"{where(number, source, 'completion')}: expected a string or one assistant message "
                           f"{{'role': 'assistant', 'content': ...}}, got {value!r:.80}")
    return messages


def encode_kto_batch(batch: dict[str, list], tokenizer, max_length: int, template: Any, source: str | None):
    """A batch of unpaired rows -> ``input_ids``, ``labels``, ``prompt_length``, ``kto_label``, ``length``
    and a ``note`` / ``drop`` per row (what truncation did, or why the row goes)."""
    rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
    conversations = [example_conversation(row, source) for row in rows]
    encoded = encode_conversations(conversations, [row[ROW_COLUMN] for row in rows], tokenizer, template, source)
    out: dict[str, list] = {k: [] for k in ("input_ids", "labels", "prompt_length", "kto_label", "length",
                                            "note", "drop")}
    for row, (ids, labels) in zip(rows, encoded):
        prompt, note, drop = prompt_length(labels), "", ""
        if len(ids) > max_length:
            if prompt < max_length:
                ids, labels, note = ids[:max_length], labels[:max_length], NOTE_CUT
            else:
                drop = DROP_PROMPT_TOO_LONG
        for key, value in (("input_ids", ids), ("labels", labels), ("prompt_length", prompt),
                           ("kto_label", int(row["label"])), ("length", len(ids)), ("note", note), ("drop", drop)):
            out[key].append(value)
    return out


def build_kto_dataset(dataset, tokenizer=None, max_length=None, dataset_map_fn=None, prompt_template=None,
                      split="train", num_proc=None, source=None):
    """A training ``datasets.Dataset`` of unpaired examples for ``KTO``, one per row, in file order
    (the sampler shuffles).

    >>> ds = build_kto_dataset(rows, tokenizer, max_length=1024)   # doctest: +SKIP
    >>> ds[0]['kto_label'], ds[0]['prompt_length']                  # doctest: +SKIP
    (1, 41)
    """
    if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < 1:
        raise DatasetError(f"max_length must be a positive integer, got {max_length!r}")
    source = source or source_name(dataset_config(dataset))
    template = prompt_template_or_chat_template(prompt_template)
    tokenizer = build_if_config(tokenizer, "tokenizer")
    rows = number_rows(resolve_dataset(dataset_config(dataset), split))
    _, encoded = encode_kto_rows(rows, tokenizer, max_length, dataset_map_fn, template, num_proc, source)
    return _counted(encoded, len(rows), max_length)


def encode_kto_rows(rows, tokenizer, max_length: int, dataset_map_fn=None, template: Any = None,
                    num_proc: int | None = None, source: str | None = None):
    """Numbered rows -> (the rows after the map fn, every row encoded with its ``note`` and ``drop``):
    ``build_kto_dataset``'s steps before the counts, which ``check-custom-dataset`` prints."""
    rows_in = len(rows)
    map_fn = resolve_map_fn(dataset_map_fn)
    if map_fn is not None:
        rows = apply_map_fn(rows, map_fn, default_num_proc(rows_in, num_proc), source, PipelineReport())
    missing = [name for name in KTO_FIELDS if name not in rows.column_names]
    if missing:
        raise DatasetError(f"{source}: KTO rows need {', '.join(KTO_FIELDS)}; missing {', '.join(missing)} "
                           f"(columns: {', '.join(c for c in rows.column_names if c != ROW_COLUMN)}); set a "
                           "dataset_map_fn that writes them")
    encoded = rows.map(encode_kto_batch, batched=True, remove_columns=rows.column_names,
                       num_proc=default_num_proc(rows_in, num_proc), desc="Tokenizing KTO examples",
                       fn_kwargs=dict(tokenizer=tokenizer, max_length=max_length, template=template, source=source))
    return rows, encoded


# The registry hands `dataset` over unbuilt: its local JSON files are checked line by line before Arrow
# reads them (as build_preference_dataset's).
build_kto_dataset.build_args_lazily = ("dataset",)


def _counted(encoded, rows_in: int, max_length: int):
    """Log what truncation did and what was dropped; keep the examples without a drop reason."""
    notes, drops = encoded["note"], encoded["drop"]
    keep = [i for i, drop in enumerate(drops) if not drop]
    if not keep:
        raise DatasetError(f"no KTO example left to train on: all {rows_in} rows dropped ({DROP_PROMPT_TOO_LONG}, "
                           f"max_length={max_length})")
    dataset = encoded.select(keep).remove_columns(["note", "drop"])
    labels = dataset["kto_label"]
    log(f"KTO data: {rows_in} rows in, {len(dataset)} examples out ({sum(labels)} desirable, "
        f"{len(labels) - sum(labels)} undesirable)")
    if len(keep) < rows_in:
        log(f"KTO data: dropped {rows_in - len(keep)} rows: {DROP_PROMPT_TOO_LONG}", logging.WARNING)
    if NOTE_CUT in notes:
        log(f"KTO data: {notes.count(NOTE_CUT)} examples over max_length={max_length}: {NOTE_CUT}", logging.WARNING)
    return dataset
