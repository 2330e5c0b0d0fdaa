"""``check-custom-dataset`` for a ``build_kto_dataset`` config (KTO's unpaired rows): every row checked (the
map fn, the prompt, the completion and its label), the stages printed (raw row, after the map fn, an
example with its masked part) and the counts (examples by label, cuts and drops, lengths)."""
from __future__ import annotations

from typing import Any

import numpy as np

from sfttool.dataset.config_node import is_built_by, pipeline_args
from sfttool.dataset.errors import ROW_COLUMN, DatasetError, where
from sfttool.dataset.kto import (DROP_PROMPT_TOO_LONG, KTO_FIELDS, NOTE_CUT, build_kto_dataset, encode_kto_rows,
                                 example_conversation)
from sfttool.dataset.resolve import prompt_template_or_chat_template, source_name
from sfttool.dataset.rows import number_rows
from sfttool.registry import build_if_config
from sfttool.tools.check_source import checked_rows
from sfttool.tools.findings import Echo, Findings, collect_mapped_row_errors, guard
from sfttool.tools.masked_view import legend, length_line, show_masked, shorten


def is_kto_node(node: Any) -> bool:
    return is_built_by(node, build_kto_dataset)


def check_kto_rows(dataset, map_fn, source: str | None, findings: Findings, max_errors: int) -> None:
    """Run the map fn and the row checks on every row; list the first errors."""
    def check(row: dict, index: int) -> None:
        missing = [f for f in KTO_FIELDS if f not in row]
        if missing:
            raise DatasetError(f"{where(index, source)}: no {', '.join(missing)}; set a dataset_map_fn for this "
                               "format (see docs/preference.md)")
        example_conversation(dict(row, **{ROW_COLUMN: index}), source)

    collect_mapped_row_errors(dataset, map_fn, source, check, findings, max_errors)


def print_kto(rows, mapped, encoded, tokenizer, max_length: int, batch_size: int | None, echo: Echo,
              color: bool) -> None:
    """The stages of the first example, then the counts of the whole set."""
    echo(f"\n== raw row (row 0) ==\n{shorten({k: v for k, v in rows[0].items() if k != ROW_COLUMN})}")
    if mapped is not rows and len(mapped):
        echo(f"\n== after dataset_map_fn (row 0) ==\n{shorten({k: v for k, v in mapped[0].items() if k != ROW_COLUMN})}")
    if len(encoded):
        example = encoded[0]
        kind = "desirable" if example["kto_label"] else "undesirable"
        echo(f"\n== example 0 ({kind}: {example['length']} tokens, {example['prompt_length']} prompt; "
             f"{legend(color)}) ==")
        echo(show_masked(example["input_ids"], example["labels"], tokenizer, color))
    notes, drops, labels = encoded["note"], encoded["drop"], encoded["kto_label"]
    kept = [label for label, drop in zip(labels, drops) if not drop]
    echo("\n== statistics ==")
    echo(f"rows in: {len(rows)}   examples: {len(kept)} ({sum(kept)} desirable, {len(kept) - sum(kept)} undesirable)")
    if drops.count(DROP_PROMPT_TOO_LONG):
        echo(f"dropped: {drops.count(DROP_PROMPT_TOO_LONG)} rows ({DROP_PROMPT_TOO_LONG}, max_length={max_length})")
    if notes.count(NOTE_CUT):
        echo(f"over max_length={max_length}: {notes.count(NOTE_CUT)} examples ({NOTE_CUT})")
    if kept:
        table = encoded.with_format("arrow")[:]
        keep = np.asarray([not drop for drop in drops])
        for name, label in (("prompt_length", "prompt length"), ("length", "example length (prompt + completion)")):
            echo(length_line(f"{label} (tokens)", np.asarray(table[name].to_numpy())[keep]))
        if batch_size:
            echo(f"iterations per epoch (batch_size={batch_size}, one process): {-(-len(kept) // batch_size)}")
        if len(kept) - sum(kept) == 0 or sum(kept) == 0:
            echo("note: every example has the same label: KTO learns from both kinds (see docs/preference.md)")


def check_kto(node: dict, findings: Findings, max_errors: int, echo: Echo, color: bool,
              batch_size: int | None) -> None:
    """All checks and printouts for one build_kto_dataset node."""
    args = pipeline_args(node, build_kto_dataset)
    source = args["source"] or source_name(args["dataset"])
    raw = checked_rows(args, source, check_kto_rows, findings, max_errors, echo)
    if raw is None:
        return
    tokenizer = build_if_config(args["tokenizer"], "tokenizer")
    rows = number_rows(raw)
    template = prompt_template_or_chat_template(args["prompt_template"])
    result = guard(findings, encode_kto_rows, rows, tokenizer, args["max_length"], args["dataset_map_fn"], template,
                   args["num_proc"], source)
    if result is not None:
        print_kto(rows, result[0], result[1], tokenizer, args["max_length"], batch_size, echo, color)
