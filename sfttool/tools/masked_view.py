"""Rows shown as text: trained text plain, masked text marked, long values shortened, lengths summarised.
Shared by the SFT, preference, KTO and prompt checks.

    >>> show_masked([1, 2, 3], [-100, 2, 3], tok)   # doctest: +SKIP
    '[MASKED:<|im_start|>user\\nhi]hello<|im_end|>'
"""
from __future__ import annotations

from typing import Any

import numpy as np

from sfttool.utils.constants import IGNORE_INDEX

MASK_OPEN, MASK_CLOSE = "[MASKED:", "]"


def legend(color: bool) -> str:
    return "masked text dimmed" if color else f"masked text in {MASK_OPEN}...{MASK_CLOSE}"


def show_masked(input_ids: list[int], labels: list[int], tokenizer, color: bool = False,
                images: list[str] | None = None, image_token_id: int | None = None) -> str:
    """Decode a row: trained text plain, masked text as ``[MASKED:...]`` (dimmed with colour). With
    ``image_token_id``, each run of image tokens is shown as ``<image 1: cat.png, 4 tokens>`` in its place
    (``images``: the row's, in order)."""
    import click
    out, start, shown = [], 0, [0]
    for end in range(1, len(input_ids) + 1):
        if end == len(input_ids) or (labels[end] == IGNORE_INDEX) != (labels[start] == IGNORE_INDEX):
            text = _decoded(input_ids[start:end], tokenizer, images or [], image_token_id, shown)
            if labels[start] == IGNORE_INDEX:
                text = click.style(text, dim=True) if color else f"{MASK_OPEN}{text}{MASK_CLOSE}"
            out.append(text)
            start = end
    return "".join(out)


def _decoded(ids: list[int], tokenizer, images: list[str], image_token_id: int | None, shown: list[int]) -> str:
    """The text of ``ids``, each run of image tokens as its marker (``shown[0]``: images shown so far)."""
    if image_token_id is None or image_token_id not in ids:
        return tokenizer.decode(ids)
    parts, start = [], 0
    for end in range(1, len(ids) + 1):
        if end == len(ids) or (ids[end] == image_token_id) != (ids[start] == image_token_id):
            if ids[start] == image_token_id:
                parts.append(image_marker(shown[0], images, end - start))
                shown[0] += 1
            else:
                parts.append(tokenizer.decode(ids[start:end]))
            start = end
    return "".join(parts)


def image_marker(index: int, images: list[str], tokens: int) -> str:
    """``<image 1: cat.png, 4 tokens>`` for the ``index``-th image run of a row."""
    import os
    path = images[index] if index < len(images) else "?"
    name = "data: URI" if path.startswith("data:") else os.path.basename(path)
    return f"<image {index + 1}: {name}, {tokens} tokens>"


def shorten(value: Any, limit: int = 600) -> str:
    """``repr(value)``, cut at ``limit`` characters with the full length said."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


def length_line(label: str, lengths) -> str:
    """``label: min ..  p50 ..  p90 ..  p99 ..  max ..`` of a non-empty array of lengths.

    >>> length_line("sample length (tokens)", np.array([3, 5, 9]))
    'sample length (tokens): min 3  p50 5  p90 8  p99 9  max 9'
    """
    p = np.percentile(lengths, [50, 90, 99]).round().astype(int)
    return f"{label}: min {lengths.min()}  p50 {p[0]}  p90 {p[1]}  p99 {p[2]}  max {lengths.max()}"
