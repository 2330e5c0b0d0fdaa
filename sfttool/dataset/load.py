"""Load local JSON / JSONL data, with errors that name the file and line.

``datasets.load_dataset('json', ...)`` reports a malformed line or a field
whose type changes between rows as a deep Arrow traceback. Before building a
JSON dataset, the pipeline reads each local file once here and reports the
first problem as ``data.jsonl, line 7: ...``.

    >>> load_json_dataset('data.jsonl')          # doctest: +SKIP
    Dataset({features: ['conversation'], num_rows: 1000})
"""
from __future__ import annotations

import bz2
import glob
import gzip
import json
import lzma
import os
from pathlib import Path
from typing import Any, Iterator

from sfttool.dataset.errors import DatasetError, examples
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


def expand_data_files(data_files: Any) -> list[str]:
    """``data_file_list`` with glob patterns expanded (as ``datasets`` does), sorted per pattern."""
    files = []
    for pattern in data_file_list(data_files):
        if any(c in pattern for c in "*?["):
            files += sorted(glob.glob(pattern, recursive=True))
        else:
            files.append(pattern)
    return files


# Compressed files ``datasets`` reads that the standard library can open too.
_OPENERS = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}


def local_json_files(path: Any, data_files: Any) -> list[str]:
    """The local files a ``load_dataset(path, data_files=...)`` call reads as JSON, to be
    checked before Arrow sees them; [] when it reads anything else (the hub, CSV, a folder)."""
    if path not in ("json", "jsonl"):
        return []
    files = expand_data_files(data_files)
    if not files or not all(Path(f).is_file() for f in files):
        return []  # missing files and folders: datasets reports those itself
    return [f for f in files if Path(f).suffix.lower() not in _UNOPENED]


# Archives and compressions datasets reads but the standard library does not: left to datasets.
_UNOPENED = (".zst", ".zip", ".lz4", ".tar")


def open_binary(path: Path):
    return _OPENERS.get(path.suffix.lower(), open)(path, "rb")


