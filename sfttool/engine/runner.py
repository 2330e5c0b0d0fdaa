"""`TrainLoop`: an iteration loop that knows epochs, normalises the loss over
the whole optimizer step, and resumes at the exact data position.

One *iteration* is one micro-batch (as in mmengine and XTuner); the optimizer
steps every ``accumulative_counts`` iterations (or DeepSpeed's
``gradient_accumulation_steps``).

Loss normalisation: before the first micro-batch of an optimizer
step the loop looks ahead at all micro-batches of that step, counts their loss
units (trained tokens, or samples) with ``model.count_loss_units``, sums the
count over ranks, and hands every micro-batch

    data["loss_normalizer"] = global_count / (loss_factor * world_size)

The optimizer wrapper divides each micro-batch loss by ``loss_factor`` and
data parallelism averages gradients over ``world_size`` ranks, so the step's
gradient is ``sum(per-token loss) / global_count``: the mean over every trained
token of the global batch, whatever the split.

With sequence parallelism (``sfttool.parallel``) the ``sp`` ranks of a group
read the same rows, each computing the loss of its slice: the summed count holds
every row ``sp`` times, so ``global_count`` is that sum divided by ``sp``, and the
gradient is still ``sum(per-token loss) / global_count``.

What a run shows: a micro-batch's backward loss is its share of the step's loss,
not a loss. Each micro-batch also returns *step metrics* (``sfttool.model.step_metrics``):
for every value to show (the loss; a preference model's rewards, margins and
accuracies; an RL model's rewards or KL), its sum and its count over the
micro-batch. The loop adds them over the optimizer step's micro-batches, sums
them over the processes (one all-reduce per step) and divides: the step's loss
is ``sum(per-token loss) / global_count``, exactly what one batch holding the
whole step would report. The hooks get these values as ``outputs`` at the step's
last micro-batch (``RuntimeInfoHook`` puts them in the message hub as
``train/<name>``: the log, scalars.json, the trackers, the progress line and the
plot read them there) and an empty ``outputs`` at the other micro-batches. A run
that stops inside a step (``--dry-run``) shows the micro-batches it ran.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Iterator

from mmengine.dist import all_reduce, get_world_size
from mmengine.logging import print_log
from mmengine.model import is_model_wrapper
from mmengine.runner import IterBasedTrainLoop

from sfttool.dataset.errors import DatasetError
from sfttool.engine.checkpoint import restore_rng_state, saved_data_position
from sfttool.model.step_metrics import StepAccumulator
from sfttool.registry import BUILDER

# The message hub's info key that marks a --dry-run's runner (its work dir is a scratch folder, removed after).
DRY_RUN_INFO = "sfttool_dry_run"


def deepspeed_engine(model: Any) -> Any:
    """The ``DeepSpeedEngine`` inside mmengine's DeepSpeed wrapper; None for any other model."""
    if type(model).__name__ != "MMDeepSpeedEngineWrapper":
        return None
    return getattr(model, "model", None)


def unwrap_model(model: Any) -> Any:
    """The user's model inside a DDP or DeepSpeed wrapper."""
    if is_model_wrapper(model):
        return model.module
    engine = deepspeed_engine(model)
    if engine is not None and hasattr(engine, "module"):
        return engine.module
    return model


