"""``RewardModel``: a scalar score per sequence, trained on preference pairs (XTuner 0.2's name and module).

The LLM is a transformers sequence-classification model with one label
(``AutoModelForSequenceClassification.from_pretrained(..., num_labels=1)``):
its decoder and its ``score`` head are what a packed batch runs through here,
and what ``save_pretrained`` exports, so the trained model (or the merged
LoRA adapter) loads back as a ``...ForSequenceClassification`` and scores a
conversation like any HF reward model.

The score of a sequence is the head's output at its last token. XTuner's
convention: data built with ``reward_token_id`` ends every sequence with that
token (``build_preference_dataset(is_reward=True, reward_token_id=...)``), so
the score is read there. The loss per pair is Bradley-Terry,
``-log σ(score_chosen - score_rejected)``, plus XTuner's optional penalty on
the scores' size.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from sfttool.model import preference_loss as P
from sfttool.model.lora import build_lora_config
from sfttool.model.preference import PairwiseModel
from sfttool.parallel import sequence as sequence_parallel
from sfttool.registry import BUILDER, ConfigBuildError

PENALTIES = (None, "log_barrier", "L2")
BARRIER = (-5.0, 5.0, 1e-3)  # XTuner's log-barrier bounds and margin


def last_token_mask(sequence_ids: torch.Tensor) -> torch.Tensor:
    """True at the last token of every sequence (padding, -1, excluded). [batch, seq] -> [batch, seq].

    >>> last_token_mask(torch.tensor([[0, 0, 1, -1], [2, 3, 3, 3]])).int().tolist()
    [[0, 1, 1, 0], [1, 0, 0, 1]]
    """
    following = torch.cat([sequence_ids[:, 1:], sequence_ids.new_full((len(sequence_ids), 1), -1)], 1)
    return (sequence_ids >= 0) & (following != sequence_ids)


def score_penalty(scores: torch.Tensor, penalty_type: str | None) -> torch.Tensor:
    """XTuner's penalty on each score (keeps scores in a sane range); zeros when None."""
    if penalty_type is None:
        return torch.zeros_like(scores)
    if penalty_type == "L2":
        return scores ** 2
    low, high, eps = BARRIER
    clamped = scores.clamp(low + eps, high - eps)
    return -torch.log(high - clamped) - torch.log(clamped - low)


@BUILDER.register_module()
class RewardModel(PairwiseModel):
    """A reward model: ``llm`` is a sequence-classification model with ``num_labels=1``.

    Args (besides :class:`SupervisedFinetune`'s):
        reward_token_id: the token the data appended to every sequence (checked
            when set); None reads the score at each sequence's last token.
        loss_type: ``'ranking'`` (Bradley-Terry), XTuner's default and only one here.
        penalty_type: ``'log_barrier'`` (XTuner's default), ``'L2'`` or None.
        penalty_weight: its weight.
    """

    def __init__(self, llm, reward_token_id=None, loss_type="ranking", penalty_type="log_barrier",
                 penalty_weight=0.01, lora=None, **sft_args):
        if loss_type != "ranking":
            raise ConfigBuildError(f"model.loss_type: only 'ranking' (Bradley-Terry) is supported, got {loss_type!r}")
        if penalty_type not in PENALTIES:
            raise ConfigBuildError(f"model.penalty_type must be one of {PENALTIES}, got {penalty_type!r}")
        super().__init__(llm, lora=_sequence_classification_lora(lora), **sft_args)
        self.reward_token_id, self.penalty_type, self.penalty_weight = reward_token_id, penalty_type, penalty_weight
        if getattr(self.base_model(), "score", None) is None:
            raise ConfigBuildError("model.llm: a reward model needs a sequence-classification model with a `score` "
                                   "head: type=AutoModelForSequenceClassification.from_pretrained, num_labels=1")

    def base_model(self) -> Any:
        """The transformers model under the peft wrapper (LoRA layers are injected into it in place)."""
        return self.llm.get_base_model() if hasattr(self.llm, "get_base_model") else self.llm

    def sequence_scores(self, data: dict) -> torch.Tensor:
        """The score of every sequence of the batch, [2 * pairs], in ``sequence_ids`` order. Under sequence
        parallelism each rank scores the sequences whose last token is in its slice, and the group adds
        the scores (each rank's gradient: its own)."""
        model = self.base_model()
        decoder = getattr(model, model.base_model_prefix)
        last = last_token_mask(data["sequence_ids"])  # [batch, seq]
        if self.reward_token_id is not None and not (data["input_ids"][last] == self.reward_token_id).all():
            raise ConfigBuildError(f"model.reward_token_id={self.reward_token_id} but the sequences do not end with "
                                   "it; build the data with is_reward=True and the same reward_token_id")
        split = self._row_split(self._inputs(data)[1])
        hidden = self._hidden_states(decoder, data, split)  # [batch, seq (/ sp), hidden]
        if split is None:
            return model.score(hidden[last]).squeeze(-1).float()  # row-major order = sequence_ids order
        local_last = split.local(last, False)
        scores = model.score(hidden[local_last]).squeeze(-1).float()
        sequence_of = split.local(data["sequence_ids"], -1)[local_last]
        everyone = scores.new_zeros(2 * P.count_pairs(data)).index_add(0, sequence_of, scores)
        return sequence_parallel.sum_over_sequence_parallel_group(everyone, split.group)

    def pair_values(self, data: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each pair's loss, chosen score and rejected score, three [pairs]."""
        scores = self.sequence_scores(data)
        chosen, rejected = scores[0::2], scores[1::2]
        penalty = (score_penalty(chosen, self.penalty_type) + score_penalty(rejected, self.penalty_type)) / 2
        return -F.logsigmoid(chosen - rejected) + self.penalty_weight * penalty, chosen, rejected

    def shown_values(self, chosen: torch.Tensor, rejected: torch.Tensor) -> dict[str, torch.Tensor]:
        """The values shown per pair beside the loss, [pairs] each: the accuracy and the scores."""
        chosen, rejected = chosen.detach(), rejected.detach()
        return {"accuracy": (chosen > rejected).double(), "scores/chosen": chosen, "scores/rejected": rejected,
                "scores/margins": chosen - rejected}

    def compute_loss(self, data: dict) -> dict:
        losses, chosen, rejected = self.pair_values(data)
        return {"loss": self.normalize(losses.sum(), data), **self.pair_step_metrics(losses, chosen, rejected)}


def _sequence_classification_lora(lora: Any) -> Any:
    """A LoRA config for a reward model: peft's SEQ_CLS task, which trains the ``score`` head in full and
    saves it with the adapter (also when the head is among the adapted layers: peft then wraps it whole)."""
    if lora is None:
        return None
    lora = build_lora_config(dict(lora, task_type="SEQ_CLS") if isinstance(lora, dict) else lora)
    lora.task_type = "SEQ_CLS"
    return lora


def adapter_model_class(adapter) -> tuple[Any, dict]:
    """The transformers auto class (and its extra arguments) an adapter folder was trained on: a reward
    model's (peft task SEQ_CLS) is a one-label sequence classifier, any other a causal LM."""
    import json
    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    config = Path(adapter) / "adapter_config.json"
    task = json.loads(config.read_text()).get("task_type") if config.is_file() else None
    if task == "SEQ_CLS":
        return AutoModelForSequenceClassification, {"num_labels": 1}
    return AutoModelForCausalLM, {}
