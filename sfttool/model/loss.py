"""Next-token cross-entropy for packed rows (see docs/model.md).

A row may hold several samples; ``position_ids`` restart at 0 at each sample
start. Targets are shifted *inside* each sample: the last token of a sample
never predicts the first token of the next one. Padding (see ``default_collate_fn``)
is its own pseudo-sample with labels -100, so it never counts.

Two reductions:
- ``'token'``: every trained token weighs the same (the default; the mean over
  all trained tokens of the global batch once the train loop injects the
  normaliser).
- ``'sample'``: each sample's loss is its token mean; samples weigh the same.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from sfttool.utils.constants import IGNORE_INDEX
from sfttool.utils.positions import sample_ids

REDUCTIONS = ("token", "sample")


def default_position_ids(input_ids: torch.Tensor) -> torch.Tensor:
    """One sample per row: ``[[0, 1, ..., L-1], ...]``."""
    length = input_ids.shape[1]
    return torch.arange(length, device=input_ids.device).expand_as(input_ids)


def shift_targets(labels: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """Next-token targets that never cross a sample boundary.

    >>> shift_targets(torch.tensor([[-100, 5, 6, -100, 8]]), torch.tensor([[0, 1, 2, 0, 1]]))
    tensor([[   5,    6, -100,    8, -100]])

    Position t predicts labels[t+1] unless t+1 starts a new sample (position 0)
    or t is the last position. Shapes: [batch, seq] in and out.
    """
    targets = torch.full_like(labels, IGNORE_INDEX)
    next_is_start = position_ids[:, 1:] == 0
    targets[:, :-1] = labels[:, 1:].masked_fill(next_is_start, IGNORE_INDEX)
    return targets


def count_loss_units(labels: torch.Tensor, position_ids: torch.Tensor | None, reduction: str = "token") -> int:
    """What the local loss is divided by when no global normaliser is given:
    trained tokens ('token') or samples with at least one trained token ('sample')."""
    if position_ids is None:
        position_ids = default_position_ids(labels)
    targets = shift_targets(labels, position_ids)
    trained = targets != IGNORE_INDEX
    if reduction == "token":
        return int(trained.sum())
    return int(sample_ids(position_ids)[trained].unique().numel())


def summed_loss(logits: torch.Tensor, targets: torch.Tensor, sample_of: torch.Tensor | None = None) -> torch.Tensor:
    """Sum of per-token CE (``sample_of`` None) or of per-sample mean CE.

    ``logits`` [n, vocab] and ``targets`` [n] hold only trained positions;
    ``sample_of`` [n] names each position's sample. The float32 upcast happens
    here, on the trained positions only, once.
    """
    token_loss = F.cross_entropy(logits.float(), targets, reduction="none")  # [n]
    if sample_of is None:
        return token_loss.sum()
    _, dense = sample_of.unique(return_inverse=True)  # 0..S-1 for the S samples present
    n_samples = int(dense.max()) + 1 if dense.numel() else 0
    per_sample = token_loss.new_zeros(n_samples).index_add(0, dense, token_loss)
    counts = token_loss.new_zeros(n_samples).index_add(0, dense, torch.ones_like(token_loss))
    return (per_sample / counts).sum()


def token_weights(position_ids: torch.Tensor, keep: torch.Tensor, reduction: str) -> torch.Tensor | None:
    """Each kept position's weight in the summed loss, so that ``sum_i w_i CE_i``
    equals ``summed_loss``: None for 'token' (all 1), 1 / (trained tokens of its
    sample) for 'sample'.

    >>> token_weights(torch.tensor([[0, 1, 2, 0, 1]]), torch.tensor([[True, True, False, True, False]]), "sample")
    tensor([0.5000, 0.5000, 1.0000])
    """
    if reduction == "token":
        return None
    _, dense, counts = sample_ids(position_ids)[keep].unique(return_inverse=True, return_counts=True)
    return 1.0 / counts[dense].float()  # [n]


def trained_sample_tokens(labels: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """[batch, seq] 1.0 on every token of a sample that trains at least one token, 0.0 elsewhere
    (padding, which is its own untrained pseudo-sample).

    >>> trained_sample_tokens(torch.tensor([[-100, 5, -100, -100]]), torch.tensor([[0, 1, 0, 1]]))
    tensor([[1., 1., 0., 0.]])
    """
    samples = sample_ids(position_ids)  # [batch, seq], ids unique over the batch
    trained = samples[labels != IGNORE_INDEX].unique()
    return torch.isin(samples, trained).float()
