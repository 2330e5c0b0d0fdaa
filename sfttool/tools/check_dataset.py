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

import re
from typing import Any, Callable

import numpy as np

from sfttool.dataset.errors import ROW_COLUMN, DatasetError
from sfttool.registry import resolve_type

Echo = Callable[[str], None]
MASK_OPEN, MASK_CLOSE = "[MASKED:", "]"


class Findings:
    """Errors and warnings collected while checking."""

    def __init__(self, echo: Echo):
        self.echo, self.errors, self.warnings = echo, [], []

    def error(self, message: str) -> None:
        self.errors.append(message)
        self.echo(f"ERROR: {message}")

    def warn(self, message: str) -> None:
        self.warnings.append(message)
        self.echo(f"WARNING: {message}")


# ---------------------------------------------------------------------------
# Finding and reading the dataset node.

def dataset_node(cfg) -> dict:
    """``train_dataloader.dataset`` (or ``train_dataset``) as a plain dict."""
    node = None
    if "train_dataloader" in cfg and isinstance(cfg["train_dataloader"], dict):
        node = cfg["train_dataloader"].get("dataset")
    if node is None and "train_dataset" in cfg:
        node = cfg["train_dataset"]
    if not isinstance(node, dict) or "type" not in node:
        raise DatasetError(f"{cfg.filename}: no `train_dataloader.dataset` (or `train_dataset`) with a `type`; "
                           "set train_dataloader = dict(dataset=dict(type=process_hf_dataset, ...), ...)")
    return dict(node.items())  # items() resolves the config's lazy imports; to_dict() would stringify them


def is_process_hf_dataset(node: dict) -> bool:
    from sfttool.dataset.pipeline import process_hf_dataset
    return resolve_type(node["type"], "train_dataloader.dataset.type") is process_hf_dataset


def pipeline_args(node: dict, builder: Callable | None = None) -> dict:
    """The node's arguments with the defaults of ``builder`` (process_hf_dataset) filled in."""
    import inspect

    from sfttool.dataset.pipeline import process_hf_dataset
    from sfttool.dataset.resolve import dataset_config
    args = {name: p.default for name, p in inspect.signature(builder or process_hf_dataset).parameters.items()
            if p.default is not inspect.Parameter.empty}
    args.update({k: v for k, v in node.items() if k != "type"})
    args["dataset"] = dataset_config(args["dataset"])
    return args


# ---------------------------------------------------------------------------
# XTuner's checks, then every row against the standard schema.

def check_settings(args: dict, raw, map_fn, findings: Findings) -> None:
    standard = "conversation" in raw.column_names
    if map_fn is None and not standard:
        findings.error(f"the data is not in the standard format (columns: {', '.join(raw.column_names)}) and "
                       "dataset_map_fn=None: set dataset_map_fn to the map fn of your format (e.g. "
                       "alpaca_map_fn, sharegpt_map_fn) or convert the data to {'conversation': [...]}")
    if map_fn is not None and standard and len(raw.column_names) == 1:
        findings.error("the data is already in the standard `conversation` format but a dataset_map_fn is "
                       "set: set dataset_map_fn=None")
    if args.get("pack_to_max_length") and not args.get("remove_unused_columns"):
        findings.warn("pack_to_max_length=True with remove_unused_columns=False: unused columns are removed "
                      "anyway when packing; set remove_unused_columns=True to say so")


def check_rows(dataset, map_fn, source: str | None, findings: Findings, max_errors: int) -> None:
    """Run the map fn and the schema check on every row; list the first errors."""
    from sfttool.dataset.encode import check_conversation
    from sfttool.dataset.resolve import SafeMapFn
    safe = SafeMapFn(map_fn, source) if map_fn is not None else None
    found = 0
    for index, row in enumerate(dataset):
        try:
            row = safe(row, index) if safe else row
            if not row.get("conversation"):
                raise DatasetError(f"{_at(source, index)}: empty or missing `conversation` (this row "
                                   "would be dropped)")
            check_conversation(row["conversation"], index, source)
            _check_roles(row["conversation"], index, source)
        except DatasetError as exc:
            found += 1
            if found <= max_errors:
                findings.error(str(exc))
    if found > max_errors:
        findings.error(f"... and {found - max_errors} more rows with errors")


def _check_roles(conversation: list[dict], index: int, source: str | None) -> None:
    known = {"system", "input", "output", "output_with_loss", "need_eos_token", "sep"}
    for i, turn in enumerate(conversation):
        unknown = sorted(k for k, v in turn.items() if k not in known and v is not None)
        if unknown:
            raise DatasetError(f"{_at(source, index)}, field 'conversation[{i}]': unknown keys "
                               f"{', '.join(unknown)}; a turn has system (first turn only), input, output "
                               "and optionally output_with_loss")


