"""The pipeline's stages as pure batch functions, shared by the map-style
pipeline (each called by one labelled ``datasets.map``, or on the Arrow
columns it produced) and by the stream (called on each chunk of rows it reads).

    map fn -> template -> (drop empty) -> encode (``encode.encode_batch``) -> drop untrained -> pack (``pack``)

    >>> from sfttool.dataset.map_fns import alpaca_map_fn
    >>> map_batch({'instruction': ['Add.'], 'input': ['1 2'], 'output': ['3']}, [0], alpaca_map_fn)['conversation']
    [[{'system': '', 'tools': '', 'input': 'Add.\\n1 2', 'messages': '', 'output': '3', 'output_with_loss': True}]]

Each stage reports by cause what it dropped or changed, naming the rows
(``PipelineReport.drop`` / ``change``).
"""
from __future__ import annotations

import contextlib
import gc
import inspect
from collections.abc import Mapping
from typing import Any, Callable, Sequence

import numpy as np

from sfttool.dataset.conversation import is_empty, with_every_key
from sfttool.dataset.chat_encode import renderer_name
from sfttool.dataset.encode import UNTRAINED_EMPTY, UNTRAINED_MASKED, encode_batch_arrays
from sfttool.dataset.errors import ROW_COLUMN, DatasetError, where
from sfttool.dataset.report import (DROP_EMPTY_ANSWER, DROP_MASKED, PipelineReport, drop_emptied,
                                    drop_prompt_too_long, drop_unrendered)
from sfttool.dataset.unrendered import REFUSED
from sfttool.utils.constants import IGNORE_INDEX

NOTES_COLUMN = "_sfttool_notes"  # what a map fn changed in the row, "\n"-joined ("" for nothing)


def row_name(row: int) -> str:
    return f"row {row}"


# ---------------------------------------------------------------------------
# Map fns (the dataset map fn, then the template map fn).

def fn_name(fn: Callable) -> str:
    """A function's name, a ``functools.partial``'s too."""
    return getattr(fn, "__name__", None) or getattr(getattr(fn, "func", None), "__name__", repr(fn))


def _takes_notes(fn: Callable) -> bool:
    try:
        return "notes" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins and some C callables have no signature
        return False


class SafeMapFn:
    """Wrap a map fn (``role``: the config key it came from) so a failing row is reported with its index,
    the fn's name and, when its fields fit another map fn, that one; the fn sees the row without
    sfttool's row-number column. Map fns that take ``notes`` report what they changed in the row."""

    def __init__(self, fn: Callable, source: str | None = None, role: str = "dataset_map_fn", none_drops: bool = False):
        self.fn, self.source, self.role, self.none_drops = fn, source, role, none_drops
        self.name = fn_name(fn)
        self.takes_notes = _takes_notes(fn)

    def __call__(self, row: dict, index: int, notes: list[str] | None = None) -> dict | None:
        if ROW_COLUMN in row:
            index = row[ROW_COLUMN]
            row = {k: v for k, v in row.items() if k != ROW_COLUMN}
        try:
            mapped = self.fn(row, notes=notes) if self.takes_notes and notes is not None else self.fn(row)
        except Exception as exc:  # a user fn may raise anything: report where
            exc, row = self._as_in_file(exc, row, index)
            raise DatasetError(f"{where(index, self.source)}: {self.role} {self.name} failed: "
                               f"{type(exc).__name__}: {exc}{self._hint(row)}") from None
        if mapped is None and self.none_drops:
            return None
        if not isinstance(mapped, Mapping):
            raise DatasetError(f"{where(index, self.source)}: {self.role} {self.name} returned "
                               f"{type(mapped).__name__}, not a dict")
        return mapped

    def _as_in_file(self, exc: Exception, row: Any, index: int) -> tuple[Exception, Any]:
        """A field the fn found null may be missing from the row in its file (Arrow fills it with null):
        then the fn's error for the row as the file has it (``DataSource.raw_row``), which says so."""
        raw_row = getattr(self.source, "raw_row", None)
        field = getattr(exc, "null_field", None)
        if raw_row is None or field is None:
            return exc, row
        in_file = raw_row(index)
        if not isinstance(in_file, Mapping) or field in in_file:
            return exc, row
        try:
            self.fn(in_file)
        except Exception as again:
            return again, in_file
        return exc, row

    def _hint(self, row: Any) -> str:
        from sfttool.dataset.map_fns.suggest import fitting_map_fn
        fitting = fitting_map_fn(row) if self.role != "template_map_fn" else None
        if fitting is None or fitting == self.name:
            return ""
        return f" (the row's fields fit {fitting}: set {_setting(fitting)})"