class _ResumableBatches:
    """Endless batches over epochs; starts at any iteration without reading
    the batches before it in earlier epochs.

    The sampler is seeded by ``seed + epoch`` (mmengine's ``DefaultSampler``),
    so jumping to epoch ``e`` and skipping ``offset`` batches reproduces the
    uninterrupted order exactly. ``position``, the ``(epoch, batches into it)`` a
    checkpoint recorded, says where; without it, ``start_iter`` does, right when
    every pass gives ``len(dataloader)`` batches. A stream (sfttool.dataset.streaming)
    or lazily encoded data (sfttool.dataset.lazy) may give another number, its
    length being an estimate or dropped rows missing: a pass that gives another
    number is reported once, a pass that ends while skipping is followed into the
    next one, and a pass without any batch is an error (an endless loop of empty
    passes otherwise).
    """

    def __init__(self, dataloader, start_iter: int = 0, position: tuple[int, int] | None = None) -> None:
        self.dataloader = dataloader
        self.epoch, offset = position if position is not None else divmod(start_iter, len(dataloader))
        self._positioned = position is not None
        self._batches = 0  # given by the current pass, counted from its start
        self._reported = False
        # Creating a DataLoader iterator draws a worker seed from torch's global
        # RNG. An uninterrupted run drew it when the epoch began: do the same
        # (now when resuming mid-epoch, lazily at the first batch otherwise).
        self._iterator = self._epoch_iterator() if offset else None
        self._resuming_at = start_iter
        for _ in range(offset):
            next(self)
        self._resuming_at = None

    @property
    def batches_into_epoch(self) -> int:
        """Batches the current pass has given so far."""
        return self._batches

    @property
    def data_position(self) -> tuple[int, int]:
        """``(epoch, batches into it)`` after the last batch given: where a resume starts."""
        return self.epoch, self._batches

    def _epoch_iterator(self) -> Iterator:
        sampler = getattr(self.dataloader, "sampler", None)
        # A stream (sfttool.dataset.streaming) orders itself by epoch, as a sampler does.
        for obj in (sampler, getattr(self.dataloader, "batch_sampler", None),
                    getattr(self.dataloader, "dataset", None)):
            if hasattr(obj, "set_epoch"):
                obj.set_epoch(self.epoch)
        return iter(self.dataloader)

    def __next__(self):
        if self._iterator is None:
            self._iterator = self._epoch_iterator()
        while True:
            try:
                batch = next(self._iterator)
            except StopIteration:
                self._next_epoch()
                continue
            self._batches += 1
            return batch

    def _next_epoch(self) -> None:
        if self._batches == 0:
            raise DatasetError(f"epoch {self.epoch} of the training data gave no batch: its dataset is empty or "
                               "can be read only once (a generator); give a dataset that supports several passes")
        if self._batches != len(self.dataloader) and not self._reported:
            self._reported = True
            print_log(self._length_mismatch(), logger="current", level=logging.WARNING)
        self.epoch += 1
        self._batches = 0
        self._iterator = self._epoch_iterator()

    def _length_mismatch(self) -> str:
        batches, expected = self._batches, len(self.dataloader)
        message = (f"epoch {self.epoch} of the training data gave {batches} batches, but "
                   f"len(train_dataloader) is {expected}")
        rows = getattr(getattr(self.dataloader, "dataset", None), "rows_per_epoch", None)
        if rows is not None:
            batch_size = getattr(self.dataloader, "batch_size", None) or 1
            message += (f" (rows_per_epoch={rows}; rows_per_epoch={batches * batch_size} would give "
                        f"{batches} batches of {batch_size})")
        if self._resuming_at is not None:
            message += f"; resuming at iteration {self._resuming_at}, the skip went on into epoch {self.epoch + 1}"
        else:
            message += ": epochs are counted with the length"
        if self._positioned or self._resuming_at is None:
            return message + " (a resume still lands on the exact batch: checkpoints hold the data position)"
        return message + ": a checkpoint without the data position resumes on the exact batch only when they agree"


def iterations_per_step(optim_wrapper: Any, model: Any) -> int:
    """Micro-batches per optimizer step: DeepSpeed's ``gradient_accumulation_steps``, else the optimizer
    wrapper's ``accumulative_counts``."""
    gas = getattr(deepspeed_engine(model), "gradient_accumulation_steps", None)
    if callable(gas):
        return int(gas())
    return int(getattr(optim_wrapper, "_accumulative_counts", 1))