def _at(source: str | None, index: int) -> str:
    return f"{source}, row {index}" if source else f"row {index}"


# ---------------------------------------------------------------------------
# Template checks.

MARKER = re.compile(r"</?\|?[A-Za-z_][\w\-]*\|?>")


def check_markers(template: Any, tokenizer, findings: Findings) -> None:
    """Warn when a role marker of the template is several tokens for this tokenizer."""
    if template is None or template.get("HF_CHAT_TEMPLATE"):
        return
    texts = [str(template.get(f) or "") for f in ("SYSTEM", "INSTRUCTION", "SUFFIX", "SEP")]
    for marker in sorted({m for t in texts for m in MARKER.findall(t)}):
        ids = tokenizer(marker, add_special_tokens=False)["input_ids"]
        if len(ids) > 1:
            findings.warn(f"template marker {marker!r} is {len(ids)} tokens for this tokenizer "
                          f"({tokenizer.convert_ids_to_tokens(ids)}): it is not a special token of this "
                          "model, so the template probably belongs to another model family")


PROBE = [{"system": "You are a helpful assistant.", "input": "Hello?", "output": "Hi there."},
         {"input": "How are you?", "output": "Fine, thanks."}]


def template_text(template: Any, tokenizer, conversation: list[dict]) -> str:
    """What the built-in template renders, with BOS/EOS written as their token text."""
    from sfttool.dataset.encode import template_pieces
    from sfttool.dataset.map_fns import template_map_fn_factory
    turns = template_map_fn_factory(template)({"conversation": conversation})["conversation"]
    words = {"bos": tokenizer.bos_token or "", "eos": tokenizer.eos_token or ""}
    return "".join(text if kind == "text" else words[kind] for kind, text, _ in template_pieces(turns))


def check_against_chat_template(template: Any, tokenizer, findings: Findings) -> None:
    from sfttool.dataset.encode import to_messages
    if template is None or template.get("HF_CHAT_TEMPLATE") or not getattr(tokenizer, "chat_template", None):
        return
    for probe in (PROBE, [{k: v for k, v in t.items() if k != "system"} for t in PROBE]):
        try:
            theirs = tokenizer.apply_chat_template(to_messages(probe), tokenize=False)
        except Exception:  # some chat templates reject a system role: retry without
            continue
        ours = template_text(template, tokenizer, probe)
        if ours.rstrip() != theirs.rstrip():
            at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
            findings.warn("the configured template renders differently from the tokenizer's chat_template "
                          f"(first difference at character {at}):\n  template:      {ours[max(0, at - 30):at + 40]!r}"
                          f"\n  chat_template: {theirs[max(0, at - 30):at + 40]!r}\n  use "
                          "PROMPT_TEMPLATE.hf_chat_template to train on exactly the model's own format")
        return


# ---------------------------------------------------------------------------
# Display.

def show_masked(input_ids: list[int], labels: list[int], tokenizer, color: bool = False) -> str:
    """Decode a row: trained text plain, masked text as ``[MASKED:...]`` (dimmed with colour).

    >>> show_masked([1, 2, 3], [-100, 2, 3], tok)   # doctest: +SKIP
    '[MASKED:<|im_start|>user\\nhi]hello<|im_end|>'
    """
    import click
    out, start = [], 0
    for end in range(1, len(input_ids) + 1):
        if end == len(input_ids) or (labels[end] == -100) != (labels[start] == -100):
            text = tokenizer.decode(input_ids[start:end])
            if labels[start] == -100:
                text = click.style(text, dim=True) if color else f"{MASK_OPEN}{text}{MASK_CLOSE}"
            out.append(text)
            start = end
    return "".join(out)


def _short(value: Any, limit: int = 600) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


def print_stages(report, tokenizer, echo: Echo, color: bool) -> None:
    names = {"loaded": "raw row", "map_fn": "after dataset_map_fn", "template": "after template_map_fn"}
    for key, title in names.items():
        if key in report.stages and len(report.stages[key]):
            row = {k: v for k, v in report.stages[key][0].items() if k != ROW_COLUMN}
            echo(f"\n== {title} (row 0) ==\n{_short(row)}")
    encoded = report.stages.get("encoded")
    if encoded is not None and len(encoded):
        row = encoded[0]
        echo(f"\n== input_ids (row 0) ==\n{_short(row['input_ids'])}")
        echo(f"\n== labels (row 0) ==\n{_short(row['labels'])}")
        legend = "masked text dimmed" if color else f"masked text in {MASK_OPEN}...{MASK_CLOSE}"
        echo(f"\n== trained vs masked (row 0; {legend}, trained text plain) ==")
        echo(show_masked(row["input_ids"], row["labels"], tokenizer, color))
    final = report.stages.get("packed", report.stages.get("rows"))
    if final is not None and len(final):
        row = final[0]
        echo(f"\n== final row 0: {row['length']} tokens, samples of {row['sample_lengths']} ==")