def _setting(fitting: str) -> str:
    return fitting if fitting.startswith("dataset_map_fn") else f"dataset_map_fn={fitting}"


def check_dicts(rows: Sequence[Any], row_numbers: Sequence[int], source: str | None) -> None:
    for row, number in zip(rows, row_numbers):
        if not isinstance(row, Mapping):
            raise DatasetError(f"{where(number, source)}: expected a dict (one JSON object per row), "
                               f"got {type(row).__name__}")


def missing_conversation(row: Mapping, map_fn: Callable | None) -> str:
    """What to do about a row without ``conversation``: the map fn its fields fit, or what a map fn returns."""
    from sfttool.dataset.map_fns.suggest import fitting_map_fn
    fields = ", ".join(str(k) for k in row if k != ROW_COLUMN) or "none"
    if map_fn is not None:
        return (f"no `conversation` after dataset_map_fn {fn_name(map_fn)} (fields: {fields}); it must return "
                "{'conversation': [{'input': ..., 'output': ...}]}")
    fitting = fitting_map_fn(row)
    fix = f"set {_setting(fitting)}" if fitting else "e.g. alpaca_map_fn, sharegpt_map_fn"
    return (f"no `conversation` (fields: {fields}); data that is not in the standard format needs a "
            f"dataset_map_fn ({fix})")


def map_rows(rows: Sequence[Mapping], row_numbers: Sequence[int], fn: Callable, source: str | None,
             role: str = "dataset_map_fn") -> tuple[list[dict], list[list[str]]]:
    """``fn`` on each row: ``(what it returned, what it changed)`` per row."""
    check_dicts(rows, row_numbers, source)
    safe = SafeMapFn(fn, source, role)
    out, notes = [], []
    for row, number in zip(rows, row_numbers):
        changed: list[str] = []
        out.append(dict(safe(row, number, changed)))
        notes.append(changed)
    return out, notes


def map_batch(batch: dict[str, list], indices: Sequence[int], fn: Callable, source: str | None = None,
              role: str = "dataset_map_fn") -> dict[str, list]:
    """``datasets.map(batched=True, with_indices=True)`` form of ``map_rows``: the returned columns, and
    (for the dataset map fn, not the template's) ``NOTES_COLUMN``."""
    names = list(batch)
    rows = [dict(zip(names, values)) for values in zip(*batch.values())]
    mapped, notes = map_rows(rows, _numbers(batch, indices), fn, source, role)
    columns: dict[str, list] = {}
    for i, row in enumerate(mapped):
        for key, value in row.items():
            columns.setdefault(key, [None] * len(mapped))[i] = value
    if "conversation" in columns:  # one struct type for every batch the map writes
        columns["conversation"] = [with_every_key(c) for c in columns["conversation"]]
    if role != "template_map_fn":  # the dataset's map fn (a source's ``map_fn`` too)
        columns[NOTES_COLUMN] = ["\n".join(n) for n in notes]
    return columns


def map_batch_or_drop(batch: dict[str, list], indices: Sequence[int], fn: Callable, source: str | None = None,
                      role: str = "map_fn") -> dict[str, list]:
    """``map_batch`` for a data source's map fn, which drops a row by returning None (as Twinkle's
    ``Dataset.map`` does): the kept rows only, each its input columns updated with what ``fn`` returned,
    plus ``NOTES_COLUMN``. Run with ``remove_columns`` set to every input column, so that a batch whose
    rows are all dropped writes nothing (``datasets`` skips an empty batch).

    >>> map_batch_or_drop({'q': ['a', ''], 'a': ['b', 'c']}, [0, 1],
    ...                   lambda r: {'conversation': [{'input': r['q'], 'output': r['a']}]} if r['q'] else None)['q']
    ['a']
    """
    names = list(batch)
    rows = [dict(zip(names, values)) for values in zip(*batch.values())]
    numbers = _numbers(batch, indices)
    check_dicts(rows, numbers, source)
    safe = SafeMapFn(fn, source, role, none_drops=True)
    kept: list[dict] = []
    notes: list[str] = []
    for row, number in zip(rows, numbers):
        changed: list[str] = []
        mapped = safe(row, number, changed)
        if mapped is not None:
            kept.append({**row, **mapped})
            notes.append("\n".join(changed))
    columns: dict[str, list] = {}
    for i, row in enumerate(kept):
        for key, value in row.items():
            columns.setdefault(key, [None] * len(kept))[i] = value
    if "conversation" in columns:
        columns["conversation"] = [with_every_key(c) for c in columns["conversation"]]
    columns[NOTES_COLUMN] = notes
    return columns


