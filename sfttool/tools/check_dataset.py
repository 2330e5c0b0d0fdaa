"""``sfttool check-custom-dataset CFG``: build a config's training data stage by
stage, validate every row, show what is trained, and print statistics.

    >>> check_dataset('my_cfg.py')      # doctest: +SKIP
    Config: /abs/my_cfg.py
    ...
    0  (exit code: 0 = no errors, 1 = errors)

Errors (exit 1): data not in the standard format without a dataset_map_fn,
standard data with a map fn, malformed JSON, rows failing the schema (file,
row and field; the first ``max_errors`` are listed), a map fn raising.
Warnings (exit 0): packing with ``remove_unused_columns=False``, template role
markers the tokenizer splits into several tokens, a template that renders
differently from the tokenizer's own ``chat_template``.
"""
from __future__ import annotations

import inspect
from typing import Any

import numpy as np

from sfttool.config import find_config, load_config
from sfttool.dataset.chat_targets import describe
from sfttool.dataset.config_node import dataset_node, is_process_hf_dataset, pipeline_args
from sfttool.dataset.conversation import check_conversation, check_turn_keys, is_empty, to_messages
from sfttool.dataset.errors import ROW_COLUMN, DatasetError, where
from sfttool.dataset.image_tokens import image_token_id
from sfttool.dataset.image_rows import IMAGES_COLUMN, LLAVA_COLUMN, bind_row, decode_image
from sfttool.dataset.images_stage import build_processor, data_folder
from sfttool.dataset.data_sources import process_data_sources, run_sources, source_lines
from sfttool.dataset.mix import mix_datasets
from sfttool.dataset.streaming_sources import StreamingDataSources, stream_problems
from sfttool.dataset.pipeline import run_pipeline
from sfttool.dataset.report import change_lines, drop_emptied, drop_lines, split_lines
from sfttool.dataset.resolve import resolve_map_fn, skip_bad_rows_in, source_name, template_of
from sfttool.dataset.source_stages import KEEP_COLUMN, filter_batch, load_source, source_label, sources_problems
from sfttool.dataset.stages import SafeMapFn, map_rows, missing_conversation
from sfttool.dataset.template_check import template_warnings
from sfttool.registry import build_if_config, resolve_type, type_name
from sfttool.tools.check_kto import check_kto, is_kto_node
from sfttool.tools.check_preference import check_preference, is_preference_node
from sfttool.tools.check_prompts import check_prompts, is_prompt_node
from sfttool.tools.check_source import load_every_row, load_trained_part
from sfttool.tools.findings import Echo, Findings, collect_row_errors, finish, guard
from sfttool.tools.masked_view import legend, length_line, show_masked, shorten
from sfttool.utils.constants import IGNORE_INDEX


# ---------------------------------------------------------------------------
# XTuner's checks, then every row against the standard schema.

def check_settings(args: dict, raw, map_fn, source: str | None, findings: Findings) -> None:
    standard = "conversation" in raw.column_names
    if map_fn is None and not standard:
        first = raw[0] if len(raw) else dict.fromkeys(raw.column_names)
        findings.error(f"{where(0, source)}: {missing_conversation(first, None)}, or convert the data to "
                       "{'conversation': [...]}")
    if map_fn is not None and standard and len(raw.column_names) == 1:
        findings.error(f"{source or 'the data'}: the data is already in the standard `conversation` format but a "
                       "dataset_map_fn is set: set dataset_map_fn=None")
    if args.get("pack_to_max_length") and not args.get("remove_unused_columns"):
        findings.warn("pack_to_max_length=True with remove_unused_columns=False: unused columns are removed "
                      "anyway when packing; set remove_unused_columns=True to say so")


def check_rows(dataset, map_fn, source: str | None, findings: Findings, max_errors: int,
               image_folder: Any = False, decode_images: bool = False) -> None:
    """Run the pipeline's map fn stage and the schema check on every row; list the first errors.
    ``image_folder`` (None or a folder; False: not image data) checks each row's images too, decoding
    them whole with ``decode_images``."""
    collect_row_errors(dataset, lambda row, index: check_row(row, index, map_fn, source, image_folder, decode_images),
                       findings, max_errors)


