"""``build_prompt_dataset``: the prompts of online RL (``GRPO``): load -> map fn -> render -> token ids.

    train_dataset = dict(type=build_prompt_dataset,
                         dataset=dict(type=load_data_path, path='gsm8k_train.jsonl'),
                         tokenizer=tokenizer, max_prompt_length=512, dataset_map_fn=gsm8k_map_fn)

A row's ``prompt`` is TRL's: a list of messages (an optional system message, user and earlier
assistant turns, the last one a user message) or a plain string (one user message). It is rendered
as the model will see it at inference: with the tokenizer's chat template and the generation prompt
(``PROMPT_TEMPLATE.hf_chat_template``, the default; Qwen3's ``enable_thinking`` comes from the
template's ``ENABLE_THINKING``), or with a ``PROMPT_TEMPLATE`` entry. Every other column of the row
stays, and reaches the reward functions under its own name.

Output rows: ``prompt_ids`` (what generation continues from), ``prompt`` (as the data gave it), the
row number (``ROW_COLUMN``) and the other columns. A prompt longer than ``max_prompt_length`` tokens is
an error naming the row, unless ``prompt_overflow`` is ``'truncate'`` (keep its last
``max_prompt_length`` tokens, as TRL cuts) or ``'drop'``; either way the rows are counted and logged.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from sfttool.dataset.chat_targets import render, template_kwargs
from sfttool.dataset.conversation import prompt_turns
from sfttool.dataset.chat_encode import chat_renderer
from sfttool.dataset.encode import encode_prompt
from sfttool.dataset.tokens import batch_token_ids
from sfttool.dataset.errors import ROW_COLUMN, DatasetError, check_positive_int, examples, where
from sfttool.dataset.pipeline import apply_map_fn, log
from sfttool.dataset.rows import default_num_proc, number_rows, select_rows
from sfttool.dataset.report import PipelineReport, change_lines, stage_recorder
from sfttool.dataset.resolve import (dataset_config, prompt_template_or_chat_template, resolve_dataset, resolve_map_fn,
                                     source_name)
from sfttool.registry import build_if_config, type_name
from sfttool.utils.templates import chat_template_options, is_hf_chat_template

PROMPT_OVERFLOW = ("error", "truncate", "drop")
DROP_TOO_LONG = "prompt longer than max_prompt_length"
TEMPLATE_PROMPT = " for a PROMPT_TEMPLATE; use prompt_template=PROMPT_TEMPLATE.hf_chat_template"
# Columns the encoding adds; the rest of a row goes to the reward functions.
ENCODED_COLUMNS = ("prompt_ids", "prompt_tokens", "overflow")


@dataclass
class PromptReport:
    rows_in: int = 0
    prompts: int = 0
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> rows
    truncated: int = 0  # prompts cut to max_prompt_length
    too_long_rows: list[int] = field(default_factory=list)  # the first rows over max_prompt_length
    stages: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------
# A row's prompt -> messages -> text -> ids.

def prompt_messages(prompt: Any, row: int | None = None, source: str | None = None,
                    system: str | None = None) -> list[dict]:
    """The prompt as chat messages, checked; ``system`` is prepended when the prompt has no system message.

    >>> prompt_messages('What is 2+2?')
    [{'role': 'user', 'content': 'What is 2+2?'}]
    """
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    else:
        ok = isinstance(prompt, (list, tuple)) and len(prompt) > 0 and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in prompt)
        if not ok:
            raise DatasetError(f"{where(row, source, 'prompt')}: expected a string or a non-empty list of messages "
                               f"{{'role': ..., 'content': ...}}, got {prompt!r:.80}; set a dataset_map_fn "
                               "(e.g. gsm8k_map_fn, math_map_fn)")
        messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
    if messages[-1]["role"] == "assistant":
        raise DatasetError(f"{where(row, source, 'prompt')}: the prompt ends with an assistant message; a prompt "
                           "ends with the message the model answers (a user message): remove the answer from the "
                           "prompt (or move it to another column, e.g. `solution`, for the reward functions)")
    if system and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system})
    return messages


def render_prompt(messages: list[dict], tokenizer, template: Any, row: int | None = None) -> str | list[int]:
    """The text the chat template renders with the generation prompt (HF chat-template mode), or the ids
    of an XTuner template's rendering."""
    if is_hf_chat_template(template):
        options = chat_template_options(template)
        return render(chat_renderer(tokenizer, options), messages, True, row=row, **template_kwargs(messages, options))
    return encode_prompt(prompt_turns(messages, row, expected=TEMPLATE_PROMPT), tokenizer, template)


