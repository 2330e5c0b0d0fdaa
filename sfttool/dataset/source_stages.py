"""One entry of PART 1's ``data_sources``: its settings checked, its rows loaded and sliced, filtered.

    data_sources = [
        dict(data_path='chat.jsonl'),                                     # every row once
        dict(name='alpaca', data_path='tatsu-lab/alpaca', map_fn=alpaca_map_fn,
             filter_fn=short_answer, slice=range(2000)),                  # its first 2000 rows
    ]

A source is read as ``data_path`` is (a hub name with ``subset`` and ``split``, or local files); its
``slice`` picks rows by index, wrapping around past the end as Twinkle's ``data_slice`` does, so
``range(3 * n)`` uses each of ``n`` rows three times, in order::

    >>> wrapped_indices(range(7), 3).tolist()
    [0, 1, 2, 0, 1, 2, 0]

``map_fn`` may return None to drop a row, ``filter_fn`` (row -> bool, after the map fn) False; both drops
are counted by cause with the first row numbers (``PipelineReport.drop``).
"""
from __future__ import annotations

import difflib
import math
from typing import Any, Callable, Sequence

import numpy as np

from sfttool.dataset.data_path import data_source, load_data_path
from sfttool.dataset.errors import EXAMPLES, ROW_COLUMN, DatasetError, where
from sfttool.dataset.rows import number_rows
from sfttool.dataset.report import PipelineReport
from sfttool.dataset.resolve import resolve_dataset, source_name
from sfttool.dataset.source import DataSource
from sfttool.dataset.stages import SafeMapFn, check_dicts, count_notes, fn_name, note_emptied, row_name

# What a source may set, and what each means.
SOURCE_KEYS = {
    "data_path": "a hub name, or a local .json/.jsonl/.csv/.parquet file, a folder or a glob",
    "name": "what the report and val_source call it (default: data_path)",
    "subset": "the hub dataset's subset (configuration) name",
    "split": "the split to read (default 'train')",
    "map_fn": "raw row -> {'conversation': [...]}, or None to drop the row",
    "filter_fn": "row -> bool, after map_fn; False drops the row",
    "slice": "row indices (a range or list); indices past the end wrap around",
    "ratio": "mix_strategy='concat': how many times each row is used (0.5: a seeded half, 2: twice)",
}
MIX_STRATEGIES = ("concat", "interleave")
STOPPING_STRATEGIES = ("first_exhausted", "all_exhausted")
KEEP_COLUMN = "_sfttool_keep"


# ---------------------------------------------------------------------------
# Settings.

def source_names(data_sources: Sequence[dict]) -> list[str]:
    """Each source's name: its ``name``, else its ``data_path``."""
    return [str(s.get("name") or s.get("data_path")) for s in data_sources]


def source_label(index: int, source: dict) -> str:
    """``data_sources[1] (alpaca)``: how messages and the report name a source."""
    return f"data_sources[{index}] ({source.get('name') or source.get('data_path')})"


def sources_problems(data_sources: Any, mix_strategy: Any = "concat", mix_probabilities: Any = None,
                     stopping_strategy: Any = "first_exhausted") -> list[str]:
    """Every problem of the sources and mix settings, one line each naming the key and the fix."""
    if not isinstance(data_sources, (list, tuple)) or not data_sources:
        return [f"data_sources must be a non-empty list of dict(data_path=...), one per source; got {data_sources!r}"]
    problems = []
    for i, source in enumerate(data_sources):
        problems += _source_problems(i, source)
    names = source_names([s for s in data_sources if isinstance(s, dict)])
    for i, name in enumerate(names):
        if name in names[:i]:
            problems.append(f"data_sources[{i}]: name {name!r} is also data_sources[{names.index(name)}]'s; "
                            "give each source its own name=...")
    return problems + _mix_problems(data_sources, mix_strategy, mix_probabilities, stopping_strategy)


def _source_problems(i: int, source: Any) -> list[str]:
    key = f"data_sources[{i}]"
    if not isinstance(source, dict):
        return [f"{key}: expected dict(data_path=..., ...), got {type(source).__name__}"]
    problems = []
    for unknown in (k for k in source if k not in SOURCE_KEYS):
        close = difflib.get_close_matches(str(unknown), SOURCE_KEYS, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        problems.append(f"{key}: unknown key {unknown!r}; {hint}a source takes {', '.join(SOURCE_KEYS)}")
    if not source.get("data_path"):
        problems.append(f"{key}: no data_path; set data_path to {SOURCE_KEYS['data_path']}")
    else:
        try:
            found = data_source(source["data_path"], key=f"{key}.data_path")  # a missing local file, said now
        except DatasetError as exc:
            problems.append(str(exc).replace(" (PART 1 of the config)", ""))
        else:
            if source.get("subset") and "data_files" in found:
                problems.append(f"{key}.subset: local files have no subsets (a hub dataset's configurations); "
                                "remove subset, or point data_path at the file of the subset you want")
    for name in ("map_fn", "filter_fn"):
        fn = source.get(name)
        if fn is not None and not callable(fn) and not (name == "map_fn" and isinstance(fn, (str, dict))):
            problems.append(f"{key}.{name}: expected a function, got {type(fn).__name__}")
    indices = source.get("slice")
    if indices is not None and not _is_index_list(indices):
        problems.append(f"{key}.slice: expected a range or list of row indices >= 0 (e.g. range(1000)), "
                        f"got {indices!r}")
    elif indices is not None and len(indices) == 0:
        problems.append(f"{key}.slice selects no row; remove the source or give it indices")
    ratio = source.get("ratio")
    if ratio is not None and not _is_number(ratio):
        problems.append(f"{key}.ratio: expected a finite number >= 0 (1.0: every row once), got {ratio!r}")
    return problems


def _is_index_list(indices: Any) -> bool:
    if isinstance(indices, range):
        return len(indices) == 0 or min(indices) >= 0
    return isinstance(indices, (list, tuple)) and all(
        isinstance(i, (int, np.integer)) and not isinstance(i, bool) and i >= 0 for i in indices)


def _is_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and value >= 0)


