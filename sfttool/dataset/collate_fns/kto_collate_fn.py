"""Collate unpaired KTO examples (``sfttool.dataset.kto``) into a batch of pairs: each example beside
its KL sequence.

KTO's KL baseline compares the policy with the reference on mismatched prompt/completion pairs (the
paper's estimate; TRL builds them the same way): here example ``i``'s prompt with the completion of
example ``i + 1`` of the same micro-batch (the last takes the first's). Each row of the batch is
``[example i, KL sequence i]``, laid out as ``preference_collate_fn`` lays out a pair (``sequence_ids``
``2i`` and ``2i + 1``), plus ``kto_labels`` [examples] (True: desirable).

    >>> a = dict(input_ids=[5, 6, 7], labels=[-100, 6, 7], prompt_length=1, kto_label=1)
    >>> b = dict(input_ids=[8, 9, 4], labels=[-100, -100, 4], prompt_length=2, kto_label=0)
    >>> kl_sequence(a, b)   # a's prompt, b's completion
    ([5, 4], [-100, 4])
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from sfttool.dataset.collate_fns.preference_collate_fn import preference_collate_fn
from sfttool.utils.constants import DEFAULT_PAD_TOKEN_INDEX, IGNORE_INDEX


def kl_sequence(example: dict, other: dict, max_length: int | None = None) -> tuple[list[int], list[int]]:
    """``example``'s prompt followed by ``other``'s completion, cut at ``max_length``."""
    own, theirs = example["prompt_length"], other["prompt_length"]
    ids = list(example["input_ids"][:own]) + list(other["input_ids"][theirs:])
    labels = [IGNORE_INDEX] * own + list(other["labels"][theirs:])
    return (ids[:max_length], labels[:max_length]) if max_length else (ids, labels)


def kto_collate_fn(instances: Sequence[dict[str, Any]], pad_index: int = DEFAULT_PAD_TOKEN_INDEX,
                   max_length: int | None = None, use_varlen_attn: bool = False) -> dict[str, Any]:
    """Examples -> ``preference_collate_fn``'s batch of ``[example, KL sequence]`` pairs and ``kto_labels``."""
    if len(instances) < 2:
        raise ValueError("KTO pairs each prompt with another example's completion of the same micro-batch (its KL "
                         "baseline): set train_dataloader.batch_size to 2 or more")
    rows = []
    for i, example in enumerate(instances):
        kl_ids, kl_labels = kl_sequence(example, instances[(i + 1) % len(instances)], max_length)
        ids, labels = list(example["input_ids"]), list(example["labels"])
        rows.append(dict(input_ids=ids + kl_ids, labels=labels + kl_labels,
                         position_ids=list(range(len(ids))) + list(range(len(kl_ids))),
                         sample_lengths=[len(ids), len(kl_ids)]))
    batch = preference_collate_fn(rows, pad_index=pad_index, use_varlen_attn=use_varlen_attn)
    batch["data"]["kto_labels"] = torch.tensor([bool(e["kto_label"]) for e in instances])  # [examples]
    return batch
