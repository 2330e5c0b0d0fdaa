"""Rows shown as text: trained text plain, masked text marked, long values shortened. Shared by
the SFT and the preference checks.

    >>> show_masked([1, 2, 3], [-100, 2, 3], tok)   # doctest: +SKIP
    '[MASKED:<|im_start|>user\\nhi]hello<|im_end|>'
"""
from __future__ import annotations

from typing import Any

from sfttool.utils.constants import IGNORE_INDEX

MASK_OPEN, MASK_CLOSE = "[MASKED:", "]"


def legend(color: bool) -> str:
    return "masked text dimmed" if color else f"masked text in {MASK_OPEN}...{MASK_CLOSE}"


def show_masked(input_ids: list[int], labels: list[int], tokenizer, color: bool = False) -> str:
    """Decode a row: trained text plain, masked text as ``[MASKED:...]`` (dimmed with colour)."""
    import click
    out, start = [], 0
    for end in range(1, len(input_ids) + 1):
        if end == len(input_ids) or (labels[end] == IGNORE_INDEX) != (labels[start] == IGNORE_INDEX):
            text = tokenizer.decode(input_ids[start:end])
            if labels[start] == IGNORE_INDEX:
                text = click.style(text, dim=True) if color else f"{MASK_OPEN}{text}{MASK_CLOSE}"
            out.append(text)
            start = end
    return "".join(out)


def shorten(value: Any, limit: int = 600) -> str:
    """``repr(value)``, cut at ``limit`` characters with the full length said."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"