def check_row(row: dict, index: int, map_fn, source: str | None, image_folder: Any = False,
              decode_images: bool = False) -> None:
    """One raw row through the map fn stage, then strictly against the standard schema: a row the
    pipeline would drop whole is an error here, named with the cause the pipeline counts it under.
    Image data (``image_folder`` not False): its images found, readable and one per placeholder."""
    notes: list[str] = []
    if map_fn is not None:
        mapped, changes = map_rows([row], [index], map_fn, source)
        row, notes = {**row, **mapped[0]}, changes[0]  # as the pipeline's map stage keeps the other fields
    conversation = row.get("conversation")
    if is_empty(conversation):
        raise DatasetError(f"{where(index, source)}: {drop_emptied(notes)} (this row would be dropped)")
    check_conversation(conversation, index, source)
    check_turn_keys(conversation, index, source)
    if image_folder is not False:
        given = row.get(IMAGES_COLUMN) if row.get(IMAGES_COLUMN) is not None else row.get(LLAVA_COLUMN)
        _, paths, _ = bind_row(conversation, given, image_folder, data_folder(source, index), index, source)
        for path in paths if decode_images else ():
            decode_image(path, index, source)


# ---------------------------------------------------------------------------
# Display.

def show_row(row: dict) -> str:
    """One field a line; the ``conversation`` whole, a turn a line (it is what gets trained), other
    fields shortened."""
    lines = []
    for key, value in row.items():
        if key == ROW_COLUMN:
            continue
        if key == "conversation" and isinstance(value, list):
            lines.append("conversation:")
            lines += [f"  [{i}] {turn!r}" for i, turn in enumerate(value)]
        else:
            lines.append(f"{key}: {shorten(value)}")
    return "\n".join(lines)


def print_stages(report, tokenizer, echo: Echo, color: bool, map_fn_key: str = "dataset_map_fn",
                 image_token_id: int | None = None) -> None:
    names = {"loaded": "raw row", "map_fn": f"after {map_fn_key}", "template": "after template_map_fn",
             "images": "after binding images"}
    for key, title in names.items():
        if key in report.stages and len(report.stages[key]):
            echo(f"\n== {title} (row 0) ==\n{show_row(report.stages[key][0])}")
    encoded = report.stages.get("encoded")
    if encoded is not None and len(encoded):
        row = encoded[0]
        echo(f"\n== input_ids (row 0) ==\n{shorten(row['input_ids'])}")
        echo(f"\n== labels (row 0) ==\n{shorten(row['labels'])}")
        echo(f"\n== trained vs masked (row 0; {legend(color)}, trained text plain) ==")
        echo(show_masked(row["input_ids"], row["labels"], tokenizer, color, row.get("images"), image_token_id))
        print_image_row(encoded, tokenizer, echo, color, image_token_id)
    final = report.stages.get("packed", report.stages.get("rows"))
    if final is not None and len(final):
        row = final[0]
        echo(f"\n== final row 0: {row['length']} tokens, samples of {row['sample_lengths']} ==")


def print_image_row(encoded, tokenizer, echo: Echo, color: bool, image_token_id: int | None) -> None:
    """The first sample with images (when row 0 has none): each image in its place with its token count."""
    if image_token_id is None or "images" not in encoded.column_names or encoded[0]["images"]:
        return
    first = next((i for i, images in enumerate(encoded["images"]) if images), None)
    if first is not None:
        row = encoded[first]
        number = row.get(ROW_COLUMN, first)
        echo(f"\n== an image row (row {number}), trained vs masked ==")
        echo(show_masked(row["input_ids"], row["labels"], tokenizer, color, row["images"], image_token_id))


def image_lines(encoded) -> list[str]:
    """``images: 5 (in 3 of 4 samples)``: how many images the samples hold."""
    if encoded is None or "images" not in encoded.column_names:
        return []
    counts = [len(images) for images in encoded["images"]]
    return [f"images: {sum(counts)} (in {sum(1 for n in counts if n)} of {len(counts)} samples)"]


