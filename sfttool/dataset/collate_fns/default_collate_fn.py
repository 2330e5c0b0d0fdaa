"""Collate encoded/packed rows into a right-padded batch without an attention mask.

Padding is its own pseudo-sequence: pad ids, labels -100 and position_ids
0..p-1. With ``attention_mask=None`` and ``use_cache=False``, transformers 5
isolates sequences whose position_ids restart at 0, so real samples never
attend to padding (a padding mask would instead make packed samples attend to
each other).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from sfttool.utils.constants import DEFAULT_PAD_TOKEN_INDEX, IGNORE_INDEX


def _positions(instance: dict[str, Any]) -> list[int]:
    if instance.get("position_ids") is not None:
        return list(instance["position_ids"])
    return list(range(len(instance["input_ids"])))  # a raw row: one sample


def _pad_row(instance: dict[str, Any], length: int, pad_index: int) -> tuple[list[int], list[int], list[int]]:
    ids, labels, positions = list(instance["input_ids"]), list(instance["labels"]), _positions(instance)
    pad = length - len(ids)
    return ids + [pad_index] * pad, labels + [IGNORE_INDEX] * pad, positions + list(range(pad))


def cumulative_lengths(instance: dict[str, Any], length: int) -> torch.Tensor:
    """``[0, s1, s1+s2, ..., length]`` for one row padded to ``length`` (varlen attention).

    >>> cumulative_lengths({'input_ids': [1, 2, 3], 'sample_lengths': [2, 1]}, 5).tolist()
    [0, 2, 3, 5]
    """
    sizes = list(instance.get("sample_lengths") or [len(instance["input_ids"])])
    if length > sum(sizes):
        sizes.append(length - sum(sizes))
    return torch.cumsum(torch.tensor([0] + sizes, dtype=torch.int32), 0, dtype=torch.int32)


def image_inputs(instances: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The rows' pixels as the processor returns them for all the batch's images, in row order then token
    order: ``pixel_values`` (Qwen-style: [patches, C*T*P*P]; LLaVA-style: [images, C, H, W]) and, where the
    processor gives it, ``image_grid_thw`` ([images, 3]). Nothing for a batch without images."""
    rows = [inst for inst in instances if inst.get("pixel_values") is not None]
    if not rows:
        return {}
    out = {"pixel_values": torch.cat([torch.as_tensor(inst["pixel_values"]) for inst in rows])}
    if any(inst.get("image_grid_thw") is not None for inst in rows):
        out["image_grid_thw"] = torch.cat([torch.as_tensor(inst["image_grid_thw"]) for inst in rows])
    return out


def default_collate_fn(instances: Sequence[dict[str, Any]], pad_index: int = DEFAULT_PAD_TOKEN_INDEX,
                       return_hf_format: bool = False, use_varlen_attn: bool = False) -> dict[str, Any]:
    """Rows -> ``{'data': {input_ids, labels, position_ids}, 'data_samples': None}``.

    >>> default_collate_fn([{'input_ids': [5, 6], 'labels': [-100, 6]},
    ...                     {'input_ids': [7], 'labels': [7]}])['data']['position_ids'].tolist()
    [[0, 1], [0, 0]]

    Rows with images add ``pixel_values`` (and ``image_grid_thw``), see ``image_inputs``.
    With ``use_varlen_attn`` the dict also holds ``cumulative_len`` (one int32
    tensor per row, padding counted as a sequence) and ``max_seqlen``.
    """
    length = max(len(inst["input_ids"]) for inst in instances)
    rows = [_pad_row(inst, length, pad_index) for inst in instances]
    data: dict[str, Any] = {
        "input_ids": torch.tensor([r[0] for r in rows], dtype=torch.long),     # [batch, seq]
        "labels": torch.tensor([r[1] for r in rows], dtype=torch.long),        # [batch, seq]
        "position_ids": torch.tensor([r[2] for r in rows], dtype=torch.long),  # [batch, seq]
    }
    data.update(image_inputs(instances))
    if use_varlen_attn:
        cumulative = [cumulative_lengths(inst, length) for inst in instances]
        data["cumulative_len"] = cumulative
        data["max_seqlen"] = int(max((c[1:] - c[:-1]).max() for c in cumulative))
    if return_hf_format:
        return data
    return {"data": data, "data_samples": None}