def _mix_problems(data_sources: Sequence, mix_strategy: Any, probabilities: Any, stopping_strategy: Any) -> list[str]:
    if mix_strategy not in MIX_STRATEGIES:
        return [f"mix_strategy must be one of {', '.join(map(repr, MIX_STRATEGIES))}, got {mix_strategy!r}"]
    if stopping_strategy not in STOPPING_STRATEGIES:
        return [f"stopping_strategy must be one of {', '.join(map(repr, STOPPING_STRATEGIES))}, "
                f"got {stopping_strategy!r}"]
    if mix_strategy == "concat":
        if probabilities is not None:
            return ["mix_probabilities apply to mix_strategy='interleave'; with 'concat' give each source a "
                    "ratio, or set mix_strategy='interleave'"]
        return []
    with_ratio = [f"data_sources[{i}]" for i, s in enumerate(data_sources) if isinstance(s, dict)
                  and s.get("ratio") is not None]
    problems = [f"{', '.join(with_ratio)}: ratio applies to mix_strategy='concat'; with 'interleave' set "
                "mix_probabilities (one per source)"] if with_ratio else []
    if probabilities is None:
        return problems
    if not isinstance(probabilities, (list, tuple)) or not all(_is_number(p) for p in probabilities):
        return problems + [f"mix_probabilities must be a list of numbers >= 0, one per source; got {probabilities!r}"]
    if len(probabilities) != len(data_sources):
        return problems + [f"mix_probabilities has {len(probabilities)} values for {len(data_sources)} sources; "
                           "give one per source, in the order of data_sources"]
    if abs(sum(probabilities) - 1) > 1e-6:
        return problems + [f"mix_probabilities {list(probabilities)} sum to {sum(probabilities):g}; they must "
                           "sum to 1"]
    return problems


def check_sources(data_sources: Any, mix_strategy: Any = "concat", mix_probabilities: Any = None,
                  stopping_strategy: Any = "first_exhausted") -> None:
    """``sources_problems`` as one DatasetError (a line per problem), or nothing."""
    problems = sources_problems(data_sources, mix_strategy, mix_probabilities, stopping_strategy)
    if problems:
        raise DatasetError("\n".join(problems))


def validation_source(data_sources: Sequence[dict], val_source: Any, val_split: str) -> dict:
    """The source validation reads: the one named ``val_source``, its ``val_split``, every row once."""
    names = source_names(data_sources)
    if val_source is None:
        raise DatasetError("validation from data_sources needs val_source: the name (or data_path) of the "
                           "source whose split validates, e.g. val_source = 'alpaca', val_split = 'test'")
    if val_source not in names:
        raise DatasetError(f"val_source {val_source!r} names no source; the sources are {', '.join(names)}")
    source = data_sources[names.index(val_source)]
    return {**{k: v for k, v in source.items() if k not in ("slice", "ratio")}, "split": val_split}


# ---------------------------------------------------------------------------
# Loading and slicing.

def wrapped_indices(indices: Sequence[int], rows: int) -> np.ndarray:
    """Row indices with those past the end wrapped around (``i % rows``), in the order given."""
    return np.asarray(list(indices), dtype=np.int64) % rows


def error_name(index: int, source: dict, config: dict) -> str:
    """What errors call a source read by ``config``: ``data_sources[1] (name) data.jsonl`` for local JSON
    files (a ``DataSource``, which can read a row again from them), else its label."""
    files = source_name(config)
    if not isinstance(files, DataSource):
        return source_label(index, source)
    named = f"data_sources[{index}] ({source['name']})" if source.get("name") else f"data_sources[{index}]"
    return DataSource(f"{named} {files}", files.files, files.field)