def optimizer_step_window(optim_wrapper: Any, model: Any, it: int, max_iters: int) -> tuple[int, int]:
    """``(micro-batches left in the optimizer step containing iteration it,
    loss_factor the wrapper divides their losses by)``.

    Mirrors ``OptimWrapper.scale_loss``: windows of ``accumulative_counts``
    micro-batches starting at multiples of it, the last one shorter (and
    scaled by its own length) when ``max_iters`` is not a multiple. DeepSpeed
    scales by its ``gradient_accumulation_steps``.

    >>> optimizer_step_window(OptimWrapper(opt, accumulative_counts=4), model, 8, 10)  # doctest: +SKIP
    (2, 2)
    """
    accum = iterations_per_step(optim_wrapper, model)
    if deepspeed_engine(model) is not None:
        return min(accum - it % accum, max_iters - it), accum
    if accum == 1:
        return 1, 1
    remainder = max_iters % accum
    factor = remainder if remainder and it >= max_iters - remainder else accum
    return min(accum - it % accum, max_iters - it), factor


def close_short_deepspeed_window(model: Any, it: int) -> None:
    """Make iteration ``it``, the last micro-batch of its optimizer step, a
    DeepSpeed accumulation boundary when DeepSpeed's own counter would not.

    DeepSpeed steps when its micro-step count reaches a multiple of
    ``gradient_accumulation_steps``; the last window of a run whose length is not
    a multiple would be accumulated and never applied. The loss normaliser
    already counts only that window's tokens, so the step it makes is exact."""
    engine = deepspeed_engine(model)
    if engine is not None and (it + 1) % int(engine.gradient_accumulation_steps()) != 0:
        engine.set_gradient_accumulation_boundary(True)


def forget_timings(runner: Any) -> None:
    """After a resume, time only this run's iterations. The checkpoint's message hub brings back the
    iteration times from before the interruption, and the logged ``time`` averaged them in (132.9 s
    shown for a 36 s iteration); the iteration clock started before the data skip, which is no
    iteration's time either."""
    import time

    from mmengine.hooks import IterTimerHook

    for key in ("train/time", "train/data_time"):
        runner.message_hub.log_scalars.pop(key, None)
    for hook in runner.hooks:
        if isinstance(hook, IterTimerHook):
            hook.t = time.time()


def planned_end(runner: Any) -> int:
    """The iteration this run ends after: the loop's end, or where a hook with ``stop_at``
    (``--max-steps``, ``--dry-run``) stops it."""
    stops = [h.stop_at for h in runner.hooks if getattr(h, "stop_at", None) is not None]
    return min([runner.max_iters, *stops])


