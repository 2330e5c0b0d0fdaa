"""``ORPO``: odds-ratio preference optimisation (XTuner 0.2's name, arguments and module)."""
from __future__ import annotations

import torch

from sfttool.model import preference_loss as P
from sfttool.model.preference import PairwiseModel, check_args
from sfttool.registry import BUILDER


@BUILDER.register_module()
class ORPO(PairwiseModel):
    """Odds-ratio preference optimisation: NLL of the chosen answer minus ``beta`` times the log-sigmoid of
    the log odds ratio, both from length-averaged log-probs; no reference model.

    The NLL term is each chosen answer's mean token loss, averaged over pairs; it is shown as ``nll``
    beside the loss, the rewards and the mean ``log_odds_ratio``.
    """

    def __init__(self, llm, beta=0.1, **sft_args):
        check_args("sigmoid", beta, 0.0)
        super().__init__(llm, **sft_args)
        self.beta = beta

    def pair_terms(self, data: dict) -> dict[str, torch.Tensor]:
        """Each pair's loss, NLL term, log odds ratio and rewards, [pairs] each."""
        sums, counts = self.sequence_logps(data)
        means = sums / counts  # [2 * pairs]
        chosen, rejected = means[0::2], means[1::2]
        log_odds = P.orpo_log_odds(chosen, rejected)
        losses = -chosen - self.beta * torch.nn.functional.logsigmoid(log_odds)  # [pairs]
        return dict(loss=losses, nll=-chosen, log_odds=log_odds, chosen=self.beta * chosen,
                    rejected=self.beta * rejected)

    def pair_values(self, data: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each pair's loss, chosen reward and rejected reward, three [pairs]."""
        terms = self.pair_terms(data)
        return terms["loss"], terms["chosen"], terms["rejected"]

    def compute_loss(self, data: dict) -> dict:
        terms = self.pair_terms(data)
        return {"loss": self.normalize(terms["loss"].sum(), data),
                **self.pair_step_metrics(terms["loss"], terms["chosen"], terms["rejected"], nll=terms["nll"],
                                         log_odds_ratio=terms["log_odds"])}