def iter_json_rows(path: str | Path, field: str | None = None,
                   duplicates: dict[int, list[str]] | None = None) -> Iterator[tuple[str, Any]]:
    """``(location, row)`` for each record of a JSON file: an array of objects
    (location ``"row 3"``) or one object per line (``"line 7"``), whatever its
    suffix, as ``datasets`` reads both; ``field``: the rows are ``data[field]``.
    ``duplicates`` is filled with ``id(object) -> keys`` for each object of the
    row just yielded that had a key twice (json keeps the last value)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"data file {path} does not exist")
    decoder = json.JSONDecoder(object_pairs_hook=_KeepLast(duplicates))
    with open_binary(path) as f:
        head = f.read(4096).removeprefix(_BOM).lstrip()
    if field is not None or head.startswith(b"["):
        yield from _iter_json_document(path, field, decoder)
        return
    with open_binary(path) as f:
        for line_no, raw in enumerate(f, 1):
            line = _decode(raw.removeprefix(_BOM) if line_no == 1 else raw, path, f"line {line_no}")
            if not line.strip():
                continue
            try:
                row = decoder.decode(line)
            except json.JSONDecodeError as exc:
                if line_no == 1 and exc.msg == "Expecting property name enclosed in double quotes":
                    yield from _iter_json_document(path, field, decoder)  # one object spread over several lines
                    return
                raise DatasetError(f"{path}, line {line_no}: invalid JSON{_json_problem(exc)}") from None
            if "\\u" in line and "\\ud" in line.lower():  # JSON writes escapes with a lowercase u
                _check_surrogates(row, path, f"line {line_no}")
            yield f"line {line_no}", row
            _forget(duplicates)  # the row may be freed now, and its objects' ids reused


class _KeepLast:
    """``object_pairs_hook`` that builds the dict as json does (the last value of a repeated key wins)
    and records which objects repeated a key, so the row can be named instead of changed silently."""

    def __init__(self, duplicates: dict[int, list[str]] | None):
        self.duplicates = duplicates

    def __call__(self, pairs: list[tuple[str, Any]]) -> dict:
        obj = dict(pairs)
        if len(obj) < len(pairs) and self.duplicates is not None:
            seen: set[str] = set()
            self.duplicates[id(obj)] = sorted({k for k, _ in pairs if k in seen or seen.add(k)})
        return obj


def _forget(duplicates: dict | None) -> None:
    if duplicates:
        duplicates.clear()


def duplicated_keys(row: Any, duplicates: dict[int, list[str]]) -> list[str]:
    """The keys repeated in ``row`` or any object nested in it (``duplicates`` from ``iter_json_rows``)."""
    if not duplicates:
        return []
    found, stack = [], [row]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            found += duplicates.get(id(value), [])
            stack += value.values()
        elif isinstance(value, list):
            stack += value
    return sorted(set(found))


def _json_problem(exc: json.JSONDecodeError, where: str = "line") -> str:
    """What follows "invalid JSON" for ``exc``, read in a ``where`` ("line" or "file"): json's own
    message at its column (``(Expecting ',' delimiter at column 7)``; a message ending in "at",
    "Unterminated string starting at", must not read "at at column"), or the cause said for two
    cases: the text ends inside an unfinished object, array or string (a writer stopped mid-row),
    and a comma before a closing bracket (JSON allows no trailing comma)."""
    text, message = exc.doc, exc.msg.removesuffix(" at")
    unterminated = message.startswith("Unterminated string")  # json points at where the string starts
    cut = unterminated or not text[exc.pos:].strip()
    pos = min(exc.pos, len(text.rstrip())) if cut and not unterminated else exc.pos
    column = pos - (text.rfind("\n", 0, pos) + 1) + 1
    if cut:
        return (f": the {where} ends before its last object, array or string is closed ({message} at column "
                f"{column}); it was cut off (a writer stopped mid-row?): complete it or remove it")
    if text[:pos].rstrip().endswith(",") and text[pos] in "]}":
        return f": a comma before {text[pos]!r} at column {column}; JSON allows no trailing comma: remove it"
    return f" ({message} at column {column})" + (
        "; each line must be one JSON object (or the file one JSON array)" if where == "line" else "")


_BOM = b"\xef\xbb\xbf"  # Windows editors start UTF-8 files with it; datasets reads such files


def _decode(raw: bytes, path: Path, location: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DatasetError(f"{path}, {location}: not UTF-8 text (byte {raw[exc.start]:#04x} at column "
                           f"{exc.start + 1}); save the file as UTF-8") from None


def _check_surrogates(row: Any, path: Path, location: str) -> None:
    """A lone \\ud83d escape (half an emoji, cut by a truncating tool) is valid JSON but not text."""
    try:
        json.dumps(row, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise DatasetError(f"{path}, {location}: a lone surrogate escape (e.g. \\ud83d without its pair) is "
                           "not text; the string was probably cut in the middle of an emoji") from None


def _iter_json_document(path: Path, field: str | None, decoder: json.JSONDecoder) -> Iterator[tuple[str, Any]]:
    with open_binary(path) as f:
        text = _decode(f.read().removeprefix(_BOM), path, "somewhere")
    _forget(decoder.object_pairs_hook.duplicates)  # left by a failed attempt to read lines
    try:
        data = decoder.decode(text)
    except json.JSONDecodeError as exc:
        _forget(decoder.object_pairs_hook.duplicates)
        if exc.msg != "Extra data" or field is not None:
            raise DatasetError(f"{path}, line {exc.lineno}: invalid JSON{_json_problem(exc, 'file')}") from None
        yield from _iter_json_values(text, path, decoder)  # several JSON values one after another, as datasets reads
        return
    if field is not None:
        if not isinstance(data, dict) or field not in data:
            raise DatasetError(f"{path}: no top-level field {field!r} (load_dataset(..., field={field!r}))")
        data = data[field]
    if not isinstance(data, list):
        raise DatasetError(f"{path}: expected a JSON array of rows, got a {type(data).__name__}; "
                           "write [{...}, {...}], one object per line, or pass field=... to load_dataset")
    if "\\ud" in text.lower():
        _check_surrogates(data, path, "somewhere")
    # Line numbers of array items are not kept by json; report item numbers as "row".
    for i, row in enumerate(data):
        yield f"row {i}", row


def _iter_json_values(text: str, path: Path, decoder: json.JSONDecoder) -> Iterator[tuple[str, Any]]:
    """Rows of a file holding JSON values one after another (pretty-printed objects), each named by
    the line it starts on."""
    pos = 0
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos == len(text):
            return
        line = text.count("\n", 0, pos) + 1
        try:
            row, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{path}, line {exc.lineno}: invalid JSON{_json_problem(exc, 'file')}") from None
        yield f"line {line}", row
        _forget(getattr(decoder.object_pairs_hook, "duplicates", None))


def check_json_file(path: str | Path, standard: bool | None = None, field: str | None = None) -> int:
    """Validate every row of a JSON/JSONL file; return the row count.

    Rows must be objects whose fields, nested ones included, keep one type
    across rows where the pipeline needs that (see ``_typed_fields``). Rows
    with a ``conversation`` (or all rows when ``standard``) are validated
    against the standard schema. A file without rows is an error, and so are
    objects with a repeated key (Arrow's JSON reader refuses them; Python's
    would keep the last value silently): one error counting the rows and
    naming the first few.

    A file that passed is not parsed again in this process while its content is the same (a
    training part and its held-out part load the same file): its bytes are hashed instead, which
    is about a hundred times faster than parsing them.
    """
    from sfttool.dataset.stages import gc_paused
    key = (os.path.realpath(path), standard, field, _content_digest(path))
    if key not in _CHECKED:
        with gc_paused():  # every row is parsed into dicts and lists that reference counting frees
            _CHECKED[key] = _check_rows(path, standard, field)
    return _CHECKED[key]


# (path, standard, field, content digest) -> rows, for the files that passed ``check_json_file``.
_CHECKED: dict[tuple, int] = {}


def _content_digest(path: str | Path) -> str | None:
    import xxhash  # a datasets dependency; its own fingerprints' hash
    try:
        with open(path, "rb") as f:
            digest = xxhash.xxh3_128()
            for block in iter(lambda: f.read(1 << 24), b""):
                digest.update(block)
    except OSError:
        return None  # reading it again names the problem
    return digest.hexdigest()


def _check_rows(path: str | Path, standard: bool | None, field: str | None) -> int:
    from sfttool.dataset.conversation import check_conversation
    kinds: dict[str, tuple[str, str]] = {}
    typed = _typed_fields()
    count, duplicates, repeated = 0, {}, []
    for location, row in iter_json_rows(path, field, duplicates):
        count += 1
        # A JSONL row is named by its line (what an editor shows) and by its index among the rows (what
        # later stages and check-custom-dataset name), so the two kinds of message can be matched.
        here = f"{location} (row {count - 1})" if location.startswith("line") else location
        if keys := duplicated_keys(row, duplicates):
            repeated.append(f"{here} ({', '.join(map(repr, keys))})")
        if not isinstance(row, dict):
            raise DatasetError(f"{path}, {here}: expected a JSON object, got {_kind(row)}")
        standard_row = standard or (standard is None and "conversation" in row)
        if standard_row:
            check_conversation(row.get("conversation"), source=f"{path}, {here}")
        for name, kind in _row_kinds(row if typed is None else {k: row[k] for k in typed if k in row}, standard_row):
            first = kinds.setdefault(name, (kind, location))
            if kind != "null" and first[0] != "null" and kind != first[0]:
                raise DatasetError(f"{path}, {here}, field {name!r}: a {kind} here but a {first[0]} "
                                   f"at {first[1]}; every row must use the same type per field")
            if first[0] == "null" and kind != "null":
                kinds[name] = (kind, location)
    if count == 0:
        raise DatasetError(f"{path}: the file holds no rows")
    if repeated:
        raise DatasetError(f"{path}: {len(repeated)} rows have an object with a repeated key, which the JSON "
                           f"reader refuses: {examples(repeated)}; keep one value per key")
    return count


def _typed_fields() -> tuple[str, ...] | None:
    """The top-level fields whose types must agree across rows, or None for all of them.

    datasets 5 loads a field whose type changes between rows as ``Json``, and the
    pipeline carries such columns along untouched; but the stages rewrite
    ``conversation`` through Arrow, which needs one type per turn field. Older
    datasets versions fail on any such field while loading."""
    import datasets
    return ("conversation",) if hasattr(datasets, "Json") else None


# The turn fields ``check_conversation`` requires to be strings (or null): rows cannot disagree on their types.
_TURN_TEXT = frozenset({"input", "output", "system"})


def _row_kinds(fields: dict, standard_row: bool) -> Iterator[tuple[str, str]]:
    """``_field_kinds(fields)``, less the turns' text fields of a row that passed ``check_conversation``
    (a third of the file check's time on plain conversations went to naming and typing them)."""
    conversation = fields.get("conversation")
    if not standard_row or not isinstance(conversation, list):
        yield from _field_kinds(fields)
        return
    yield from _field_kinds({key: value for key, value in fields.items() if key != "conversation"})
    yield "conversation", "list"
    if conversation:
        yield "conversation[]", "object"
    for turn in conversation:
        if _TURN_TEXT.issuperset(turn):  # texts only (most turns): nothing left to type
            continue
        yield from _field_kinds({key: value for key, value in turn.items() if key not in _TURN_TEXT},
                                "conversation[].")


def _field_kinds(value: dict, prefix: str = "") -> Iterator[tuple[str, str]]:
    """``(name, kind)`` of every field, nested ones as ``conversation[].system``."""
    for key, item in value.items():
        name = f"{prefix}{key}"
        kind = _kind(item)
        yield name, kind
        if kind == "object":
            yield from _field_kinds(item, name + ".")
        elif kind == "list":
            for element in item:
                element_kind = _kind(element)
                yield name + "[]", element_kind
                if element_kind == "object":
                    yield from _field_kinds(element, name + "[].")


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "list", dict: "object"}.get(type(value), type(value).__name__)


def load_json_dataset(data_files: Any, split: str = "train", standard: bool | None = None):
    """Validate local JSON/JSONL files, then load them with ``datasets``."""
    from datasets import load_dataset
    for path in local_json_files("json", data_files):
        check_json_file(path, standard)
    return load_dataset("json", data_files=data_files, split=split)


BUILDER.register_module(name="load_json_dataset", module=load_json_dataset, force=True)