def _numbers(batch: dict[str, list], indices: Sequence[int]) -> list[int]:
    """The rows' numbers as loaded, when numbered (see ``ROW_COLUMN``), else their indices."""
    return list(batch[ROW_COLUMN]) if ROW_COLUMN in batch else list(indices)


def count_notes(report: PipelineReport, notes: Sequence[Sequence[str]], row_numbers: Sequence[int]) -> None:
    """What the map fn changed, counted per change with the first rows named."""
    changed: dict[str, list[str]] = {}
    for row_notes, number in zip(notes, row_numbers):
        for note in row_notes:
            changed.setdefault(note, []).append(row_name(number))
    for note, rows in changed.items():
        report.change(note, rows)


# ---------------------------------------------------------------------------
# Drops.

def count_drops(report: PipelineReport, reason: str, dropped: Sequence[bool], row_numbers: Sequence[int]) -> None:
    report.drop(reason, [row_name(n) for n, d in zip(row_numbers, dropped) if d])


def note_emptied(report: PipelineReport, conversations: Sequence[Any], notes: Sequence[Sequence[str]],
                 row_numbers: Sequence[int]) -> None:
    """Keep what the dataset map fn changed in the rows it left with an empty conversation: the cause
    ``drop_empty_rows`` gives for them (``report.drop_emptied``)."""
    for conversation, row_notes, number in zip(conversations, notes, row_numbers):
        if row_notes and is_empty(conversation):
            report.emptied[number] = list(row_notes)


def drop_empty_rows(report: PipelineReport, empty: Sequence[bool], row_numbers: Sequence[int]) -> list[bool]:
    """Rows whose conversation is empty are dropped, counted by cause; returns the keep mask."""
    causes: dict[str, list[str]] = {}
    for is_dropped, number in zip(empty, row_numbers):
        if is_dropped:
            causes.setdefault(drop_emptied(report.emptied.pop(number, ())), []).append(row_name(number))
    for cause, rows in causes.items():
        report.drop(cause, rows)
    return [not e for e in empty]


def drop_untrained_rows(report: PipelineReport, num_trained: Sequence[int], first_trained: Sequence[int],
                        row_numbers: Sequence[int], max_length: int) -> list[bool]:
    """Rows without a trained token are dropped, counted by cause; returns the keep mask.

    ``first_trained`` (``encode_batch``) is where the answer starts in the whole sample: a row whose
    answer starts at or after ``max_length`` lost it to truncation (the prompt is too long); when
    negative, why nothing is trained (the answers are masked, empty, or, with skip_bad_rows, refused
    for what the template does not render: ``unrendered.REFUSED``)."""
    untrained = {UNTRAINED_MASKED: DROP_MASKED, UNTRAINED_EMPTY: DROP_EMPTY_ANSWER,
                 **{code: drop_unrendered(feature) for feature, code in REFUSED.items()}}
    causes: dict[str, list[str]] = {}
    for trained, first, number in zip(num_trained, first_trained, row_numbers):
        if trained:
            continue
        if first >= 0:
            cause, name = drop_prompt_too_long(max_length), f"{row_name(number)} (prompt of {first} tokens)"
        else:
            cause, name = untrained[first], row_name(number)
        causes.setdefault(cause, []).append(name)
    for cause, rows in causes.items():
        report.drop(cause, rows)
    return [bool(t) for t in num_trained]


# ---------------------------------------------------------------------------
# Fields the template leaves out of the text: counted, never silent.

STRUCTURED_FIELDS = ("reasoning_content", "tool_calls", "tool messages", "tools")


