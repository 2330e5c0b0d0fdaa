"""Field access for map fns: a missing or mistyped field is a MapFnError naming it."""
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
        fields = sorted(row) if isinstance(row, Mapping) else type(row).__name__
        raise MapFnError(f"{fn}: no {field!r} field (or it is null); found fields {fields}. "
                         f"Use the map fn that matches this dataset's format, or rename the column to {field!r}.")
    if not isinstance(value, str):
        raise MapFnError(f"{fn}: field {field!r} must be a string, got {type(value).__name__} {value!r:.60}")
    return value


def list_field(row: Mapping[str, Any], field: str, fn: str) -> list:
    """Return ``row[field]`` as a list of dicts; raise MapFnError otherwise."""
    value = row.get(field) if isinstance(row, Mapping) else None
    if value is None:
        fields = sorted(row) if isinstance(row, Mapping) else type(row).__name__
        raise MapFnError(f"{fn}: no {field!r} field (or it is null); found fields {fields}.")
    if not isinstance(value, (list, tuple)) or not all(isinstance(m, Mapping) for m in value):
        raise MapFnError(f"{fn}: field {field!r} must be a list of message objects, got {value!r:.80}")
    return list(value)
