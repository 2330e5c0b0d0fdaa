"""Stop a run early at an optimizer-step boundary: ``sfttool train --max-steps N``
(with a checkpoint, so ``--resume`` continues the full run) and ``--dry-run``
(one iteration, nothing saved)."""
from __future__ import annotations

from mmengine.hooks import Hook

from sfttool.engine.hooks.preemption_hook import save_checkpoint_now
from sfttool.registry import BUILDER


@BUILDER.register_module()
class StopAfterHook(Hook):
    """Stop after ``iterations`` iterations of this process (``--max-steps N``: N optimizer steps of
    ``accumulative_counts`` iterations each, counted from where the run starts, its resume point
    included). The learning-rate schedule stays the full run's, so the run is a prefix of it."""

    priority = "LOWEST"  # after the checkpoint hook: a step it saved anyway is not saved twice

    def __init__(self, iterations: int, save: bool = True) -> None:
        self.iterations = int(iterations)
        self.save = save
        self.stop_at: int | None = None

    def before_train(self, runner) -> None:
        self.stop_at = runner.iter + self.iterations

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None) -> None:
        if self.stop_at is None or runner.iter + 1 < self.stop_at or runner.iter + 1 >= runner.max_iters:
            return  # the loop's own end saves its last checkpoint
        if self.save:
            save_checkpoint_now(runner)
        runner.train_loop.stop_training = True
