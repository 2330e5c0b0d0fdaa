"""Preference losses from per-sequence log-probabilities (see docs/preference.md).

Every function returns the loss of each pair (shape [pairs]); the model sums
them and divides by the step's pair count, so the loss of a step does not
depend on how its pairs are split into micro-batches (``kto_pair`` excepted:
its KL baseline is a micro-batch mean, as in XTuner and TRL).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from sfttool.model.loss import IGNORE_INDEX, default_position_ids, shift_targets
from sfttool.registry import ConfigBuildError

DPO_LOSS_TYPES = ("sigmoid", "robust", "hinge", "ipo", "kto_pair", "sppo_hard", "nca_pair", "simpo")
# Losses of the length-averaged log-probs (the rest use sums).
AVERAGED = ("ipo", "simpo")
# Losses without a reference model.
REFERENCE_FREE = ("simpo",)


def summed_by_sequence(token_logps: torch.Tensor, sequence_of: torch.Tensor,
                       num_sequences: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``token_logps`` [n] (float32) summed per sequence, and the token counts: two [num_sequences]."""
    sums = token_logps.new_zeros(num_sequences).index_add(0, sequence_of, token_logps)
    counts = token_logps.new_zeros(num_sequences).index_add(0, sequence_of, torch.ones_like(token_logps))
    return sums, counts


def require_pairs(data: dict) -> None:
    if "sequence_ids" not in data:
        raise ConfigBuildError("the batch has no `sequence_ids`: preference models need batches of pairs; set "
                               "train_dataloader.collate_fn=dict(type=preference_collate_fn) and the dataset to "
                               "build_preference_dataset")