def load_source(index: int, source: dict) -> tuple[Any, str, int]:
    """``(rows, name for messages, rows read)``: the source's split, numbered as loaded (``ROW_COLUMN``),
    then sliced. Local JSON files are checked line by line first, as ``data_path``'s are."""
    label = source_label(index, source)
    data_source(source["data_path"], key=f"data_sources[{index}].data_path")  # a missing file, by its key
    config = dict(type=load_data_path, path=source["data_path"])
    if source.get("subset"):
        config["name"] = source["subset"]
    name = error_name(index, source, config)
    try:
        dataset = resolve_dataset(config, source.get("split") or "train")
    except DatasetError as exc:
        raise DatasetError(f"{label}: {exc}") from None
    read = len(dataset)
    dataset = number_rows(dataset)
    if source.get("slice") is not None:
        if read == 0:
            raise DatasetError(f"{label}: slice given but the source has no rows")
        dataset = dataset.select(wrapped_indices(source["slice"], read))
    return dataset, name, read


# ---------------------------------------------------------------------------
# Drops: the map fn's None, the filter's False.

def count_removed(before: np.ndarray, after: np.ndarray, cause: str, report: PipelineReport) -> None:
    """Count the rows (by number) in ``before`` but not ``after`` -- a number as many times as it went
    (a wrapped slice repeats rows) -- under ``cause``, naming the first."""
    numbers, counts = np.unique(before, return_counts=True)
    left = dict(zip(*np.unique(after, return_counts=True)))
    gone = [(int(n), int(c) - int(left.get(n, 0))) for n, c in zip(numbers, counts) if c > left.get(n, 0)]
    if gone:
        report.drop(cause, [row_name(n) for n, _ in gone], count=sum(c for _, c in gone))


def filter_row(fn: Callable, row: dict, number: int, source: str | None) -> bool:
    """``fn(row)``, which must be a bool; anything else, or an exception, is an error naming the row."""
    try:
        kept = fn(row)
    except Exception as exc:  # a user fn may raise anything: say where
        raise DatasetError(f"{where(number, source)}: filter_fn {fn_name(fn)} failed: "
                           f"{type(exc).__name__}: {exc}") from None
    if not isinstance(kept, (bool, np.bool_)):
        raise DatasetError(f"{where(number, source)}: filter_fn {fn_name(fn)} returned {type(kept).__name__} "
                           f"{kept!r}, not a bool; return True to keep the row, False to drop it")
    return bool(kept)


def filter_batch(batch: dict[str, list], fn: Callable, source: str | None) -> dict[str, list]:
    """``{KEEP_COLUMN: [bool, ...]}``: ``filter_row`` on each row (without sfttool's row number)."""
    names = [n for n in batch if n != ROW_COLUMN]
    return {KEEP_COLUMN: [filter_row(fn, dict(zip(names, values)), number, source)
                          for values, number in zip(zip(*(batch[n] for n in names)), batch[ROW_COLUMN])]}


def map_and_filter_rows(rows: Sequence[dict], numbers: Sequence[int], map_fn: Callable | None,
                        filter_fn: Callable | None, source: str | None,
                        report: PipelineReport) -> tuple[list[dict], list[int]]:
    """A streamed chunk of a source's raw rows through its map fn (None drops) and filter fn, counted as the
    map-style stages count them: the kept rows (their other fields kept) and their numbers."""
    check_dicts(rows, numbers, source)
    safe = SafeMapFn(map_fn, source, "map_fn", none_drops=True) if map_fn is not None else None
    kept, kept_numbers, returned_none, filtered = [], [], [], []
    mapped_notes, mapped_numbers, mapped_conversations = [], [], []
    for row, number in zip(rows, numbers):
        if safe is not None:
            changed: list[str] = []
            mapped = safe(row, number, changed)
            if mapped is None:
                returned_none.append(row_name(number))
                continue
            row = {**row, **mapped}
            mapped_notes.append(changed), mapped_numbers.append(number)
            mapped_conversations.append(row.get("conversation"))
        if filter_fn is not None and not filter_row(filter_fn, row, number, source):
            filtered.append(row_name(number))
            continue
        kept.append(row), kept_numbers.append(number)
    if safe is not None:
        count_notes(report, mapped_notes, mapped_numbers)
        note_emptied(report, mapped_conversations, mapped_notes, mapped_numbers)
        report.drop(f"map_fn {fn_name(map_fn)} returned None", returned_none)
    if filter_fn is not None:
        report.drop(f"filter_fn {fn_name(filter_fn)} returned False", filtered)
    return kept, kept_numbers


def apply_filter(dataset, fn: Callable, num_proc: int | None, source: str | None, report: PipelineReport):
    """The rows ``fn`` keeps; the others counted as dropped (``filter_fn NAME returned False``)."""
    marked = dataset.map(filter_batch, batched=True, num_proc=num_proc, fn_kwargs=dict(fn=fn, source=source),
                         desc=f"Filter fn {fn_name(fn)}")
    keep = np.asarray(marked[KEEP_COLUMN], dtype=bool)
    numbers = np.asarray(marked[ROW_COLUMN])
    if not keep.all():
        report.drop(f"filter_fn {fn_name(fn)} returned False",
                    [row_name(int(n)) for n in numbers[~keep][:EXAMPLES]], count=int((~keep).sum()))
    return dataset.select(np.flatnonzero(keep)) if not keep.all() else dataset
