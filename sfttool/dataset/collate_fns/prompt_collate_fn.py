"""Collate prompt rows (``sfttool.dataset.prompts``) for online RL: no tensors, the rows as they are.

The train loop (``GRPOLoop``) generates from ``prompt_ids`` and hands the other columns to the reward
functions, so a batch is just its rows.
"""
from __future__ import annotations

from typing import Any, Sequence


def prompt_collate_fn(instances: Sequence[dict[str, Any]], **unused: Any) -> dict[str, list[dict]]:
    """Rows -> ``{'prompts': [row, ...]}``.

    >>> prompt_collate_fn([{'prompt_ids': [5, 6], 'prompt': 'Hi', 'solution': '3'}])
    {'prompts': [{'prompt_ids': [5, 6], 'prompt': 'Hi', 'solution': '3'}]}
    """
    return {"prompts": [dict(row) for row in instances]}