@BUILDER.register_module()
class TrainLoop(IterBasedTrainLoop):
    """XTuner-compatible train loop: give ``max_epochs`` or ``max_iters``.

    >>> train_cfg = dict(type=TrainLoop, max_epochs=3)   # 3 passes over the data
    >>> train_cfg = dict(type=TrainLoop, max_iters=200)  # 200 micro-batches
    """

    def __init__(self, runner, dataloader, max_iters: int | None = None,
                 max_epochs: int | float | None = None, **kwargs) -> None:
        if (max_iters is None) == (max_epochs is None):
            raise ValueError("train_cfg: give exactly one of max_epochs and max_iters "
                             f"(got max_epochs={max_epochs!r}, max_iters={max_iters!r})")
        if max_epochs is not None:
            if isinstance(dataloader, dict):
                dataloader = runner.build_dataloader(
                    dataloader, seed=runner.seed,
                    diff_rank_seed=runner._randomness_cfg.get("diff_rank_seed", False))
            max_iters = int(math.ceil(max_epochs * len(dataloader)))
        super().__init__(runner, dataloader, max_iters=int(max_iters), **kwargs)
        self._max_epochs = max_epochs if max_epochs is not None else math.ceil(max_iters / len(self.dataloader))
        self._pending: list = []  # the current optimizer step's (micro-batch, data position after it), looked ahead
        self.data_position: tuple[int, int, int] | None = None  # (iteration, epoch, batches) after the last batch
        self._step_metrics = StepAccumulator()  # the current step's sums and counts

    @property
    def iters_per_epoch(self) -> int:
        return len(self.dataloader)

    def run(self):
        self.runner.call_hook("before_train")
        self.runner.call_hook("before_train_epoch")
        self.dataloader_iterator = self._batches()
        # Restore RNG last, after the before_train hooks (a generation hook may
        # run there) and the data fast-forward, so the next iteration draws
        # exactly what it drew in the uninterrupted run.
        if self._iter > 0:
            restore_rng_state(self.runner)
            forget_timings(self.runner)
        if self._iter > 0:
            # The batches the skip took from the current pass (a stream's pass may be shorter than the length).
            from sfttool import compat

            compat.inform(f"Resuming at iteration {self._iter} (epoch {self.dataloader_iterator.epoch}, "
                          f"batch {self.dataloader_iterator.batches_into_epoch} of {self.iters_per_epoch})")
        while self._iter < self._max_iters and not self.stop_training:
            self.runner.model.train()
            self._epoch = self.dataloader_iterator.epoch
            self.run_iter(self._next_batch())
            self._decide_current_val_interval()
            if (self.runner.val_loop is not None and self._iter >= self.val_begin
                    and (self._iter % self.val_interval == 0 or self._iter == self._max_iters)):
                self.runner.val_loop.run()
        self.runner.call_hook("after_train_epoch")
        self.runner.call_hook("after_train")
        return self.runner.model

    def run_iter(self, data_batch) -> None:
        """mmengine's iteration, with what it shows summed up per optimizer step (module docstring)."""
        self.runner.call_hook("before_train_iter", batch_idx=self._iter, data_batch=data_batch)
        outputs = self.runner.model.train_step(data_batch, optim_wrapper=self.runner.optim_wrapper)
        self.add_to_step(data_batch, outputs)
        step_ends = not self._pending or self._iter + 1 >= planned_end(self.runner)
        shown = self.step_values() if step_ends else {}
        self.runner.call_hook("after_train_iter", batch_idx=self._iter, data_batch=data_batch, outputs=shown)
        self._iter += 1

    def add_to_step(self, data_batch: dict, outputs: dict) -> None:
        """One micro-batch's outputs into the current optimizer step's sums and counts."""
        self._step_metrics.add(outputs)

    def step_values(self) -> dict:
        """The ended optimizer step's values, reduced over its micro-batches and the processes."""
        return self._step_metrics.reduce()

    def _batches(self) -> Iterator:
        """The micro-batches from iteration ``self._iter`` on (a loop over generated data gives its own),
        from the data position the resumed checkpoint holds for this iteration when it holds one."""
        position = saved_data_position(self.runner, self._iter) if self._iter > 0 else None
        return _ResumableBatches(self.dataloader, self._iter, position)

    def _next_batch(self) -> dict:
        """The next micro-batch, with the step-wide ``loss_normalizer`` set; ``data_position`` the data
        position after it (``RNGStateHook`` puts it in the checkpoint)."""
        if not self._pending:
            size, loss_factor = optimizer_step_window(
                self.runner.optim_wrapper, self.runner.model, self._iter, self._max_iters)
            self._pending = [self._read_batch() for _ in range(size)]
            self._set_loss_normalizer([batch for batch, _ in self._pending], loss_factor)
        batch, position = self._pending.pop(0)
        self.data_position = None if position is None else (self._iter + 1, *position)
        if not self._pending:
            close_short_deepspeed_window(self.runner.model, self._iter)
        return batch

    def _read_batch(self) -> tuple[dict, tuple[int, int] | None]:
        """The next batch and the data position after it (None from a loop's own batches without one)."""
        batch = next(self.dataloader_iterator)
        return batch, getattr(self.dataloader_iterator, "data_position", None)

    def _set_loss_normalizer(self, batches: list, loss_factor: int) -> None:
        model = unwrap_model(self.runner.model)
        count_fn = getattr(model, "count_loss_units", None)
        if count_fn is None:  # a model without the contract: keep its own normalisation
            return
        import torch

        local = sum(int(count_fn(batch["data"])) for batch in batches)
        total = torch.tensor(float(local), dtype=torch.float64)
        all_reduce(total, op="sum")
        from sfttool.parallel.groups import get_sequence_parallel_world_size

        global_count = total.item() / get_sequence_parallel_world_size()  # each row counted once
        # Guard: a step with no trained token at all contributes zero loss.
        normalizer = max(global_count, 1.0) / (loss_factor * get_world_size())
        for batch in batches:
            batch["data"]["loss_normalizer"] = normalizer
