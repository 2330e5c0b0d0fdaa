"""Sample boundaries in packed rows: ``position_ids`` restart at 0 where each sample starts, so they
alone say which sample a token belongs to. The loss (``sfttool.model.loss``) and the sequence-parallel
attention mask (``sfttool.parallel.attention``) both read the boundaries from here.
"""
from __future__ import annotations

import torch


def sample_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """A batch-wide id for the sample each token belongs to.

    >>> sample_ids(torch.tensor([[0, 1, 0, 1], [0, 1, 2, 0]]))
    tensor([[0, 0, 1, 1],
            [2, 2, 2, 3]])
    """
    starts = position_ids == 0
    starts[:, 0] = True  # a row always begins a sample, whatever its positions say
    return starts.flatten().cumsum(0).view_as(position_ids) - 1
