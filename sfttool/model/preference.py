"""What the preference models (``DPO`` in ``dpo.py``, ``ORPO`` in ``orpo.py``, ``RewardModel`` in
``reward.py``) share.

Each is :class:`SupervisedFinetune` with another loss: the LLM, LoRA/QLoRA,
activation checkpointing, checkpoints and the packed-batch forward are SFT's.
A batch holds whole pairs (``preference_collate_fn``): ``sequence_ids``
numbers each token's sequence, ``2k`` chosen and ``2k + 1`` rejected.

The loss of a micro-batch is the sum of its pairs' losses divided by the
step's pair count (the train loop's ``loss_normalizer``, from
``count_loss_units``), so the gradient of a step is the mean over its pairs
whatever the micro-batch split. The loss, rewards, margins and accuracies are also returned as
sums over the micro-batch's pairs with the pair count (``sfttool.model.step_metrics``), so what a
run shows for a step is the mean over all of its pairs, as one batch would give.
"""
from __future__ import annotations

from typing import Any

import torch

from sfttool.model import preference_loss as P
from sfttool.model.sft import SupervisedFinetune
from sfttool.registry import ConfigBuildError


class PairwiseModel(SupervisedFinetune):
    """What DPO and ORPO share: per-sequence log-probs of a batch of pairs and its pair count."""

    def sequence_logps(self, data: dict, llm: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(summed log-probs, trained-token counts)`` per sequence, [2 * pairs] each, of the policy
        or of another ``llm`` run with the same packed forward."""
        keep, targets, sequence_of = P.trained_positions(data)
        token_logps = self.trained_token_log_probs(data, keep, targets, llm)  # [n]
        return P.summed_by_sequence(token_logps, sequence_of, 2 * P.count_pairs(data))

    def count_loss_units(self, data: dict) -> int:
        """Pairs in the batch: the loss is a mean over pairs."""
        if "sequence_ids" not in data and isinstance(data.get("data"), dict):
            data = data["data"]
        return P.count_pairs(data)


def check_args(loss_type: str, beta: Any, label_smoothing: Any) -> None:
    if loss_type not in P.DPO_LOSS_TYPES:
        raise ConfigBuildError(f"model.loss_type must be one of {', '.join(P.DPO_LOSS_TYPES)}, got {loss_type!r}")
    if not isinstance(beta, (int, float)) or beta <= 0:
        raise ConfigBuildError(f"model.beta must be a positive number, got {beta!r}")
    if not isinstance(label_smoothing, (int, float)) or not 0 <= label_smoothing < 0.5:
        raise ConfigBuildError(f"model.label_smoothing must be in [0, 0.5), got {label_smoothing!r}")

