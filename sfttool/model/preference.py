"""``DPO`` and ``ORPO``: preference training on the SFT model (XTuner 0.2's names and arguments).

Both are :class:`SupervisedFinetune` with another loss: the LLM, LoRA/QLoRA,
activation checkpointing, checkpoints and the packed-batch forward are SFT's.
A batch holds whole pairs (``preference_collate_fn``): ``sequence_ids``
numbers each token's sequence, ``2k`` chosen and ``2k + 1`` rejected.

The reference model of DPO: with LoRA/QLoRA it is the base model with the
adapter switched off (peft's ``disable_adapter()``), so no second copy is
held; with full fine-tuning it is a frozen copy of the starting weights, or
``ref_llm`` loaded from another path.

The loss of a micro-batch is the sum of its pairs' losses divided by the
step's pair count (the train loop's ``loss_normalizer``, from
``count_loss_units``), so the gradient of a step is the mean over its pairs
whatever the micro-batch split. The rewards are logged beside the loss.
"""
from __future__ import annotations

import copy
import logging
from types import SimpleNamespace
from typing import Any

import torch

from sfttool.model import preference_loss as P
from sfttool.model.build import build_llm
from sfttool.model.sft import SupervisedFinetune
from sfttool.registry import BUILDER, ConfigBuildError

logger = logging.getLogger(__name__)