def row_kinds(report) -> dict[int, str]:
    """Each row's kind ('plain', 'reasoning', 'tool calls'), from its standard conversation."""
    stage = next((report.stages[k] for k in ("template", "map_fn", "loaded") if k in report.stages
                  and "conversation" in report.stages[k].column_names), None)
    if stage is None:
        return {}
    kinds = {}
    for number, conversation in zip(stage[ROW_COLUMN], stage["conversation"]):
        try:
            kinds[number] = describe(to_messages(conversation or []))
        except (DatasetError, ValueError, TypeError, KeyError, AttributeError):
            continue  # the pipeline names a malformed row
    return kinds


def print_kinds(report, kinds: dict[int, str], tokenizer, echo: Echo, color: bool) -> None:
    """Rows counted by kind, and one tool-calling and one reasoning sample with the trained parts marked."""
    if not kinds:
        return
    counts = {kind: list(kinds.values()).count(kind) for kind in ("plain", "reasoning", "tool calls")}
    echo("\n== rows by kind ==\n" + "   ".join(f"{kind}: {n}" for kind, n in counts.items()))
    encoded = report.stages.get("encoded")
    if encoded is None or ROW_COLUMN not in encoded.column_names:
        return
    numbers = encoded[ROW_COLUMN]
    for kind in ("tool calls", "reasoning"):
        first = next((i for i, n in enumerate(numbers) if kinds.get(n) == kind), None)
        if first is not None:
            sample = encoded[first]
            echo(f"\n== a {kind} row (row {numbers[first]}), trained vs masked ==")
            echo(show_masked(sample["input_ids"], sample["labels"], tokenizer, color))


def unterminated_turns(encoded, tokenizer) -> tuple[int, list[int]]:
    """Trained turns (runs of trained tokens) whose last token is not a special token (EOS, end of turn):
    ``(count, first rows)``. The model would not learn to stop after them."""
    if encoded is None or not len(encoded):
        return 0, []
    enders = set(tokenizer.all_special_ids) | {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()
                                              if t.special}
    count, rows = 0, []
    numbers = encoded[ROW_COLUMN] if ROW_COLUMN in encoded.column_names else range(len(encoded))
    for labels, number in zip(encoded["labels"], numbers):
        ends = [labels[i] for i in range(len(labels))
                if labels[i] != IGNORE_INDEX and (i + 1 == len(labels) or labels[i + 1] == IGNORE_INDEX)]
        missing = sum(1 for token in ends if token not in enders)
        count += missing
        if missing and len(rows) < 3:
            rows.append(number)
    return count, rows


def check_turn_ends(report, tokenizer, findings: Findings) -> None:
    count, rows = unterminated_turns(report.stages.get("encoded"), tokenizer)
    if count:
        findings.warn(f"{count} trained turns do not end with an end-of-turn token (rows "
                      f"{', '.join(map(str, rows))}{', ...' if count > len(rows) else ''}): the model will not learn "
                      "to stop there; check the template's SUFFIX / need_eos_token, or the rows' truncation")


def print_stats(report, args: dict, batch_size: int | None, echo: Echo) -> None:
    lengths = np.asarray(report.sample_lengths)
    echo("\n== statistics ==")
    echo(f"rows in: {report.rows_in}   rows out: {report.rows_out}")
    for line in split_lines(report) + drop_lines(report) + image_lines(report.stages.get("encoded")):
        echo(line)
    if len(lengths):
        echo(length_line("sample length (tokens)", lengths))
        echo(f"truncated at max_length={args['max_length']}: {report.truncated} samples "
             f"({100 * report.truncated / max(1, report.encoded):.1f}% of {report.encoded} encoded)")
        echo(f"trained tokens: {report.trained_tokens} of {report.tokens} "
             f"({100 * report.trained_tokens / max(1, report.tokens):.1f}%)")
    if report.pack is not None:
        echo(f"packing ({args.get('pack_strategy')}): {report.pack.samples} samples -> {report.pack.rows} rows, "
             f"efficiency {100 * report.pack.efficiency:.1f}%, split samples {report.pack.split_samples}")
    echo(f"tokens per epoch: {report.tokens}")
    if batch_size:
        echo(f"iterations per epoch (batch_size={batch_size}, one process): {-(-report.rows_out // batch_size)}")


# ---------------------------------------------------------------------------
# The command.

