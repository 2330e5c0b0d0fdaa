"""``check-custom-dataset`` for a ``build_preference_dataset`` config: every row validated, the
stages printed (raw row, after the map fn, a chosen and a rejected sequence with their masked
parts, the first packed row) and the counts (pairs, drops and truncations by reason, lengths,
packing)."""
from __future__ import annotations

from typing import Any

import numpy as np

from sfttool.dataset.config_node import is_built_by, pipeline_args
from sfttool.dataset.errors import ROW_COLUMN, DatasetError, where
from sfttool.dataset.preference import build_preference_dataset, reward_token, run_preference_pipeline
from sfttool.dataset.preference_encode import pair_conversations
from sfttool.dataset.resolve import source_name
from sfttool.registry import build_if_config
from sfttool.tools.check_source import checked_rows
from sfttool.tools.findings import Echo, Findings, collect_mapped_row_errors, guard
from sfttool.tools.masked_view import legend, length_line, show_masked, shorten


def is_preference_node(node: Any) -> bool:
    return is_built_by(node, build_preference_dataset)


def check_pair_rows(dataset, map_fn, source: str | None, findings: Findings, max_errors: int) -> None:
    """Run the map fn and the pair checks on every row; list the first errors."""
    def check(row: dict, index: int) -> None:
        missing = [f for f in ("prompt", "chosen", "rejected") if f not in row]
        if missing:
            raise DatasetError(f"{where(index, source)}: no {', '.join(missing)}; set a "
                               "dataset_map_fn for this format (see docs/preference.md)")
        pair_conversations(row["prompt"], row["chosen"], row["rejected"], index, source)

    collect_mapped_row_errors(dataset, map_fn, source, check, findings, max_errors)


def print_preference_stages(report, tokenizer, echo: Echo, color: bool) -> None:
    for key, title in (("loaded", "raw row"), ("map_fn", "after dataset_map_fn")):
        if key in report.stages and len(report.stages[key]):
            row = {k: v for k, v in report.stages[key][0].items() if k != ROW_COLUMN}
            echo(f"\n== {title} (row 0) ==\n{shorten(row)}")
    encoded = report.stages.get("encoded")
    if encoded is not None and len(encoded):
        pair = encoded[0]
        for side in ("chosen", "rejected"):
            ids, labels = pair[f"{side}_input_ids"], pair[f"{side}_labels"]
            echo(f"\n== {side} (pair 0: {len(ids)} tokens, {pair['prompt_tokens']} prompt; {legend(color)}) ==")
            echo(show_masked(ids, labels, tokenizer, color))
    final = report.stages.get("packed", report.stages.get("rows"))
    if final is not None and len(final):
        row = final[0]
        echo(f"\n== final row 0: {row['length']} tokens, sequences (chosen, rejected, ...) of "
             f"{row['sample_lengths']} ==")


def print_preference_stats(report, args: dict, batch_size: int | None, echo: Echo) -> None:
    echo("\n== statistics ==")
    echo(f"rows in: {report.rows_in}   pairs: {report.pairs}   rows out: {report.rows_out}")
    for reason, count in report.dropped.items():
        echo(f"dropped: {count} pairs ({reason})")
    for how, count in report.truncated.items():
        echo(f"over max_length={args['max_length']}: {count} pairs ({how})")
    encoded = report.stages.get("encoded")
    if encoded is not None and len(encoded):
        table = encoded.with_format("arrow")[:]
        for name in ("prompt_tokens", "length"):
            label = "prompt length" if name == "prompt_tokens" else "pair length (chosen + rejected)"
            echo(length_line(f"{label} (tokens)", np.asarray(table[name].to_numpy())))
    if report.capacity:
        echo(f"packing: {report.pairs} pairs -> {report.rows_out} rows of <= {args['max_packed_length']} tokens, "
             f"efficiency {100 * report.tokens / report.capacity:.1f}%")
    echo(f"tokens per epoch: {report.tokens}")
    if batch_size:
        echo(f"iterations per epoch (batch_size={batch_size}, one process): {-(-report.rows_out // batch_size)}")


def check_preference(node: dict, findings: Findings, max_errors: int, echo: Echo, color: bool,
                     batch_size: int | None) -> None:
    """All checks and printouts for one build_preference_dataset node."""
    args = pipeline_args(node, build_preference_dataset)
    source = args["source"] or source_name(args["dataset"])
    raw = checked_rows(args, source, check_pair_rows, findings, max_errors, echo)
    if raw is None:
        return
    tokenizer = build_if_config(args["tokenizer"], "tokenizer")
    packed = args["max_packed_length"] if args["pack_to_max_length"] else None
    reward = reward_token(args["is_reward"], args["reward_token_id"])
    result = guard(findings, run_preference_pipeline, raw, tokenizer, args["max_length"], args["dataset_map_fn"],
                    args["prompt_template"], packed, args["shuffle_before_pack"], args["max_dataset_length"],
                    args["split"], args["num_proc"], args["seed"], source, True, reward)
    if result is not None:
        print_preference_stages(result[1], tokenizer, echo, color)
        print_preference_stats(result[1], args, batch_size, echo)
