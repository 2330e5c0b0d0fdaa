"""Field access for map fns: a missing, null or mistyped field is a MapFnError naming it."""
from __future__ import annotations

from typing import Any, Mapping

from .errors import MapFnError


def text_field(row: Mapping[str, Any], field: str, fn: str, optional: bool = False) -> str:
    """Return ``row[field]`` as a string; raise MapFnError if it is absent or not a string.

    >>> text_field({'output': 'hi'}, 'output', 'default_map_fn')
    'hi'

    ``optional=True`` turns an absent or null field into ``''`` (alpaca's
    ``input`` is often empty or null).
    """
    value = row.get(field) if isinstance(row, Mapping) else None
    if value is None:
        if optional and isinstance(row, Mapping):
            return ""
        raise _absent(row, field, fn, f"Use the map fn that matches this dataset's format, "
                                      f"or rename the column to {field!r}.")
    if not isinstance(value, str):
        raise MapFnError(f"{fn}: field {field!r} must be a string, got {type(value).__name__} {value!r:.60}")
    return value


def list_field(row: Mapping[str, Any], field: str, fn: str) -> list:
    """Return ``row[field]`` as a list of dicts; raise MapFnError otherwise."""
    value = row.get(field) if isinstance(row, Mapping) else None
    if value is None:
        raise _absent(row, field, fn)
    if not isinstance(value, (list, tuple)) or not all(isinstance(m, Mapping) for m in value):
        raise MapFnError(f"{fn}: field {field!r} must be a list of message objects, got {value!r:.80}")
    return list(value)


def _absent(row: Any, field: str, fn: str, fix: str = "") -> MapFnError:
    """The error for a missing or null field; a null one is not listed as missing."""
    if isinstance(row, Mapping) and field in row:
        # The column exists: null in this row's data, or missing from it (Arrow fills a field other rows
        # have with null); `null_field` lets the pipeline look at the row in its file to tell which.
        error = MapFnError(f"{fn}: field {field!r} is null; fill it in or drop this row from the dataset.")
        error.null_field = field
        return error
    fields = sorted(row) if isinstance(row, Mapping) else type(row).__name__
    return MapFnError(f"{fn}: no {field!r} field; found fields {fields}. {fix}".rstrip())
