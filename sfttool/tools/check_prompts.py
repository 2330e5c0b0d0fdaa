"""``check-custom-dataset`` for a ``build_prompt_dataset`` config (online RL): every row checked (the map fn,
the prompt's messages, the length), the first prompts shown exactly as the model will see them (the
rendered text generation continues from, special tokens included) with the columns the reward
functions will receive, and the counts (prompts, drops and truncations, lengths, rounds per epoch)."""
from __future__ import annotations

from typing import Any

import numpy as np

from sfttool.dataset.config_node import is_built_by, pipeline_args
from sfttool.dataset.errors import ROW_COLUMN, DatasetError
from sfttool.dataset.prompts import (build_prompt_dataset, prompt_messages, reward_columns,
                                     run_prompt_pipeline)
from sfttool.dataset.resolve import source_name
from sfttool.registry import build_if_config
from sfttool.tools.check_source import checked_rows
from sfttool.tools.findings import Echo, Findings, collect_mapped_row_errors, guard
from sfttool.tools.masked_view import length_line, shorten

SHOWN_PROMPTS = 3


def is_prompt_node(node: Any) -> bool:
    return is_built_by(node, build_prompt_dataset)


def check_prompt_rows(dataset, map_fn, source: str | None, findings: Findings, max_errors: int) -> None:
    """Run the map fn and the prompt checks on every row; list the first errors."""
    def check(row: dict, index: int) -> None:
        if row.get("prompt") is None:  # absent, or null where other rows have one
            raise DatasetError(f"{source or 'dataset'}, row {index}: no `prompt`; set a dataset_map_fn for this "
                               "format (gsm8k_map_fn, math_map_fn; see docs/rl.md)")
        prompt_messages(row["prompt"], index, source)

    collect_mapped_row_errors(dataset, map_fn, source, check, findings, max_errors)


def print_prompts(dataset, tokenizer, columns: list[str], echo: Echo) -> None:
    """The first prompts as generation will continue from them, and what the reward functions get."""
    for row in dataset.select(range(min(SHOWN_PROMPTS, len(dataset)))):
        ids = row["prompt_ids"]
        echo(f"\n== prompt of row {row[ROW_COLUMN]} as the model sees it ({len(ids)} tokens; the completion follows "
             f"the last line) ==\n{tokenizer.decode(ids)}")
        given = {"prompts": row["prompt"], **{name: row[name] for name in columns}}
        echo("reward functions receive: " + ", ".join(f"{k}={shorten(v, 120)}" for k, v in given.items()))
    if len(dataset) > SHOWN_PROMPTS:
        echo(f"\n({len(dataset) - SHOWN_PROMPTS} more prompts are rendered the same way)")


def print_prompt_stats(dataset, report, args: dict, batch_size: int | None, echo: Echo) -> None:
    echo("\n== statistics ==")
    echo(f"rows in: {report.rows_in}   prompts: {report.prompts}")
    for reason, count in report.dropped.items():
        echo(f"dropped: {count} rows ({reason})")
    if report.truncated:
        echo(f"over max_prompt_length={args['max_prompt_length']}: {report.truncated} prompts kept their last "
             f"{args['max_prompt_length']} tokens")
    lengths = np.asarray(dataset["prompt_tokens"])
    if len(lengths):
        echo(f"{length_line('prompt length (tokens, before any truncation)', lengths)}  "
             f"(max_prompt_length={args['max_prompt_length']})")
    if batch_size:
        echo(f"generation rounds per epoch (batch_size={batch_size} prompts per round, one process): "
             f"{-(-report.prompts // batch_size)}")


def check_prompts(node: dict, findings: Findings, max_errors: int, echo: Echo, color: bool,
                  batch_size: int | None) -> None:
    """All checks and printouts for one build_prompt_dataset node."""
    args = pipeline_args(node, build_prompt_dataset)
    source = source_name(args["dataset"])
    raw = checked_rows(args, source, check_prompt_rows, findings, max_errors, echo)
    if raw is None:
        return
    tokenizer = build_if_config(args["tokenizer"], "tokenizer")
    result = guard(findings, run_prompt_pipeline, raw, tokenizer, args["max_prompt_length"], args["dataset_map_fn"],
                    args["prompt_template"], args["prompt_overflow"], args["system"], args["max_dataset_length"],
                    args["split"], args["num_proc"], args["seed"], source)
    if result is not None:
        dataset, report = result
        print_prompts(dataset, tokenizer, reward_columns(dataset), echo)
        print_prompt_stats(dataset, report, args, batch_size, echo)
