"""``DPO``: direct preference optimisation and its variants (XTuner 0.2's name, arguments and module).

The reference model: with LoRA/QLoRA it is the base model with the adapter
switched off (peft's ``disable_adapter()``), so no second copy is held; a LoRA
run that continues an adapter (``peft_model``) compares against a frozen copy of
that adapter (``reference='initial_adapter'``, the default) or the base model
(``reference='base'``); with full fine-tuning it is a frozen copy of the
starting weights, or ``ref_llm`` loaded from another path. Reference-free
losses (``simpo``) hold none.
"""
from __future__ import annotations

import copy
import logging
from typing import Any

import torch
from mmengine.logging import print_log

from sfttool import compat
from sfttool.model import preference_loss as P
from sfttool.model import preference_precompute as pre
from sfttool.model.build import build_llm
from sfttool.model.lora import adapter_active, add_frozen_copy
from sfttool.model.preference import PairwiseModel, check_args
from sfttool.model.preference_precompute import REF_COLUMN
from sfttool.registry import BUILDER, ConfigBuildError

logger = logging.getLogger(__name__)

# What a LoRA run that continues an adapter (``peft_model``) compares against.
REFERENCES = ("initial_adapter", "base")
REFERENCE_ADAPTER = "reference"  # the peft adapter name of the frozen starting adapter


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
        precompute_ref_log_probs: compute the reference log-probs once, in a pass over the
            training set before the first step (``prepare_train_data``), instead of a reference
            forward in every step; the frozen reference copy of a full fine-tune is freed after it.
        reference: with LoRA and ``peft_model`` (a run continuing an adapter): ``'initial_adapter'``
            (default) compares against a frozen copy of that adapter as it starts, so the policy starts
            as the reference; ``'base'`` against the base model without any adapter. Without
            ``peft_model`` both are the starting model.
    """

    build_args_lazily = ("llm", "ref_llm")
    unsaved_modules = ("ref_llm",)  # the frozen reference is rebuilt from its source at start

    def __init__(self, llm, ref_llm=None, beta=0.1, loss_type="sigmoid", label_smoothing=0.0, simpo_gamma=0.5,
                 precompute_ref_log_probs=False, reference="initial_adapter", **sft_args):
        check_args(loss_type, beta, label_smoothing)
        if reference not in REFERENCES:
            raise ConfigBuildError(f"model.reference must be one of {', '.join(map(repr, REFERENCES))}, got "
                                   f"{reference!r}")
        if not isinstance(precompute_ref_log_probs, bool):
            raise ConfigBuildError(f"model.precompute_ref_log_probs must be True or False, got "
                                   f"{precompute_ref_log_probs!r}")
        if ref_llm is not None and sft_args.get("lora") is not None:
            raise ConfigBuildError("model.ref_llm: with LoRA the reference is the base model with the "
                                   "adapter disabled; remove ref_llm (or set lora=None)")
        super().__init__(llm, **sft_args)
        self.beta, self.loss_type = beta, loss_type
        self.label_smoothing, self.simpo_gamma = label_smoothing, simpo_gamma
        self.precompute_ref_log_probs = precompute_ref_log_probs
        self.reference_freed = False  # the pre-pass freed the frozen copy: batches must bring ref_logps
        self.ref_llm, self.reference_adapter = None, None
        if loss_type == "sigmoid" and label_smoothing > 0:
            compat.inform(f"model.label_smoothing={label_smoothing} with loss_type='sigmoid': the loss is cDPO's "
                          "-(1-ε) log σ(βh) - ε log σ(-βh), as in XTuner (TRL 1.16 ignores label_smoothing for "
                          "'sigmoid'; see docs/preference.md)")
        if loss_type in P.REFERENCE_FREE:
            return
        if not self.use_lora:
            self.ref_llm = self._build_reference(ref_llm, sft_args.get("max_position_embeddings"))
        elif sft_args.get("peft_model") is not None:
            self._reference_for_continued_adapter(reference, sft_args["peft_model"])

    def _reference_for_continued_adapter(self, reference: str, peft_model: Any) -> None:
        if reference == "base":
            logger.warning("model.reference='base' with model.peft_model: the reference is the base model without "
                           "any adapter, so the loss at step 0 is not ln 2 and DPO also pulls the model back toward "
                           "the base; reference='initial_adapter' compares against the adapter as it starts")
            return
        add_frozen_copy(self.llm, REFERENCE_ADAPTER)  # adapter-sized: the base weights are shared
        self.reference_adapter = REFERENCE_ADAPTER
        print_log(f"DPO reference: a frozen copy of the starting adapter (model.peft_model={peft_model})",
                  logger="current", level=logging.INFO)

    def _build_reference(self, ref_llm: Any, max_position_embeddings: Any):
        if ref_llm is None:
            ref = copy.deepcopy(self.llm)  # the starting weights, before any step
        else:
            ref = build_llm(ref_llm, self.use_varlen_attn, max_position_embeddings)
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
        if self.reference_adapter is not None:
            with adapter_active(self.llm, self.reference_adapter):
                return self.sequence_logps(data)
        with self.llm.disable_adapter():
            return self.sequence_logps(data)

    def reference_sums(self, data: dict) -> torch.Tensor:
        """The reference's summed log-prob per sequence [2 * pairs]: precomputed in the batch
        (``ref_logps``, see ``prepare_train_data``), else from a reference forward."""
        if REF_COLUMN in data:
            return data[REF_COLUMN].to(device=data["labels"].device, dtype=torch.float32)
        if self.reference_freed:
            raise ConfigBuildError("the batch has no `ref_logps`, and the reference model was freed after "
                                   "precomputing them: give the model batches of the dataset prepare_train_data "
                                   "returned, collated by preference_collate_fn")
        return self.reference_logps(data)[0]

    def prepare_train_data(self, dataset: Any, optim_wrapper: Any = None, val_dataset: Any = None) -> Any:
        """With ``precompute_ref_log_probs``: the training set (and ``val_dataset``, when given: then
        both are returned) with the reference log-probs as a column
        (``sfttool.model.preference_precompute``); the frozen reference is freed after them. The
        train entry calls this once the model and the data are built, before the runner."""
        if not self.precompute_ref_log_probs or self.loss_type in P.REFERENCE_FREE:
            return dataset if val_dataset is None else (dataset, val_dataset)
        device = pre.place_on_run_device(self.ref_llm if self.ref_llm is not None else self.llm)
        autocast = pre.training_autocast_dtype(optim_wrapper)
        was_training = self.training
        self.eval()
        try:
            dataset = pre.add_reference_log_probs(self, dataset, device, autocast)
            if val_dataset is not None:
                val_dataset = pre.add_reference_log_probs(self, val_dataset, device, autocast, validation=True)
        finally:
            self.train(was_training)
        if self.ref_llm is not None:
            self.ref_llm, self.reference_freed = None, True  # its one use is over: no second copy in training
            pre.release_memory()
        if self.reference_adapter is not None:  # likewise the frozen starting adapter
            self.llm.delete_adapter(self.reference_adapter)
            self.reference_adapter, self.reference_freed = None, True
        return dataset if val_dataset is None else (dataset, val_dataset)

    def pair_logps(self, data: dict) -> dict[str, torch.Tensor | None]:
        """Chosen and rejected log-probs [pairs] of the policy and the reference (None: reference-free)."""
        sums, counts = self.sequence_logps(data)
        ref = None if self.loss_type in P.REFERENCE_FREE else self.reference_sums(data)
        if self.loss_type in P.AVERAGED:
            sums = sums / counts
            ref = None if ref is None else ref / counts
        return dict(policy_chosen=sums[0::2], policy_rejected=sums[1::2],
                    ref_chosen=None if ref is None else ref[0::2], ref_rejected=None if ref is None else ref[1::2])

    def pair_values(self, data: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each pair's loss, chosen reward and rejected reward, three [pairs]."""
        logps = self.pair_logps(data)
        losses = P.dpo_losses(**logps, loss_type=self.loss_type, beta=self.beta,
                              label_smoothing=self.label_smoothing, simpo_gamma=self.simpo_gamma)  # [pairs]
        chosen, rejected = logps["policy_chosen"], logps["policy_rejected"]
        if logps["ref_chosen"] is not None:
            chosen, rejected = chosen - logps["ref_chosen"], rejected - logps["ref_rejected"]
        return losses, self.beta * chosen, self.beta * rejected

    def compute_loss(self, data: dict) -> dict:
        losses, chosen, rejected = self.pair_values(data)
        return {"loss": self.normalize(losses.sum(), data), **self.pair_step_metrics(losses, chosen, rejected)}
