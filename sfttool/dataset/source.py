"""A data source's name, as errors print it, that can also read a row again as its file has it.

Arrow gives every row the keys any row has, as nulls, so a map fn sees a row without ``messages``
as one whose ``messages`` is null. ``DataSource`` is the name (a ``str``) that the pipeline
already hands to every stage, and it knows the local JSON files the rows were read from, in
order, so an error about a null field can be checked against the file:

    >>> source = DataSource('data.jsonl', ['data.jsonl'])     # doctest: +SKIP
    >>> source, source.raw_row(4)  # doctest: +SKIP
    ('data.jsonl', {'other': 1})

Rows are numbered as loaded (``ROW_COLUMN``): across the files in order, blank lines skipped.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from sfttool.dataset.errors import DatasetError
from sfttool.dataset.load import check_json_file, iter_json_rows, open_binary


class DataSource(str):
    """``name`` (what messages print) plus the JSON files its rows come from (``field``: the rows
    are ``data[field]`` of each). The files' row index is built on the first ``raw_row`` call and
    kept by this object only, so a later run, which makes a new one, sees a file as it is then."""

    def __new__(cls, name: str, files: Sequence[str], field: str | None = None) -> DataSource:
        source = super().__new__(cls, name)
        source.files, source.field, source._rows = tuple(files), field, {}
        return source

    def __reduce__(self):  # to worker processes: the name and files, not the index
        return DataSource, (str(self), self.files, self.field)

    def raw_row(self, number: int) -> Any:
        """Row ``number`` of the loaded data as its file holds it, or None when it cannot be found."""
        found = self._find(number)
        return found[0][found[1]] if found else None

    def file_of(self, number: int) -> str | None:
        """The file row ``number`` of the loaded data comes from (relative image paths are read from its
        folder), or None when it cannot be found."""
        if len(self.files) == 1:
            return self.files[0]
        found = self._find(number)
        return str(found[0].path) if found else None

    def _find(self, number: int) -> tuple[_FileRows, int] | None:
        for path in self.files:
            rows = self._rows.get(path) or self._rows.setdefault(path, _FileRows(path, self.field))
            if number < len(rows):
                return rows, number
            number -= len(rows)
        return None


class _FileRows:
    """One file's rows by number: byte offsets of its lines for a file of one object per line (each
    row parsed when asked for), the parsed rows for any other layout (an array, ``field``, objects
    spread over several lines), which is what ``iter_json_rows`` reads."""

    def __init__(self, path: str, field: str | None):
        self.path, self.field = Path(path), field
        self.offsets: list[int] | None = None
        self.rows: list[Any] | None = None
        with open_binary(self.path) as f:
            head = f.read(4096).removeprefix(b"\xef\xbb\xbf").lstrip()
        if field is None and not head.startswith(b"["):
            self.offsets = self._line_offsets()
        if self.offsets is None:
            self.rows = self._parsed()

    def _line_offsets(self) -> list[int] | None:
        """Where each non-blank line starts, or None when the first is no whole object (pretty-printed)."""
        offsets, position, first = [], 0, None
        with open_binary(self.path) as f:
            for line in f:
                if line.strip():
                    offsets.append(position)
                    first = line if first is None else first
                position += len(line)
        try:
            json.loads(first.removeprefix(b"\xef\xbb\xbf")) if first is not None else None
        except ValueError:
            return None
        return offsets

    def _parsed(self) -> list[Any]:
        return [row for _, row in iter_json_rows(self.path, self.field)]

    def __len__(self) -> int:
        return len(self.offsets if self.offsets is not None else self.rows)

    def __getitem__(self, number: int) -> Any:
        if self.rows is not None:
            return self.rows[number]
        with open_binary(self.path) as f:
            f.seek(self.offsets[number])
            return json.loads(f.readline().removeprefix(b"\xef\xbb\xbf"))


def read_failure(exc: BaseException, source: str | None) -> DatasetError:
    """A data reader's failure (Arrow's, ``datasets``' generation error) as one line: the line-by-line
    check's for the first bad line of the source's JSON files (a stream meets a malformed line only
    when it reaches it), else the reader's own words naming the data."""
    for path in getattr(source, "files", ()):
        try:
            check_json_file(path, field=getattr(source, "field", None))
        except DatasetError as found:
            return found
    cause = exc
    while cause.__cause__ is not None or cause.__context__ is not None:
        cause = cause.__cause__ or cause.__context__
    return DatasetError(f"{source or 'the dataset'}: datasets could not read the data: {type(cause).__name__}: "
                        f"{str(cause).strip() or type(exc).__name__}; fix the data or convert it to JSON Lines, "
                        "which sfttool checks line by line")


def reader_errors() -> tuple[type[BaseException], ...]:
    """What ``datasets`` and Arrow raise for data they cannot read."""
    from datasets.exceptions import DatasetGenerationError
    from pyarrow import ArrowException
    return DatasetGenerationError, ArrowException


def read_explained(rows: Iterable, source: str | None) -> Iterator:
    """``rows``, with a reader's failure while iterating them as one line (``read_failure``)."""
    try:
        yield from rows
    except reader_errors() as exc:
        raise read_failure(exc, source) from None