def ignored_field_notes(conversations: Sequence[Any], row_numbers: Sequence[int], tokenizer,
                        hf_chat_template: bool) -> dict[str, list[str]]:
    """``{note: rows}`` for rows with a field (reasoning, tool calls, tool results, tool schemas) that the
    template does not render: the tokenizer's chat template (probed, ``chat_targets.ignored_fields``), or a
    prompt template (which renders only the plain text of each turn)."""
    from sfttool.dataset.chat_targets import fields_of, ignored_fields
    ignored = set(ignored_fields(tokenizer) if hf_chat_template else STRUCTURED_FIELDS)
    notes: dict[str, list[str]] = {}
    if not ignored:
        return notes
    # ``tokenizer`` is what renders: the tokenizer, or a template's ChatFormat.
    which = renderer_name(tokenizer, hf_chat_template) + ("" if hf_chat_template else " (use hf_chat_template)")
    for conversation, number in zip(conversations, row_numbers):
        try:
            found = fields_of(conversation) & ignored
        except (DatasetError, ValueError, TypeError, AttributeError, KeyError):
            continue  # a malformed row: the encoder names it
        for name in sorted(found):
            notes.setdefault(f"{name} ignored by {which}: not in the trained text", []).append(row_name(number))
    return notes


def count_ignored_fields(report: PipelineReport, conversations: Sequence[Any], row_numbers: Sequence[int],
                         tokenizer, hf_chat_template: bool) -> None:
    for note, rows in ignored_field_notes(conversations, row_numbers, tokenizer, hf_chat_template).items():
        report.change(note, rows)


# ---------------------------------------------------------------------------
# Counts of the encoded samples (here, not in report.py: the disk cache hashes this module's source).

def record_truncation(full: np.ndarray, kept: np.ndarray, report: PipelineReport) -> None:
    """Samples' lengths before and after the cut at max_length, counted in ``report``."""
    report.encoded = len(full)
    report.truncated = int((full > kept).sum())
    report.tokens_cut = int((full - kept).sum())


def count_tokens(table, report: PipelineReport) -> None:
    kept = table["length"].to_numpy()
    report.tokens = int(kept.sum())
    report.trained_tokens = int(table["num_trained"].to_numpy().sum())
    report.sample_lengths = kept.tolist()


def to_table(dataset):
    """The dataset's rows as one Arrow table (honours select/filter indices)."""
    return dataset.with_format("arrow")[:]


# ---------------------------------------------------------------------------
# Rows that are tokenized already.

def pretokenized_table(dataset, max_length: int, report: PipelineReport):
    """``do_dataset_tokenization=False``: rows must already hold input_ids and labels of equal
    length; rows longer than ``max_length`` are cut there and counted, as encoded ones are."""
    import pyarrow as pa
    import pyarrow.compute as pc
    missing = {"input_ids", "labels"} - set(dataset.column_names)
    if missing:
        raise DatasetError(f"do_dataset_tokenization=False needs columns input_ids and labels; "
                           f"missing {', '.join(sorted(missing))}")
    table = to_table(dataset)
    lengths = pc.list_value_length(table["input_ids"]).to_numpy(zero_copy_only=False)
    label_lengths = pc.list_value_length(table["labels"]).to_numpy(zero_copy_only=False)
    if (lengths != label_lengths).any():
        row = int(np.flatnonzero(lengths != label_lengths)[0])
        raise DatasetError(f"row {row}: {lengths[row]} input_ids but {label_lengths[row]} labels; "
                           "pre-tokenized rows need one label per token")
    record_truncation(lengths, np.minimum(lengths, max_length), report)
    if report.truncated:
        for name in ("input_ids", "labels"):
            table = table.set_column(table.column_names.index(name), name, pc.list_slice(table[name], 0, max_length))
    labels = table["labels"].combine_chunks()
    trained = np.bincount(pc.list_parent_indices(labels).to_numpy()[labels.flatten().to_numpy() != IGNORE_INDEX],
                          minlength=len(table))
    table = table.append_column("num_trained", pa.array(trained))
    table = table.append_column("length", pc.list_value_length(table["input_ids"]))
    table = table.append_column("num_tokens", table["length"])
    count_tokens(table, report)
    return table


# ---------------------------------------------------------------------------
# The template and encode stages in one pass.