def print_stats(report, args: dict, batch_size: int | None, echo: Echo) -> None:
    lengths = np.asarray(report.sample_lengths)
    echo("\n== statistics ==")
    echo(f"rows in: {report.rows_in}   rows out: {report.rows_out}")
    for reason, count in report.dropped.items():
        echo(f"dropped: {count} rows ({reason})")
    if len(lengths):
        p = np.percentile(lengths, [50, 90, 99]).round().astype(int)
        echo(f"sample length (tokens): min {lengths.min()}  p50 {p[0]}  p90 {p[1]}  p99 {p[2]}  max {lengths.max()}")
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
                  color: bool = False) -> int:
    """Check a config's training dataset; return the exit code (0 ok, 1 errors).

    A ``mix_datasets`` node is checked dataset by dataset.
    """
    from sfttool.config import find_config, load_config
    from sfttool.dataset.mix import mix_datasets
    echo(f"Config: {find_config(config)}")
    cfg = load_config(config, cfg_options)
    node = dataset_node(cfg)
    findings = Findings(echo)
    batch_size = cfg.get("train_dataloader", {}).get("batch_size")
    from sfttool.tools.check_preference import check_preference, is_preference_node
    if is_preference_node(node):
        check_preference(node, findings, max_errors, echo, color, batch_size)
    elif resolve_type(node["type"], "train_dataloader.dataset.type") is mix_datasets:
        parts = list(node.get("datasets") or [])
        for i, part in enumerate(parts):
            echo(f"\n######## mix_datasets: dataset {i + 1} of {len(parts)} ########")
            check_one(_plain(part, f"{cfg.filename}: train_dataloader.dataset.datasets[{i}]"), findings,
                      max_errors, echo, color, batch_size)
    else:
        check_one(_plain(node, f"{cfg.filename}: train_dataloader.dataset"), findings, max_errors, echo, color,
                  batch_size)
    return _finish(findings, echo)


def _plain(node: Any, where: str) -> dict:
    if not isinstance(node, dict) or "type" not in node or not is_process_hf_dataset(node):
        kind = node.get("type") if isinstance(node, dict) else type(node).__name__
        raise DatasetError(f"{where} is {kind!r}; check-custom-dataset checks process_hf_dataset datasets "
                           "(alone or inside mix_datasets)")
    return dict(node.items())


def check_one(node: dict, findings: Findings, max_errors: int, echo: Echo, color: bool,
              batch_size: int | None) -> None:
    """All checks and printouts for one process_hf_dataset node."""
    import inspect

    from sfttool.dataset.load import check_json_file
    from sfttool.dataset.pipeline import run_pipeline
    from sfttool.dataset.resolve import (json_source_files, resolve_dataset, resolve_map_fn, source_name,
                                         template_of)
    from sfttool.registry import build_if_config
    args = pipeline_args(node)
    errors_before = len(findings.errors)
    raw_cfg = args["dataset"]
    for file in json_source_files(raw_cfg):
        echo(f"Checking every line of {file}")
        _guard(findings, check_json_file, file, False, raw_cfg.get("field"))
    if len(findings.errors) > errors_before:
        return
    echo("Building the dataset ...")
    raw = resolve_dataset(raw_cfg, args["split"], validate=False)  # rows are validated below, all of them
    map_fn = resolve_map_fn(args["dataset_map_fn"])
    check_settings(args, raw, map_fn, findings)
    tokenizer = build_if_config(args["tokenizer"], "tokenizer")
    template = template_of(args["template_map_fn"])
    check_markers(template, tokenizer, findings)
    check_against_chat_template(template, tokenizer, findings)
    if len(findings.errors) == errors_before:
        echo(f"Validating all {len(raw)} rows ...")
        check_rows(raw, map_fn, source_name(raw_cfg), findings, max_errors)
    if len(findings.errors) > errors_before:
        return
    params = inspect.signature(run_pipeline).parameters
    run_args = {k: v for k, v in args.items() if k in params}
    run_args.update(dataset=raw, tokenizer=tokenizer, keep_stages=True)
    dataset, report = _guard(findings, run_pipeline, **run_args) or (None, None)
    if report is not None:
        print_stages(report, tokenizer, echo, color)
        print_stats(report, args, batch_size, echo)


def _guard(findings: Findings, fn: Callable, *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except DatasetError as exc:
        findings.error(str(exc))
        return None


def _finish(findings: Findings, echo: Echo) -> int:
    status = "FAILED" if findings.errors else "OK"
    echo(f"\n{status}: {len(findings.errors)} errors, {len(findings.warnings)} warnings")
    return 1 if findings.errors else 0