def encode_prompts(prompts: Sequence[Any], rows: Sequence[int], tokenizer, template: Any,
                   source: str | None = None, system: str | None = None) -> list[list[int]]:
    """Token ids of each prompt as generation continues from it (texts tokenized in one call)."""
    rendered = [render_prompt(prompt_messages(p, r, source, system), tokenizer, template, r)
                for p, r in zip(prompts, rows)]
    texts = [i for i, r in enumerate(rendered) if isinstance(r, str)]
    for i, ids in zip(texts, batch_token_ids(tokenizer, [rendered[i] for i in texts]) if texts else []):
        rendered[i] = list(ids)
    return rendered


def encode_prompt_batch(batch: dict[str, list], indices: Sequence[int], tokenizer, template: Any,
                        max_prompt_length: int, prompt_overflow: str, source: str | None = None,
                        system: str | None = None) -> dict[str, list]:
    """Batched ``datasets.map`` function: adds ``prompt_ids`` (cut to its last ``max_prompt_length``
    tokens under 'truncate'), ``prompt_tokens`` (the uncut length) and ``overflow``."""
    rows = list(batch[ROW_COLUMN]) if ROW_COLUMN in batch else list(indices)
    ids = encode_prompts(batch["prompt"], rows, tokenizer, template, source, system)
    over = [len(i) > max_prompt_length for i in ids]
    kept = [i[-max_prompt_length:] if o and prompt_overflow == "truncate" else i for i, o in zip(ids, over)]
    return {"prompt_ids": kept, "prompt_tokens": [len(i) for i in ids], "overflow": over}


# ---------------------------------------------------------------------------
# The pipeline.

def require_prompts(dataset, map_fn: Any) -> None:
    if "prompt" not in dataset.column_names:
        columns = ", ".join(c for c in dataset.column_names if c != ROW_COLUMN)
        after = " after the dataset_map_fn" if map_fn is not None else ""
        raise DatasetError(f"prompt rows need a `prompt` column{after} (columns: {columns}); set a dataset_map_fn "
                           "such as gsm8k_map_fn (question/answer) or math_map_fn (problem/solution)")


def settle_overflow(dataset, report: PromptReport, max_prompt_length: int, prompt_overflow: str,
                    source: str | None):
    """Count the prompts over ``max_prompt_length``; refuse them, or drop them (truncated ones are cut already)."""
    over = np.asarray(dataset["overflow"], dtype=bool)
    rows = np.asarray(dataset[ROW_COLUMN])[over].tolist()
    report.too_long_rows = rows[:5]
    if over.any() and prompt_overflow == "error":
        longest = int(np.asarray(dataset["prompt_tokens"])[over].max())
        named = examples([f"row {r}" for r in rows], total=len(rows))
        raise DatasetError(f"{source or 'dataset'}: {len(rows)} prompts are longer than max_prompt_length="
                           f"{max_prompt_length} tokens ({named}; the longest has {longest}); raise "
                           "max_prompt_length, or set prompt_overflow='truncate' (keep each prompt's last "
                           "max_prompt_length tokens) or 'drop'")
    if prompt_overflow == "truncate":
        report.truncated = len(rows)
    elif over.any():
        report.dropped[DROP_TOO_LONG] = len(rows)
        dataset = dataset.select(np.flatnonzero(~over))
    if len(dataset) == 0:
        raise DatasetError(f"{source or 'dataset'}: no prompts left to train on ({len(rows)} over "
                           f"max_prompt_length={max_prompt_length} dropped); raise max_prompt_length")
    return dataset.remove_columns(["overflow"])


