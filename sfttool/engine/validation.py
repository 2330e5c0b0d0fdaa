"""Validation: the mean cross-entropy over every trained token of the validation set (SFT), or the
mean loss, rewards and accuracy over every held-out pair (preference models).

mmengine's machinery, with the loss kept exact:

- ``ValLoop`` (mmengine's, one step changed): each batch gives, per row, the summed token loss and
  the trained-token count (``SupervisedFinetune.summed_row_losses``), not logits.
- ``ValLossMetric`` adds them up over the whole set: ``val/loss = sum(loss) / sum(tokens)``,
  ``val/ppl = exp(val/loss)``. Token-weighted like training's loss, so it does not depend on how rows
  are packed or batched. mmengine's ``DefaultSampler`` deals rows to ranks in turn and pads the last
  round with repeats; ``BaseMetric`` collects the rows back in dataset order and drops the repeats,
  so 2 processes sum the very same rows, in the same order, as 1.

- Preference models (``DPO``, ``ORPO``, ``RewardModel``) give, per row, one dict per pair: its loss and
  the values training shows beside it (``PairwiseModel.validation_rows``). ``PairValMetric`` averages
  each over every held-out pair: ``val/loss``, ``val/rewards/accuracies``, ``val/rewards/margins``, ...
  (a reward model's ``val/accuracy``, ``val/scores/margins``, ...). Pair-weighted and summed with
  ``math.fsum``, so packing, batch size and process count change nothing but rounding in the forward.

The Runner gets ``val_dataloader`` / ``val_cfg`` / ``val_evaluator`` from ``validation_runner_args``;
``TrainLoop`` runs the loop every ``val_interval`` iterations and once at the end.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import math
from typing import Any, Sequence

import torch
from mmengine.dist import all_gather_object
from mmengine.evaluator import BaseMetric
from mmengine.logging import print_log
from mmengine.runner import ValLoop as MMValLoop
from mmengine.runner.base_loop import BaseLoop

from sfttool.engine.assemble import dataloader_cfg
from sfttool.engine.processes import build_dataset_rank0_first
from sfttool.engine.runner import unwrap_model
from sfttool.engine.spec import RunSpec, trains_on_pairs
from sfttool.errors import SfttoolError
from sfttool.registry import BUILDER, resolve_type
from sfttool.utils.checkpoint_file import find_best_checkpoint, load_checkpoint


class ValidationError(SfttoolError, ValueError):
    """Validation settings or data that cannot give a loss."""


@BUILDER.register_module()
class ValLossMetric(BaseMetric):
    """``val/loss`` (token mean) and ``val/ppl`` from per-row ``(summed loss, trained tokens)`` pairs."""

    default_prefix = "val"

    def process(self, data_batch: Any, data_samples: Sequence) -> None:
        self.results.extend(data_samples)  # one (loss sum, tokens) pair per row, in the sampler's order

    def compute_metrics(self, results: list) -> dict:
        tokens = sum(int(count) for _, count in results)
        if tokens == 0:
            raise ValidationError("the validation set has no trained token (every label is -100); give "
                                  "validation rows with answers (val_data_path / val_ratio)")
        loss = math.fsum(float(total) for total, _ in results) / tokens  # fsum: exact whatever the order
        return {"loss": loss, "ppl": math.exp(loss) if loss < 700 else math.inf}

    def evaluate(self, size: int) -> dict:
        """``BaseMetric.evaluate`` with the rows gathered by ``all_gather_object``: mmengine's CPU
        collection writes every rank's rows to ``./.dist_test`` for rank 0 to read, which leaves that
        folder in the working directory and needs a file system shared by every node."""
        parts = all_gather_object(list(self.results))  # [rank][row]: rank r holds rows r, r + world, ...
        rows = [row for round_ in itertools.zip_longest(*parts) for row in round_ if row is not None][:size]
        self.results.clear()
        return {f"{self.prefix}/{k}": v for k, v in self.compute_metrics(rows).items()}


@BUILDER.register_module()
class PairValMetric(ValLossMetric):
    """The mean of each per-pair value (``val/loss``, ``val/rewards/accuracies``, ...) over every held-out
    pair, from rows of per-pair dicts (``PairwiseModel.validation_rows``)."""

    def compute_metrics(self, results: list) -> dict:
        pairs = [pair for row in results for pair in row]
        if not pairs:
            raise ValidationError("the validation set has no pair; give validation rows with pairs "
                                  "(val_data_path / val_ratio)")
        return {name: math.fsum(pair[name] for pair in pairs) / len(pairs) for name in pairs[0]}


@BUILDER.register_module()
class ValLoop(MMValLoop):
    """mmengine's ``ValLoop`` whose step asks the model for per-row summed losses instead of
    ``val_step`` predictions (full logits), under the training's autocast dtype."""

    def __init__(self, runner, dataloader, evaluator: Any = None, fp16: bool = False) -> None:
        # mmengine's __init__ warns that a datasets.Dataset has no `metainfo`: nothing here reads it.
        BaseLoop.__init__(self, runner, dataloader)
        evaluator = evaluator if evaluator is not None else [dict(type=ValLossMetric)]
        self.evaluator = runner.build_evaluator(evaluator) if isinstance(evaluator, (dict, list)) else evaluator
        self.fp16 = fp16
        self.val_loss: dict = {}

    def run(self) -> dict:
        """mmengine's run, with this validation's metrics alone in the message hub. Its LogProcessor
        logs any key matching ``loss`` as the mean of its last ``window_size`` values, so ``val/loss``
        in the log, scalars.json and every tracker was an average over earlier validations (and each
        validation's progress lines showed the previous one's)."""
        self._forget_earlier_metrics()
        self.runner.call_hook("before_val")
        self.runner.call_hook("before_val_epoch")
        self.runner.model.eval()
        for idx, data_batch in enumerate(self.dataloader):
            self.run_iter(idx, data_batch)
        metrics = self.evaluator.evaluate(len(self.dataloader.dataset))
        self._forget_earlier_metrics()
        self.runner.call_hook("after_val_epoch", metrics=metrics)
        self.runner.call_hook("after_val")
        return metrics

    def _forget_earlier_metrics(self) -> None:
        scalars = self.runner.message_hub.log_scalars  # RuntimeInfoHook stores metric k as "val/k"
        for key in [k for k in scalars if k.startswith("val/val/")]:
            del scalars[key]

    @torch.no_grad()
    def run_iter(self, idx: int, data_batch: dict) -> None:
        self.runner.call_hook("before_val_iter", batch_idx=idx, data_batch=data_batch)
        model = unwrap_model(self.runner.model)
        data = model.data_preprocessor(data_batch, False)["data"]  # to the model's device
        with self._autocast(model):
            outputs = validation_rows(model, data)
        self.evaluator.process(data_samples=outputs, data_batch=data_batch)
        self.runner.call_hook("after_val_iter", batch_idx=idx, data_batch=data_batch, outputs=outputs)

    def _autocast(self, model: Any):
        """The training step's autocast (``AmpOptimWrapper``'s dtype), so validation sees the same numerics."""
        dtype = getattr(getattr(self.runner, "optim_wrapper", None), "cast_dtype", None)
        if self.fp16 and dtype is None:
            dtype = torch.float16
        if dtype is None:
            return contextlib.nullcontext()
        device = next(model.parameters()).device.type
        return torch.autocast(device_type=device, dtype=dtype)


