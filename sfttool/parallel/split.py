"""How a batch is split along the sequence: pad each row to a multiple of ``sp``, give rank ``r``
the ``r``-th contiguous slice.

The padding is its own pseudo-sample (pad ids, labels -100, positions 0, 1, ...), as the
collate's padding is: untrained, and isolated from real samples because its positions restart
at 0. Masks, targets and sample boundaries come from the WHOLE row (``RowSplit.position_ids``);
each rank feeds its slice of the positions to the model, so RoPE sees the true positions.

>>> split = RowSplit.of(torch.tensor([[0, 1, 2, 0, 1]]), size=2, rank=1, group=None)
>>> split.position_ids.tolist(), split.local(torch.tensor([[5, 6, 7, 8, 9]]), fill=-1).tolist()
([[0, 1, 2, 0, 1, 0]], [[8, 9, -1]])
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from sfttool.parallel.attention import packed_causal_mask, varlen_arguments


def pad_positions(position_ids: torch.Tensor, multiple: int) -> torch.Tensor:
    """Positions padded as a pseudo-sample of their own: 0, 1, ..., p-1."""
    pad = -position_ids.shape[1] % multiple
    if pad == 0:
        return position_ids
    extra = torch.arange(pad, device=position_ids.device).expand(position_ids.shape[0], pad)
    return torch.cat([position_ids, extra.to(position_ids.dtype)], dim=1)


@dataclass(frozen=True)
class RowSplit:
    """One batch's split: the whole rows' padded ``position_ids`` [batch, padded], and this rank's share.

    Handed to the attention function (the ``sequence_parallel`` keyword of the model's forward), which
    builds the whole rows' mask (or varlen boundaries) from it."""
    position_ids: torch.Tensor
    size: int
    rank: int
    group: Any

    @classmethod
    def of(cls, position_ids: torch.Tensor, size: int, rank: int, group: Any) -> "RowSplit":
        return cls(pad_positions(position_ids, size), size, rank, group)

    @property
    def local_length(self) -> int:
        return self.position_ids.shape[1] // self.size

    def local(self, tensor: torch.Tensor, fill: Any) -> torch.Tensor:
        """This rank's slice of ``tensor`` [batch, seq, ...] (padded with ``fill`` like the rows; a batch
        the model flattened into one row is flattened here too)."""
        rows = self.position_ids.shape[0]
        if tensor.shape[0] != rows:
            tensor = tensor.reshape(rows, -1, *tensor.shape[2:])
        if tensor.shape[1] != self.position_ids.shape[1]:
            pad = self.position_ids.shape[1] - tensor.shape[1]
            tensor = torch.cat([tensor, tensor.new_full((tensor.shape[0], pad, *tensor.shape[2:]), fill)], dim=1)
        start = self.rank * self.local_length
        return tensor[:, start:start + self.local_length]

    def local_positions(self) -> torch.Tensor:
        return self.local(self.position_ids, 0)

    # Every layer's attention reads these: made once per forward, not once per layer.
    @cached_property
    def mask(self) -> torch.Tensor:
        """[batch, 1, seq, seq] bool: the whole rows' causal mask, samples apart (eager and SDPA)."""
        return packed_causal_mask(self.position_ids)

    @cached_property
    def varlen(self) -> tuple[torch.Tensor, int]:
        """``(cu_seqlens, max_seqlen)`` of the flattened row (flash-attention varlen)."""
        return varlen_arguments(self.position_ids)
