"""The one exception type the data pipeline raises for bad data or settings.

The message always says where (file, row, field) and how to fix it; the CLI
prints it as a one-line ``Error: ...`` without a traceback.
"""
from __future__ import annotations

from sfttool.errors import SfttoolError


# Each row's index in the loaded data, carried through the pipeline's stages so an error names the row
# a user finds in the file, also after max_dataset_length picked a subset or process-dataset cut shards.
ROW_COLUMN = "_sfttool_row"


class DatasetError(SfttoolError, ValueError):
    """Bad input data or dataset settings, described for the user."""


def where(row: int | None = None, source: str | None = None, field: str | None = None) -> str:
    """Format a location for an error message.

    >>> where(3, 'data.jsonl', 'conversation[1].output')
    "data.jsonl, row 3, field 'conversation[1].output'"
    """
    parts = [source] if source else []
    if row is not None:
        parts.append(f"row {row}")
    if field:
        parts.append(f"field {field!r}")
    return ", ".join(parts) or "dataset"


def check_positive_int(value, name: str, meaning: str = "") -> None:
    """``max_length must be a positive integer, got 0`` (``meaning`` follows "integer")."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise DatasetError(f"{name} must be a positive integer{meaning}, got {value!r}")


EXAMPLES = 5  # rows named per cause in a warning; the rest are counted


def examples(items: list[str], total: int | None = None) -> str:
    """The first ``EXAMPLES`` items, then how many more (``total``: all of them, when more than listed).

    >>> examples(['row 1', 'row 4'], total=9)
    'row 1, row 4 and 7 more'
    """
    total = len(items) if total is None else total
    shown = items[:EXAMPLES]
    return ", ".join(shown) + (f" and {total - len(shown)} more" if total > len(shown) else "")