@contextlib.contextmanager
def gc_paused():
    """Python's cyclic garbage collector off for a block that builds tens of thousands of lists and dicts
    and makes no reference cycles: reference counting frees them all, while each collection their
    allocations would trigger walks every young object, and the oldest generation's walks the whole heap
    (0.2 s per 2,000 generated conversations, a tenth of the tokenizer's time)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def json_turns(features) -> bool:
    """Whether ``conversation`` holds each turn as JSON text (``List(Json)``): ``datasets`` loads turns so
    when their keys differ between rows (a ``system`` on the first turn only)."""
    import datasets
    json_type, list_type = getattr(datasets, "Json", None), getattr(datasets, "List", None)
    if json_type is None or list_type is None:  # datasets before 5 has no Json feature
        return False
    feature = features.get("conversation")
    return isinstance(feature, list_type) and isinstance(feature.feature, json_type) and feature.feature.decode


def python_batch(table, features) -> dict[str, list]:
    """An Arrow batch as ``datasets`` hands a batch to a map in Python (``features`` decode each column), but
    a ``conversation`` of JSON-text turns (``json_turns``) parsed in one call for the batch instead of one
    per turn (``datasets`` decodes each turn's text through its nested features: two thirds of the cost of
    handing the encode stage its batch), with the parser ``datasets`` uses, so the values are the same."""
    import pyarrow as pa
    try:
        from datasets.utils.json import ujson_loads  # what datasets' Json feature decodes with
    except ImportError:  # a datasets without that helper: the standard parser (floats exact to the text)
        from json import loads as ujson_loads
    batch = {}
    for name in table.column_names:
        column = table.column(name)
        if name != "conversation":
            batch[name] = features.decode_column(column.to_pylist(), name)
            continue
        lists = column.combine_chunks()
        texts = lists.flatten()  # the batch's turns, end to end (a null conversation has none)
        texts = (texts.storage if isinstance(texts, pa.ExtensionArray) else texts).to_pylist()
        turns = ujson_loads("[" + ",".join("null" if text is None else text for text in texts) + "]")
        offsets = lists.offsets.to_numpy()
        offsets = (offsets - offsets[0]).tolist()
        null = lists.is_null().to_numpy(zero_copy_only=False).tolist()
        batch[name] = [None if null[i] else turns[offsets[i]:offsets[i + 1]] for i in range(len(lists))]
    return batch


@gc_paused()
def template_and_encode_batch(batch: dict[str, list], indices: Sequence[int], template_map_fn: Callable | None,
                              source: str | None = None, features=None, **encode_args: Any):
    """The template stage (``templated``, with the built-in ``template_map_fn`` when given), then the encode stage
    (``encode.encode_batch_arrays``), each run once on the batch: one ``datasets.map`` where two would write
    every conversation to Arrow and read it back in between. Same samples as the two stages apart.
    ``features``: the batch is an Arrow table of rows with these features (``python_batch``)."""
    if features is not None:
        batch = python_batch(batch, features)
    if template_map_fn is not None:
        batch = {**batch, "conversation": templated(batch["conversation"], _numbers(batch, indices), template_map_fn,
                                                    source)}
    return encode_batch_arrays(batch, indices, source=source, **encode_args)


def templated(conversations: Sequence[Any], row_numbers: Sequence[int], template_map_fn: Callable,
              source: str | None) -> list:
    """The built-in template map fn (the one that folds into the encode stage, ``pipeline.folds_into_encode``)
    on each conversation, with its template read once for the batch (``conversation_renderer``). A
    conversation it fails on is named by its row, as any map fn's failure is (``SafeMapFn``); each row is
    handed over as its conversation alone, not rebuilt whole from the batch's columns and back (``map_batch``)."""
    from sfttool.dataset.map_fns.template_map_fn import conversation_renderer
    from sfttool.dataset.map_fns.template_map_fn import template_map_fn as builtin
    if getattr(template_map_fn, "func", None) is builtin and set(template_map_fn.keywords) == {"template"}:
        render = conversation_renderer(template_map_fn.keywords["template"])
        try:
            return [render(conversation) for conversation in conversations]
        except Exception:  # noqa: BLE001  the row and its error are named below
            pass
    safe = SafeMapFn(template_map_fn, source, role="template_map_fn")
    return [safe({"conversation": conversation}, number)["conversation"]
            for conversation, number in zip(conversations, row_numbers)]