def trained_positions(data: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(keep, targets, sequence_of)``: the positions that predict a trained token [batch, seq] (bool),
    the targets there [n] and the sequence each belongs to [n]. Targets never cross a sequence start."""
    targets = shifted_targets(data)  # [batch, seq]
    keep = targets != IGNORE_INDEX
    return keep, targets[keep], data["sequence_ids"][keep]


def shifted_targets(data: dict) -> torch.Tensor:
    """Each position's next-token target [batch, seq] (-100 where none is trained); never across a
    sequence start."""
    require_pairs(data)
    labels = data["labels"]
    position_ids = data.get("position_ids")
    if position_ids is None:
        position_ids = default_position_ids(labels)
    return shift_targets(labels, position_ids)


def count_pairs(data: dict) -> int:
    """Pairs in a collated batch (``sequence_ids`` numbers 2 sequences per pair, -1 is padding)."""
    require_pairs(data)
    return (int(data["sequence_ids"].max()) + 1) // 2


def dpo_losses(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor | None,
               ref_rejected: torch.Tensor | None, loss_type: str = "sigmoid", beta: float = 0.1,
               label_smoothing: float = 0.0, simpo_gamma: float = 0.5) -> torch.Tensor:
    """Per-pair DPO-family loss (XTuner 0.2's formulas; ``simpo`` from SimPO, reference-free).

    At the start of training (policy == reference) the ``sigmoid`` loss is ln 2
    for every pair. Shapes: [pairs] in, [pairs] out.
    """
    if loss_type in REFERENCE_FREE:
        logits = policy_chosen - policy_rejected - simpo_gamma / beta
        return (-F.logsigmoid(beta * logits) * (1 - label_smoothing)
                - F.logsigmoid(-beta * logits) * label_smoothing)
    chosen_ratio = policy_chosen - ref_chosen      # log pi/pi_ref of the chosen answer
    rejected_ratio = policy_rejected - ref_rejected
    logits = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * logits) * (1 - label_smoothing) - F.logsigmoid(-beta * logits) * label_smoothing
    if loss_type == "robust":
        return ((-F.logsigmoid(beta * logits) * (1 - label_smoothing) + F.logsigmoid(-beta * logits) * label_smoothing)
                / (1 - 2 * label_smoothing))
    if loss_type == "hinge":
        return torch.relu(1 - beta * logits)
    if loss_type == "ipo":
        return (logits - 1 / (2 * beta)) ** 2
    if loss_type == "kto_pair":
        chosen_kl = chosen_ratio.mean().clamp(min=0)
        rejected_kl = rejected_ratio.mean().clamp(min=0)
        return ((1 - torch.sigmoid(beta * (chosen_ratio - rejected_kl)))
                + (1 - torch.sigmoid(beta * (chosen_kl - rejected_ratio)))) / 2
    if loss_type == "sppo_hard":
        return (chosen_ratio - 0.5 / beta) ** 2 + (rejected_ratio + 0.5 / beta) ** 2
    if loss_type == "nca_pair":
        chosen_rewards, rejected_rewards = beta * chosen_ratio, beta * rejected_ratio
        return (-F.logsigmoid(chosen_rewards) - 0.5 * F.logsigmoid(-chosen_rewards)
                - 0.5 * F.logsigmoid(-rejected_rewards))
    raise ValueError(f"unknown DPO loss_type {loss_type!r}; one of {DPO_LOSS_TYPES}")


def kto_losses(policy: torch.Tensor, reference: torch.Tensor, policy_kl: torch.Tensor, reference_kl: torch.Tensor,
               desirable: torch.Tensor, beta: float, desirable_weight: float = 1.0,
               undesirable_weight: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """KTO's loss per example and its KL baseline (shapes [examples] in; [examples] and a scalar out).

    With ``r = policy - reference`` (summed log-probs of the example's completion) and ``z`` the mean of
    ``policy_kl - reference_kl`` over the mismatched pairs (clamped at 0, no gradient): a desirable
    example costs ``desirable_weight * (1 - σ(β(r - z)))``, an undesirable one
    ``undesirable_weight * (1 - σ(β(z - r)))``. At the start (policy == reference) every loss is
    half its weight.
    """
    rewards = policy - reference
    kl = (policy_kl - reference_kl).mean().clamp(min=0).detach()
    losses = torch.where(desirable, desirable_weight * (1 - torch.sigmoid(beta * (rewards - kl))),
                         undesirable_weight * (1 - torch.sigmoid(beta * (kl - rewards))))
    return losses, kl


def orpo_log_odds(chosen_mean: torch.Tensor, rejected_mean: torch.Tensor) -> torch.Tensor:
    """log odds(chosen) - log odds(rejected), odds(y) = p / (1 - p) with p = exp(mean token log-prob).

    ``log(1 - exp(x))`` is computed as ``log(-expm1(x))``, exact for x near 0.
    """
    return (chosen_mean - rejected_mean) - (torch.log(-torch.expm1(chosen_mean))
                                            - torch.log(-torch.expm1(rejected_mean)))


def reward_values(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor) -> dict[str, torch.Tensor]:
    """The rewards shown beside the loss, per pair ([pairs] each, detached): training shows their
    means over the step's pairs (``sfttool.model.step_metrics``), validation over the held-out pairs."""
    chosen, rejected = chosen_rewards.detach(), rejected_rewards.detach()
    return {"rewards/chosen": chosen, "rewards/rejected": rejected, "rewards/margins": chosen - rejected,
            "rewards/accuracies": (chosen > rejected).double()}


def pairs_by_row(data: dict) -> list[list[int]]:
    """The batch-wide index of each row's pairs, row by row (``sequence_ids`` numbers pair ``k``'s
    sequences ``2k`` and ``2k + 1``; -1 is padding).

    >>> pairs_by_row({"sequence_ids": torch.tensor([[0, 0, 1, 2, 3], [4, 5, -1, -1, -1]])})
    [[0, 1], [2]]
    """
    require_pairs(data)
    return [sorted(set((row[row >= 0] // 2).tolist())) for row in data["sequence_ids"]]