class PairwiseModel(SupervisedFinetune):
    """What DPO and ORPO share: per-sequence log-probs of a batch of pairs and its pair count."""

    def sequence_logps(self, data: dict, llm: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(summed log-probs, trained-token counts)`` per sequence, [2 * pairs] each, of the policy
        or of another ``llm`` run with the same packed forward."""
        keep, targets, sequence_of = P.trained_positions(data)
        model = self if llm is None else SimpleNamespace(llm=llm, flatten_batch=self.flatten_batch)
        logits = SupervisedFinetune._run_llm(model, data, logits_to_keep=keep)
        if logits.dim() == 3:  # the model ignored logits_to_keep: select here
            logits = logits[keep]
        return P.sequence_logps(logits, targets, sequence_of, 2 * P.count_pairs(data))

    def count_loss_units(self, data: dict) -> int:
        """Pairs in the batch: the loss is a mean over pairs."""
        if "sequence_ids" not in data and isinstance(data.get("data"), dict):
            data = data["data"]
        return P.count_pairs(data)

    def normalize(self, total: torch.Tensor, data: dict) -> torch.Tensor:
        normalizer = data.get("loss_normalizer")
        if normalizer is None:
            normalizer = self.count_loss_units(data)
        return total / max(float(normalizer), 1e-12)


@BUILDER.register_module()
class DPO(PairwiseModel):
    """Direct preference optimisation and its variants.

    Args (besides :class:`SupervisedFinetune`'s):
        ref_llm: full fine-tuning only: the reference model or its config;
            None copies ``llm`` before training.
        beta: the strength of the KL constraint (temperature of the rewards).
        loss_type: one of ``sigmoid`` (DPO), ``robust``, ``hinge``, ``ipo``,
            ``kto_pair``, ``sppo_hard``, ``nca_pair`` (XTuner's) or ``simpo``
            (SimPO: length-averaged log-probs, no reference model).
        label_smoothing: the assumed fraction of flipped labels (``sigmoid``,
            ``robust``, ``simpo``), in [0, 0.5).
        simpo_gamma: SimPO's target reward margin.
    """

    build_args_lazily = ("llm", "ref_llm")

    def __init__(self, llm, ref_llm=None, beta=0.1, loss_type="sigmoid", label_smoothing=0.0, simpo_gamma=0.5,
                 use_varlen_attn=False, lora=None, peft_model=None, use_activation_checkpointing=True,
                 max_position_embeddings=None, tokenizer=None, data_preprocessor=None):
        _check_args(loss_type, beta, label_smoothing)
        super().__init__(llm, lora=lora, peft_model=peft_model,
                         use_activation_checkpointing=use_activation_checkpointing,
                         use_varlen_attn=use_varlen_attn, tokenizer=tokenizer,
                         max_position_embeddings=max_position_embeddings, data_preprocessor=data_preprocessor)
        self.beta, self.loss_type = beta, loss_type
        self.label_smoothing, self.simpo_gamma = label_smoothing, simpo_gamma
        self.ref_llm = None
        if loss_type in P.REFERENCE_FREE:
            return
        if self.use_lora:
            if ref_llm is not None:
                raise ConfigBuildError("model.ref_llm: with LoRA the reference is the base model with the "
                                       "adapter disabled; remove ref_llm (or set lora=None)")
            if peft_model is not None:
                logger.warning("model.peft_model with LoRA: the reference is the base model without any adapter; "
                               "to compare against the SFT model, merge its adapter into the base first")
        else:
            self.ref_llm = self._build_reference(ref_llm, use_varlen_attn, max_position_embeddings)

    def _build_reference(self, ref_llm: Any, use_varlen_attn: bool, max_position_embeddings: Any):
        if ref_llm is None:
            ref = copy.deepcopy(self.llm)  # the starting weights, before any step
        else:
            ref = build_llm(ref_llm, use_varlen_attn, max_position_embeddings)
        ref.config.use_cache = False
        ref.requires_grad_(False)
        return ref.eval()

    def train(self, mode: bool = True):
        super().train(mode)
        if self.ref_llm is not None:
            self.ref_llm.eval()  # the reference never drops out
        return self

    @torch.no_grad()
    def reference_logps(self, data: dict) -> tuple[torch.Tensor, torch.Tensor]:
        if self.ref_llm is not None:
            return self.sequence_logps(data, self.ref_llm)
        with self.llm.disable_adapter():
            return self.sequence_logps(data)

    def pair_logps(self, data: dict) -> dict[str, torch.Tensor | None]:
        """Chosen and rejected log-probs [pairs] of the policy and the reference (None: reference-free)."""
        sums, counts = self.sequence_logps(data)
        ref = None if self.loss_type in P.REFERENCE_FREE else self.reference_logps(data)[0]
        if self.loss_type in P.AVERAGED:
            sums = sums / counts
            ref = None if ref is None else ref / counts
        return dict(policy_chosen=sums[0::2], policy_rejected=sums[1::2],
                    ref_chosen=None if ref is None else ref[0::2], ref_rejected=None if ref is None else ref[1::2])

    def compute_loss(self, data: dict) -> dict:
        logps = self.pair_logps(data)
        losses = P.dpo_losses(**logps, loss_type=self.loss_type, beta=self.beta,
                              label_smoothing=self.label_smoothing, simpo_gamma=self.simpo_gamma)  # [pairs]
        chosen, rejected = logps["policy_chosen"], logps["policy_rejected"]
        if logps["ref_chosen"] is not None:
            chosen, rejected = chosen - logps["ref_chosen"], rejected - logps["ref_rejected"]
        return {"loss": self.normalize(losses.sum(), data), **P.reward_logs(self.beta * chosen, self.beta * rejected)}

    def state_dict(self, *args, destination=None, prefix="", keep_vars=False):
        """SFT's state dict without the frozen reference (rebuilt from its source at start)."""
        state = super().state_dict(prefix=prefix, keep_vars=keep_vars)
        for key in [k for k in state if k.startswith(prefix + "ref_llm.")]:
            del state[key]
        if destination is not None:
            destination.update(state)
            return destination
        return state


@BUILDER.register_module()
class ORPO(PairwiseModel):
    """Odds-ratio preference optimisation: NLL of the chosen answer minus ``beta`` times the log-sigmoid of
    the log odds ratio, both from length-averaged log-probs; no reference model.

    The NLL term is each chosen answer's mean token loss, averaged over pairs.
    """

    def __init__(self, llm, beta=0.1, use_varlen_attn=False, lora=None, peft_model=None,
                 use_activation_checkpointing=True, max_position_embeddings=None, tokenizer=None,
                 data_preprocessor=None):
        _check_args("sigmoid", beta, 0.0)
        super().__init__(llm, lora=lora, peft_model=peft_model,
                         use_activation_checkpointing=use_activation_checkpointing,
                         use_varlen_attn=use_varlen_attn, tokenizer=tokenizer,
                         max_position_embeddings=max_position_embeddings, data_preprocessor=data_preprocessor)
        self.beta = beta

    def compute_loss(self, data: dict) -> dict:
        sums, counts = self.sequence_logps(data)
        means = sums / counts  # [2 * pairs]
        chosen, rejected = means[0::2], means[1::2]
        log_odds = P.orpo_log_odds(chosen, rejected)
        losses = -chosen - self.beta * torch.nn.functional.logsigmoid(log_odds)  # [pairs]
        logs = P.reward_logs(self.beta * chosen, self.beta * rejected)
        logs.update({"nll": -chosen.detach().mean(), "log_odds_ratio": log_odds.detach().mean()})
        return {"loss": self.normalize(losses.sum(), data), **logs}


def _check_args(loss_type: str, beta: Any, label_smoothing: Any) -> None:
    if loss_type not in P.DPO_LOSS_TYPES:
        raise ConfigBuildError(f"model.loss_type must be one of {', '.join(P.DPO_LOSS_TYPES)}, got {loss_type!r}")
    if not isinstance(beta, (int, float)) or beta <= 0:
        raise ConfigBuildError(f"model.beta must be a positive number, got {beta!r}")
    if not isinstance(label_smoothing, (int, float)) or not 0 <= label_smoothing < 0.5:
        raise ConfigBuildError(f"model.label_smoothing must be in [0, 0.5), got {label_smoothing!r}")

