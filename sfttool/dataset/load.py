"""Load local JSON / JSONL data, with errors that name the file and line.

``datasets.load_dataset('json', ...)`` reports a malformed line or a field
whose type changes between rows as a deep Arrow traceback. Before building a
JSON dataset, the pipeline reads each local file once here and reports the
first problem as ``data.jsonl, line 7: ...``.

    >>> load_json_dataset('data.jsonl')          # doctest: +SKIP
    Dataset({features: ['conversation'], num_rows: 1000})
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from sfttool.dataset.errors import DatasetError
from sfttool.registry import BUILDER


def data_file_list(data_files: Any) -> list[str]:
    """Flatten ``data_files`` (str, list, or {split: str | list}) into paths.

    >>> data_file_list({'train': ['a.jsonl', 'b.jsonl'], 'test': 'c.jsonl'})
    ['a.jsonl', 'b.jsonl', 'c.jsonl']
    """
    if data_files is None:
        return []
    if isinstance(data_files, (str, Path)):
        return [str(data_files)]
    if isinstance(data_files, dict):
        return [f for v in data_files.values() for f in data_file_list(v)]
    return [str(f) for f in data_files]


def iter_json_rows(path: str | Path) -> Iterator[tuple[int, Any]]:
    """``(line, row)`` for each record of a ``.json`` (array) or ``.jsonl`` file."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"data file {path} does not exist")
    if path.suffix == ".json":
        yield from _iter_json_array(path)
        return
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield line_no, json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path}, line {line_no}: invalid JSON ({exc.msg} at column {exc.colno}); "
                                   "each line of a .jsonl file must be one JSON object") from None


def _iter_json_array(path: Path) -> Iterator[tuple[int, Any]]:
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{path}, line {exc.lineno}: invalid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(data, list):
        raise DatasetError(f"{path}: expected a JSON array of rows, got a {type(data).__name__}; "
                           "write [{...}, {...}] or use .jsonl (one object per line)")
    # Line numbers of array items are not kept by json; report item numbers as "row".
    for i, row in enumerate(data):
        yield i, row


def check_json_file(path: str | Path, standard: bool | None = None) -> int:
    """Validate every row of a JSON/JSONL file; return the row count.

    Rows must be objects whose fields keep one type across rows (Arrow needs
    that). Rows with a ``conversation`` (or all rows when ``standard``) are
    validated against the standard schema.
    """
    from sfttool.dataset.encode import check_conversation
    kinds: dict[str, tuple[str, int]] = {}
    unit = "row" if Path(path).suffix == ".json" else "line"
    count = 0
    for line, row in iter_json_rows(path):
        count += 1
        if not isinstance(row, dict):
            raise DatasetError(f"{path}, {unit} {line}: expected a JSON object, got {type(row).__name__}")
        for key, value in row.items():
            kind = _kind(value)
            first = kinds.setdefault(key, (kind, line))
            if kind != "null" and first[0] != "null" and kind != first[0]:
                raise DatasetError(f"{path}, {unit} {line}, field {key!r}: a {kind} here but a {first[0]} "
                                   f"at {unit} {first[1]}; every row must use the same type per field")
            if first[0] == "null" and kind != "null":
                kinds[key] = (kind, line)
        if standard or (standard is None and "conversation" in row):
            check_conversation(row.get("conversation"), source=f"{path}, {unit} {line}")
    return count


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "list", dict: "object"}.get(type(value), type(value).__name__)


def is_local_json(path: Any, data_files: Any) -> bool:
    """Whether a ``load_dataset(path, data_files=...)`` call reads local JSON files."""
    files = data_file_list(data_files)
    return path in ("json", "jsonl") and bool(files) and all(Path(f).exists() for f in files)


def load_json_dataset(data_files: Any, split: str = "train", standard: bool | None = None):
    """Validate local JSON/JSONL files, then load them with ``datasets``."""
    from datasets import load_dataset
    for path in data_file_list(data_files):
        check_json_file(path, standard)
    return load_dataset("json", data_files=data_files, split=split)


BUILDER.register_module(name="load_json_dataset", module=load_json_dataset, force=True)
