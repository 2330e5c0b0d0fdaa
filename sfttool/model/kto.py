"""``KTO``: Kahneman-Tversky optimisation on unpaired examples (a completion labelled desirable or not).

The batch (``kto_collate_fn``) holds each example beside its KL sequence (its prompt with another
example's completion), laid out as a preference pair: the reference, LoRA/QLoRA, ``reference`` and
``ref_llm`` are DPO's. Per example, with ``r`` its policy-minus-reference log-ratio and ``z`` the
micro-batch's mean log-ratio on the KL sequences (clamped at 0, no gradient), the loss is
``desirable_weight * (1 - σ(β(r - z)))`` or ``undesirable_weight * (1 - σ(β(z - r)))``
(``preference_loss.kto_losses``); a step's loss is the mean over its examples.
"""
from __future__ import annotations

from sfttool.model import preference_loss as P
from sfttool.model.dpo import DPO
from sfttool.model.step_metrics import step_metrics
from sfttool.registry import BUILDER, ConfigBuildError


@BUILDER.register_module()
class KTO(DPO):
    """KTO. Args (besides :class:`SupervisedFinetune`'s): ``beta``, ``desirable_weight``,
    ``undesirable_weight`` (the weights of the two kinds of examples' losses: raise the rarer kind's),
    and DPO's ``ref_llm`` and ``reference``."""

    def __init__(self, llm, beta=0.1, desirable_weight=1.0, undesirable_weight=1.0, ref_llm=None,
                 reference="initial_adapter", precompute_ref_log_probs=False, **sft_args):
        for name, weight in (("desirable_weight", desirable_weight), ("undesirable_weight", undesirable_weight)):
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight <= 0:
                raise ConfigBuildError(f"model.{name} must be a positive number, got {weight!r}")
        if precompute_ref_log_probs:
            raise ConfigBuildError("model.precompute_ref_log_probs: KTO's KL sequences are made per micro-batch "
                                   "(kto_collate_fn), so their reference log-probs cannot be computed before "
                                   "training; set it to False")
        super().__init__(llm, ref_llm=ref_llm, beta=beta, loss_type="sigmoid", reference=reference, **sft_args)
        self.desirable_weight, self.undesirable_weight = desirable_weight, undesirable_weight

    def compute_loss(self, data: dict) -> dict:
        if "kto_labels" not in data:
            raise ConfigBuildError("the batch has no `kto_labels`: KTO needs train_dataloader.collate_fn = "
                                   "dict(type=kto_collate_fn) and the dataset build_kto_dataset")
        logps = self.pair_logps(data)  # the 'chosen' slot: the example; the 'rejected' slot: its KL sequence
        desirable = data["kto_labels"].to(logps["policy_chosen"].device)
        losses, kl = P.kto_losses(logps["policy_chosen"], logps["ref_chosen"], logps["policy_rejected"],
                                  logps["ref_rejected"], desirable, self.beta, self.desirable_weight,
                                  self.undesirable_weight)  # [examples], scalar
        rewards = self.beta * (logps["policy_chosen"] - logps["ref_chosen"]).detach()
        return {"loss": self.normalize(losses.sum(), data),
                **step_metrics(loss=(losses.sum(), losses.numel()), kl=(kl, 1),
                               **{"rewards/chosen": (rewards[desirable].sum(), desirable.sum()),
                                  "rewards/rejected": (rewards[~desirable].sum(), (~desirable).sum())})}

    def validation_rows(self, data: dict) -> list:
        raise ConfigBuildError("KTO has no held-out loss (its KL baseline is a micro-batch mean): set val_ratio = 0 "
                               "and val_data_path = None")
