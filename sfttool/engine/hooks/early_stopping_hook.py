"""Stop training when the validation loss stops improving, and resume that count exactly.

mmengine's ``EarlyStoppingHook`` keeps its patience counter and best value on the hook, so a
``--resume`` started them over. This one also writes them into the message hub, which every
checkpoint holds, and reads them back before training resumes. It runs before the checkpoint hook's
``after_val_epoch`` (which re-saves a checkpoint of the validated iteration), so that checkpoint
holds the count after this validation::

    custom_hooks = [dict(type=EarlyStoppingHook, patience=early_stopping_patience,
                         min_delta=early_stopping_min_delta)]

``patience=None`` switches it off, so every config can list it.
"""
from __future__ import annotations

from mmengine.hooks import EarlyStoppingHook as MMEarlyStoppingHook

from sfttool.config import ConfigError
from sfttool.registry import BUILDER

STATE_KEY = "early_stopping"


@BUILDER.register_module()
class EarlyStoppingHook(MMEarlyStoppingHook):
    """Stop after ``patience`` validations in a row whose ``monitor`` did not improve on the best
    by more than ``min_delta`` (``rule='less'``: lower is better)."""

    # mmengine counts a validation as "no improvement" when compare(best -/+ min_delta, current): with
    # `<` an equal value was an improvement, and a loss stuck at one value never stopped the run.
    rule_map = {"greater": lambda x, y: x >= y, "less": lambda x, y: x <= y}
    priority = 80  # after the logger (60) and before the checkpoint hook (90) in after_val_epoch

    def __init__(self, patience: int | None = None, min_delta: float = 0.0, monitor: str = "val/loss",
                 rule: str = "less", **kwargs) -> None:
        if patience is not None and (not isinstance(patience, int) or patience < 1):
            raise ConfigError(f"early_stopping_patience must be a positive integer or None, got {patience!r}")
        super().__init__(monitor=monitor, rule=rule, min_delta=min_delta, patience=patience or 1, **kwargs)
        self.enabled = patience is not None

    def before_train(self, runner) -> None:
        state = runner.message_hub.get_info(STATE_KEY)
        if self.enabled and state is not None:  # a resumed run: continue the count it had reached
            self.best_score, self.wait_count = float(state["best"]), int(state["wait"])

    def after_val_epoch(self, runner, metrics) -> None:
        if not self.enabled:
            return
        super().after_val_epoch(runner, metrics)
        runner.message_hub.update_info(STATE_KEY, {"best": self.best_score, "wait": self.wait_count})
        if runner.train_loop.stop_training:
            runner.logger.info(f"Early stopping at iteration {runner.iter}: {self.monitor} has not improved on "
                               f"{self.best_score:.4f} by more than {abs(self.min_delta)} for {self.wait_count} "
                               f"validation(s) (patience {self.patience})")