def check_dataset(config: str, cfg_options=None, max_errors: int = 10, echo: Echo = print,
                  color: bool = False, skip_bad_rows: bool = False, decode_images: bool = False) -> int:
    """Check a config's training dataset; return the exit code (0 ok, 1 errors).

    A ``mix_datasets`` node is checked dataset by dataset, a ``process_data_sources`` node source by
    source. ``skip_bad_rows``: as ``sfttool train --skip-bad-rows`` (``resolve.skip_bad_rows_in``).
    ``decode_images``: image-text rows' images are decoded whole, not only their headers read.
    """
    echo(f"Config: {find_config(config)}")
    cfg = load_config(config, cfg_options)
    if skip_bad_rows:
        skip_bad_rows_in(cfg)
    node = dataset_node(cfg)
    findings = Findings(echo)
    batch_size = cfg.get("train_dataloader", {}).get("batch_size")
    if is_preference_node(node):
        check_preference(node, findings, max_errors, echo, color, batch_size)
    elif is_kto_node(node):
        check_kto(node, findings, max_errors, echo, color, batch_size)
    elif is_prompt_node(node):
        check_prompts(node, findings, max_errors, echo, color, batch_size)
    elif resolve_type(node["type"], "train_dataloader.dataset.type") in (process_data_sources, StreamingDataSources):
        check_sources_node(node, findings, max_errors, echo, color, batch_size)
    elif resolve_type(node["type"], "train_dataloader.dataset.type") is mix_datasets:
        parts = list(node.get("datasets") or [])
        for i, part in enumerate(parts):
            echo(f"\n######## mix_datasets: dataset {i + 1} of {len(parts)} ########")
            check_one(_plain(part, f"{cfg.filename}: train_dataloader.dataset.datasets[{i}]"), findings,
                      max_errors, echo, color, batch_size, decode_images)
    else:
        check_one(_plain(node, f"{cfg.filename}: train_dataloader.dataset"), findings, max_errors, echo, color,
                  batch_size, decode_images)
    return finish(findings, echo)


def _plain(node: Any, key: str) -> dict:
    if not isinstance(node, dict) or "type" not in node or not is_process_hf_dataset(node):
        kind = type_name(node.get("type")) if isinstance(node, dict) else type(node).__name__
        raise DatasetError(f"{key} is {kind}; check-custom-dataset checks process_hf_dataset (alone or inside "
                           "mix_datasets), process_data_sources, StreamingDataSources, build_preference_dataset, "
                           "build_kto_dataset and build_prompt_dataset datasets, not this one yet")
    return dict(node.items())


def check_one(node: dict, findings: Findings, max_errors: int, echo: Echo, color: bool,
              batch_size: int | None, decode_images: bool = False) -> None:
    """All checks and printouts for one process_hf_dataset node (``decode_images``: each image decoded whole
    too, which finds a file whose header reads but whose pixels do not)."""
    args = pipeline_args(node)
    errors_before = findings.count()
    raw_cfg, source = args["dataset"], args["source"] or source_name(args["dataset"])
    if args["lazy_encode"]:
        echo("lazy_encode=True: checked here with the eager pipeline (the same stages, every row at once); "
             "training encodes each row as the loader reads it")
    every = load_every_row(raw_cfg, args["split"], findings, echo)
    if every is None:
        return
    map_fn = resolve_map_fn(args["dataset_map_fn"])
    check_settings(args, every, map_fn, source, findings)
    processor = guard(findings, build_processor, args.get("processor"))
    tokenizer = build_if_config(args["tokenizer"], "tokenizer") if processor is None or args["tokenizer"] \
        else processor.tokenizer
    template = template_of(args["template_map_fn"])
    if template is not None:
        for warning in template_warnings(template, tokenizer):
            findings.warn(warning)
    if findings.count() == errors_before:
        echo(f"Validating all {len(every)} rows ...")
        # With skip_bad_rows a bad image is a counted drop of the pipeline (listed below), not an error.
        check_images = processor is not None and not args.get("skip_bad_rows")
        check_rows(every, map_fn, source, findings, max_errors, args.get("image_folder") if check_images else False,
                   decode_images)
    if findings.count() > errors_before:
        return
    raw = load_trained_part(raw_cfg, every, args["split"], findings, echo)
    if raw is None:
        return
    params = inspect.signature(run_pipeline).parameters
    run_args = {k: v for k, v in args.items() if k in params}
    run_args.update(dataset=raw, tokenizer=tokenizer, keep_stages=True, source=source, processor=processor)
    dataset, report = guard(findings, run_pipeline, **run_args) or (None, None)
    if report is not None:
        for line in change_lines(report):
            findings.warn(line)
        check_turn_ends(report, tokenizer, findings)
        print_stages(report, tokenizer, echo, color, image_token_id=processor and image_token_id(processor))
        print_kinds(report, row_kinds(report), tokenizer, echo, color)
        print_stats(report, args, batch_size, echo)