def validation_rows(model: Any, data: dict) -> list:
    """One result per row of the batch: a preference model's per-pair dicts (``validation_rows``), else
    an SFT model's ``(summed token loss, trained tokens)``."""
    per_pair = getattr(model, "validation_rows", None)
    if per_pair is not None:
        return per_pair(data)
    sums, tokens = model.summed_row_losses(data)
    return list(zip(sums.tolist(), tokens.tolist()))


def validation_runner_args(cfg: Any, spec: RunSpec) -> dict:
    """The Runner's ``val_dataloader`` (its dataset built, rank 0 first, as the training set),
    ``val_cfg`` and ``val_evaluator``; {} when the run validates nothing."""
    if not spec.validation:
        return {}
    dataset = build_dataset_rank0_first(cfg.val_dataloader.dataset)
    if len(dataset) == 0:
        raise ValidationError("the validation set is empty; set val_data_path or val_ratio in PART 1 to give it rows")
    pairs = trains_on_pairs(cfg)
    held_out = f" ({sum(map(len, dataset['sample_lengths'])) // 2} pairs)" if pairs else ""
    print_log(f"Validation: {len(dataset)} rows{held_out}", logger="current", level=logging.INFO)
    loop = dict(cfg.get("val_cfg") or {})
    loop["type"] = resolve_type(loop["type"], "val_cfg.type") if "type" in loop else ValLoop
    return dict(val_dataloader=dataloader_cfg(cfg, dataset, "val_dataloader"), val_cfg=loop,
                val_evaluator=cfg.get("val_evaluator") or dict(type=PairValMetric if pairs else ValLossMetric))


def restore_best_weights(runner: Any, spec: RunSpec) -> Any:
    """``export_best = True`` (PART 1): before the end-of-training HF export, load the weights of the
    best validation (the checkpoint ``work_dir/best_checkpoint`` names) into the model, so
    ``hf_adapter/`` / ``hf_model/`` hold them instead of the last weights. Returns the checkpoint used,
    or None (not asked, or no best checkpoint: the last weights are exported, with a warning)."""
    if not spec.export_best:
        return None
    best = find_best_checkpoint(runner.work_dir)
    if best is None or best.is_dir():  # a folder (DeepSpeed's sharded save): `convert pth_to_hf --best` reads it
        why = "no validation saved a best checkpoint" if best is None else f"{best} is a checkpoint folder"
        print_log(f"export_best: {why}; exporting the last weights (convert another checkpoint with "
                  "`sfttool convert pth_to_hf`)", logger="current", level=logging.WARNING)
        return None
    model = unwrap_model(runner.model)
    state = {k.removeprefix("module."): v for k, v in load_checkpoint(best)["state_dict"].items()}
    missing = set(model.state_dict()) - set(state)
    if missing:
        raise ValidationError(f"export_best: {best} lacks weights of this model such as {sorted(missing)[0]}")
    model.load_state_dict(state, strict=False)
    print_log(f"Exporting the weights of the best validation ({best.name})", logger="current", level=logging.INFO)
    return best
