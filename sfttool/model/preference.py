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
from sfttool.model.step_metrics import step_metrics
from sfttool.parallel import sequence as sequence_parallel
from sfttool.registry import ConfigBuildError
from sfttool.utils.constants import IGNORE_INDEX


class PairwiseModel(SupervisedFinetune):
    """What DPO and ORPO share: per-sequence log-probs of a batch of pairs and its pair count."""

    # Under sequence parallelism each rank runs its slice of the rows; ``sequence_logps`` adds the slices'
    # per-sequence sums before any pair loss (``engine.checks`` reads this).
    trains_with_sequence_parallelism = True

    def sequence_logps(self, data: dict, llm: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(summed log-probs, trained-token counts)`` per sequence, [2 * pairs] each, of the policy
        or of another ``llm`` run with the same packed forward."""
        split = self._row_split(self._inputs(data)[1])
        if split is not None:
            return self._sequence_parallel_logps(data, llm, split)
        keep, targets, sequence_of = P.trained_positions(data)
        token_logps = self.trained_token_log_probs(data, keep, targets, llm)  # [n]
        return P.summed_by_sequence(token_logps, sequence_of, 2 * P.count_pairs(data))

    def _sequence_parallel_logps(self, data: dict, llm: Any, split: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slice of every row: its trained tokens' log-probs summed per sequence, then added
        over the group, so every rank holds the whole sequences' values (its gradient: its slice's).
        Targets come from the whole rows: a slice's last position predicts the next slice's first token."""
        targets = split.local(P.shifted_targets(data), IGNORE_INDEX)  # [batch, seq/sp]
        keep = targets != IGNORE_INDEX
        sequence_of = split.local(data["sequence_ids"], -1)[keep]
        token_logps = self.trained_token_log_probs(data, keep, targets[keep], llm)  # [n local]
        sums, counts = P.summed_by_sequence(token_logps, sequence_of, 2 * P.count_pairs(data))
        return (sequence_parallel.sum_over_sequence_parallel_group(sums, split.group),
                sequence_parallel.sum_over_sequence_parallel_group(counts, split.group))

    def pair_values(self, data: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each pair's loss and the chosen and rejected rewards (or scores), three [pairs]."""
        raise NotImplementedError

    def shown_values(self, chosen: torch.Tensor, rejected: torch.Tensor) -> dict[str, torch.Tensor]:
        """The values shown per pair beside the loss, [pairs] each (DPO's and ORPO's rewards)."""
        return P.reward_values(chosen, rejected)

    def pair_step_metrics(self, losses: torch.Tensor, chosen: torch.Tensor, rejected: torch.Tensor,
                          **extra: torch.Tensor) -> dict:
        """``step_metrics`` of a micro-batch: the loss, the shown values and ``extra`` ones ([pairs] each),
        as sums over its pairs with the pair count."""
        pairs = losses.numel()
        values = {"loss": losses, **self.shown_values(chosen, rejected), **extra}
        return step_metrics(**{name: (value.detach().sum(), pairs) for name, value in values.items()})

    @torch.no_grad()
    def validation_rows(self, data: dict) -> list[list[dict[str, float]]]:
        """Per row of the batch, one dict per pair: its loss and the values shown beside it.
        Validation averages each over every held-out pair (``sfttool.engine.validation.PairValMetric``),
        so its numbers do not depend on the packing, the batch size or the number of processes."""
        losses, chosen, rejected = self.pair_values(data)
        columns = {name: value.double().tolist()
                   for name, value in {"loss": losses, **self.shown_values(chosen, rejected)}.items()}
        return [[{name: column[k] for name, column in columns.items()} for k in pairs]
                for pairs in P.pairs_by_row(data)]

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