# ---------------------------------------------------------------------------
# data_sources: each source's rows through its map fn and filter, then the mix.

def check_source_row(row: dict, index: int, map_fn, filter_fn, source: str) -> None:
    """One raw row of a source through its map fn (None: dropped, no error) and filter fn (anything but a
    bool is an error), then strictly against the standard schema, as ``check_row``."""
    row = {k: v for k, v in row.items() if k != ROW_COLUMN}
    if map_fn is not None:
        mapped = SafeMapFn(map_fn, source, "map_fn", none_drops=True)(row, index)
        if mapped is None:
            return
        row = {**row, **mapped}  # as the pipeline's map stage keeps the row's other fields
    if filter_fn is not None and not filter_batch({**{k: [v] for k, v in row.items()}, ROW_COLUMN: [index]},
                                                  filter_fn, source)[KEEP_COLUMN][0]:
        return
    check_row(row, index, None, source)


def check_sources_node(node: dict, findings: Findings, max_errors: int, echo: Echo, color: bool,
                       batch_size: int | None) -> None:
    """Every source's rows checked (all of them, before any slice), then the mix built and shown source by
    source, with each source's counts and shares. A ``StreamingDataSources`` node is checked the same way,
    eagerly: the samples and drops are those of its one reader's first pass."""
    args = {n: p.default for n, p in inspect.signature(process_data_sources).parameters.items()
            if p.default is not inspect.Parameter.empty}
    args.update({k: v for k, v in node.items() if k != "type"})
    sources = args["data_sources"]
    streamed = resolve_type(node["type"]) is StreamingDataSources
    refused = stream_problems(sources, args["pack_per_source"]) if streamed and isinstance(sources, list) else []
    for problem in refused + sources_problems(sources, args["mix_strategy"], args["mix_probabilities"],
                                              args["stopping_strategy"]):
        findings.error(f"train_dataloader.dataset: {problem}")
    if findings.count():
        return
    tokenizer = build_if_config(args["tokenizer"], "tokenizer")
    template = template_of(args["template_map_fn"])
    for warning in template_warnings(template, tokenizer) if template is not None else ():
        findings.warn(warning)
    for index, source in enumerate(sources):
        echo(f"\n######## {source_label(index, source)}: source {index + 1} of {len(sources)} ########")
        loaded = guard(findings, load_source, index, {**source, "slice": None})
        if loaded is None:
            continue
        rows, name, _ = loaded
        echo(f"Validating all {len(rows)} rows ...")
        map_fn = resolve_map_fn(source.get("map_fn"))
        collect_row_errors(rows, lambda row, i: check_source_row(row, i, map_fn, source.get("filter_fn"), name),
                           findings, max_errors)
    if findings.count():
        return
    run_args = {k: v for k, v in args.items() if k in inspect.signature(run_sources).parameters}
    dataset, report = guard(findings, run_sources, **dict(run_args, tokenizer=tokenizer, keep_stages=True)) \
        or (None, None)
    if report is None:
        return
    for stats in report.sources:
        echo(f"\n######## {stats.label} ########")
        check_turn_ends(stats.report, tokenizer, findings)
        print_stages(stats.report, tokenizer, echo, color, "map_fn and filter_fn")
    for line in change_lines(report):
        findings.warn(line)
    print_stats(report, args, batch_size, echo)
    echo(f"\n== sources ({args['mix_strategy']}) ==")
    for line in source_lines(report, args["mix_strategy"]):
        echo(line)