def run_prompt_pipeline(dataset, tokenizer, max_prompt_length: int, dataset_map_fn=None, prompt_template=None,
                        prompt_overflow="error", system=None, max_dataset_length=None, split="train",
                        num_proc=None, seed=0, source=None, keep_stages=False):
    """All stages in order; returns ``(dataset, PromptReport)``."""
    check_positive_int(max_prompt_length, "max_prompt_length")
    if prompt_overflow not in PROMPT_OVERFLOW:
        raise DatasetError(f"prompt_overflow must be one of {', '.join(PROMPT_OVERFLOW)}, got {prompt_overflow!r}")
    source = source or source_name(dataset)
    template = prompt_template_or_chat_template(prompt_template)
    tokenizer = build_if_config(tokenizer, "tokenizer")
    dataset = number_rows(resolve_dataset(dataset, split))
    report = PromptReport(rows_in=len(dataset))
    stage = stage_recorder(report, keep_stages)
    stage("loaded", dataset)
    num_proc = default_num_proc(len(dataset), num_proc)
    dataset = select_rows(dataset, max_dataset_length, seed, PipelineReport())
    report.dropped.update({"not in the max_dataset_length subset": report.rows_in - len(dataset)}
                          if len(dataset) < report.rows_in else {})
    map_fn = resolve_map_fn(dataset_map_fn)
    if map_fn is not None:
        changes = PipelineReport()
        dataset = apply_map_fn(dataset, map_fn, num_proc, source, changes)
        for line in change_lines(changes):
            log(f"Prompt data: {line}", logging.WARNING)
        stage("map_fn", dataset)
    require_prompts(dataset, map_fn)
    dataset = dataset.map(encode_prompt_batch, batched=True, with_indices=True, num_proc=num_proc,
                          fn_kwargs=dict(tokenizer=tokenizer, template=template, max_prompt_length=max_prompt_length,
                                         prompt_overflow=prompt_overflow, source=source, system=system),
                          desc="Rendering and tokenizing prompts")
    dataset = settle_overflow(dataset, report, max_prompt_length, prompt_overflow, source)
    report.prompts = len(dataset)
    stage("encoded", dataset)
    return dataset, report


def reward_columns(dataset) -> list[str]:
    """The columns the reward functions receive by name (all but the encoding's and the row number)."""
    return [c for c in dataset.column_names if c not in (*ENCODED_COLUMNS, ROW_COLUMN, "prompt")]


def log_prompt_report(report: PromptReport, max_prompt_length: int, columns: list[str]) -> None:
    log(f"Prompt data: {report.rows_in} rows in, {report.prompts} prompts out; the reward functions receive "
        f"prompts, completions, completion_ids{''.join(', ' + c for c in columns)}")
    for reason, count in report.dropped.items():
        log(f"Prompt data: dropped {count} rows: {reason}", logging.WARNING)
    if report.truncated:
        log(f"Prompt data: {report.truncated} prompts over max_prompt_length={max_prompt_length} kept their last "
            f"{max_prompt_length} tokens (rows {', '.join(map(str, report.too_long_rows))}...)", logging.WARNING)


def build_prompt_dataset(dataset, tokenizer=None, max_prompt_length=512, dataset_map_fn=None, prompt_template=None,
                         prompt_overflow="error", system=None, max_dataset_length=None, split="train", num_proc=None,
                         seed=0, source=None):
    """A ``datasets.Dataset`` of prompts for ``GRPO`` (see the module docstring).

    >>> ds = build_prompt_dataset(rows, tokenizer, max_prompt_length=256, dataset_map_fn=gsm8k_map_fn)  # doctest: +SKIP
    >>> ds[0]['prompt_ids'][:3], ds[0]['solution']                                                      # doctest: +SKIP
    ([151644, 8948, 198], '72')

    ``system`` is a system message put before prompts that have none; ``seed`` picks the
    ``max_dataset_length`` subset.
    """
    dataset, report = run_prompt_pipeline(dataset_config(dataset), tokenizer, max_prompt_length, dataset_map_fn,
                                          prompt_template, prompt_overflow, system, max_dataset_length, split,
                                          num_proc, seed, source)
    log_prompt_report(report, max_prompt_length, reward_columns(dataset))
    return dataset


def validation_problems(cfg: Any, path: str) -> list[str]:
    """A prompt (online RL) config that asks for validation: one line naming the keys. The validation loop
    measures the SFT token loss of answers, which prompts do not have; it is refused rather than run or
    silently skipped."""
    dataset = ((cfg.get("train_dataloader") or {}).get("dataset") or {}) if isinstance(cfg, dict) else {}
    if not isinstance(dataset, dict) or not type_name(dataset.get("type")).endswith("build_prompt_dataset"):
        return []
    keys = [k for k in ("val_ratio", "val_data_path", "val_dataloader") if cfg.get(k)]
    if not keys:
        return []
    return [f"{path}: {', '.join(keys)}: online RL (GRPO) has no validation yet (the validation loop measures the "
            f"SFT token loss of answers, and prompts have none); remove {' and '.join(keys)} (or set them to None)"]


# As for process_hf_dataset: the registry hands `dataset` over as its config, so local JSON files are checked
# line by line before Arrow reads them and errors name the file.
build_prompt_dataset.build_args_lazily = ("dataset",)
