"""Collate rows of preference pairs (see ``sfttool.dataset.preference``) into a batch.

The batch is ``default_collate_fn``'s (right padding as its own
pseudo-sequence, no attention mask) plus ``sequence_ids`` [batch, seq]: the
batch-wide index of the sequence each token belongs to, ``2k`` for the chosen
and ``2k + 1`` for the rejected side of the batch's k-th pair, -1 for padding.
Rows that carry precomputed reference log-probs (the column ``ref_logps``, one
per sequence) add ``ref_logps`` [2 * pairs], in the order of ``sequence_ids``.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from sfttool.dataset.collate_fns.default_collate_fn import default_collate_fn
from sfttool.utils.constants import DEFAULT_PAD_TOKEN_INDEX

REF_COLUMN = "ref_logps"


def pair_sequence_ids(sample_lengths: Sequence[Sequence[int]], length: int) -> torch.Tensor:
    """Sequence index per token, numbered across the batch; -1 pads each row to ``length``.

    >>> pair_sequence_ids([[2, 1], [1, 1, 2, 1]], 5).tolist()
    [[0, 0, 1, -1, -1], [2, 3, 4, 4, 5]]
    """
    rows, first = [], 0
    for sizes in sample_lengths:
        if len(sizes) % 2:
            raise ValueError(f"a preference row has {len(sizes)} sequences; expected chosen/rejected pairs")
        ids = torch.repeat_interleave(torch.arange(first, first + len(sizes)), torch.tensor(list(sizes)))
        rows.append(torch.cat([ids, ids.new_full((length - len(ids),), -1)]))
        first += len(sizes)
    return torch.stack(rows)  # [batch, seq]


def preference_collate_fn(instances: Sequence[dict[str, Any]], pad_index: int = DEFAULT_PAD_TOKEN_INDEX,
                          return_hf_format: bool = False, use_varlen_attn: bool = False,
                          max_length: int | None = None) -> dict[str, Any]:
    """Rows of pairs -> ``{'data': {input_ids, labels, position_ids, sequence_ids}, 'data_samples': None}``.

    >>> preference_collate_fn([{'input_ids': [5, 6, 7], 'labels': [-100, 6, 7], 'sample_lengths': [2, 1]}]
    ...                       )['data']['sequence_ids'].tolist()
    [[0, 0, 1]]

    ``max_length`` is accepted for XTuner configs; rows are already at most
    ``max_packed_length`` long.
    """
    data = default_collate_fn(instances, pad_index, return_hf_format=True, use_varlen_attn=use_varlen_attn)
    sizes = [inst.get("sample_lengths") or [len(inst["input_ids"])] for inst in instances]
    data["sequence_ids"] = pair_sequence_ids(sizes, data["input_ids"].shape[1])
    if all(inst.get(REF_COLUMN) is not None for inst in instances):
        values = [value for inst in instances for value in inst[REF_COLUMN]]
        if len(values) != sum(len(s) for s in sizes):
            raise ValueError(f"rows hold {sum(len(s) for s in sizes)} sequences but {len(values)} {REF_COLUMN}")
        data[REF_COLUMN] = torch.tensor(values, dtype=torch.float32)  # [2 * pairs]
    if return_hf_format:
        return data
    return {"data": data, "data_samples": None}
