"""Which map fn fits a raw row, from the fields it has (for errors that say what to set).

    >>> fitting_map_fn({'messages': [{'role': 'user', 'content': 'hi'}]})
    'openai_map_fn'
    >>> fitting_map_fn({'conversation': [{'input': 'hi', 'output': 'yo'}]})
    'dataset_map_fn=None'
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def _message_keys(value: Any) -> set[str]:
    """The keys of the first message of a list of messages (empty when it is not one)."""
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], Mapping):
        return {k for k, v in value[0].items() if v is not None}
    return set()


def fitting_map_fn(row: Any) -> str | None:
    """The built-in map fn (or ``dataset_map_fn=None``) whose format ``row`` is in, or None."""
    if not isinstance(row, Mapping):
        return None
    if row.get("conversation") is not None:
        return "dataset_map_fn=None"
    for field in ("messages", "conversations"):
        keys = _message_keys(row.get(field))
        if {"from", "value"} <= keys and row.get("image") is not None:
            return "llava_map_fn"
        if {"from", "value"} <= keys:
            return "sharegpt_map_fn"
        if field == "messages" and {"role", "content"} <= keys:
            return "openai_map_fn"
    if row.get("instruction") is not None and row.get("output") is not None:
        return "alpaca_map_fn"
    return None
