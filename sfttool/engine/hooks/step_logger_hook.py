"""The log file, ``vis_data/scalars.json`` and the trackers get one line per logged optimizer step.

The train loop (``sfttool.engine.runner``) hands the hooks each optimizer step's values (the loss,
a preference run's rewards...) at the step's last micro-batch. ``StepLoggerHook`` is mmengine's
``LoggerHook`` writing its train lines there: at the end of each step that holds a multiple of
``interval`` iterations, and of the run's last (mmengine's wrote every ``interval`` iterations,
inside a step too, and could leave the last steps out). Every run's
``default_hooks.logger`` that is mmengine's ``LoggerHook`` becomes one (``step_logger``).

mmengine's ``LogProcessor`` logs any value whose name matches ``loss`` or ``grad_norm`` as the mean
of its last ``window_size`` values; ``log_processor_cfg`` keeps that for iteration times only, so
``loss``, ``grad_norm`` and every step value are the logged step's own.
"""
from __future__ import annotations

from typing import Any

from mmengine.hooks import LoggerHook

from sfttool.engine.runner import planned_end
from sfttool.registry import BUILDER

# The values mmengine's LogProcessor averages over its window: per-iteration times only.
TIME_PATTERN = r".*(time|data_time).*"


@BUILDER.register_module()
class StepLoggerHook(LoggerHook):
    """mmengine's ``LoggerHook`` (same arguments) whose train lines come at optimizer-step ends."""

    def before_train(self, runner) -> None:
        self._step_end = runner.iter  # where the previous optimizer step ended

    def after_train_iter(self, runner, batch_idx: int, data_batch=None, outputs=None) -> None:
        if outputs == {}:  # inside an optimizer step: nothing new to log
            return
        done, previous = runner.iter + 1, self._step_end
        self._step_end = done
        if not (holds_a_multiple(previous, done, self.interval) or done >= planned_end(runner)):
            return
        tag, log_str = runner.log_processor.get_log_after_iter(runner, batch_idx, "train")
        runner.logger.info(log_str)
        runner.visualizer.add_scalars(tag, step=done, file_path=self.json_log_path)


def holds_a_multiple(previous_end: int, end: int, interval: int) -> bool:
    """Whether the iterations after ``previous_end`` up to ``end`` (one optimizer step) hold a
    multiple of ``interval``.

    >>> [end for end in range(4, 44, 4) if holds_a_multiple(end - 4, end, 10)]   # steps of 4
    [12, 20, 32, 40]
    """
    return end // interval > previous_end // interval


def step_logger(logger: Any) -> Any:
    """``default_hooks.logger`` with mmengine's ``LoggerHook`` (a config dict) replaced by
    ``StepLoggerHook``; anything else is left as it is."""
    if not isinstance(logger, dict):
        return logger
    kind = logger.get("type", LoggerHook)
    if kind is LoggerHook or kind in ("LoggerHook", "mmengine.hooks.LoggerHook"):
        return dict(logger, type=StepLoggerHook)
    return logger


def log_processor_cfg(log_processor: Any) -> dict:
    """The runner's ``log_processor``: the config's (default ``by_epoch=False``), averaging only
    iteration times unless it sets its own ``mean_pattern``."""
    cfg = dict(log_processor or dict(by_epoch=False))
    cfg.setdefault("mean_pattern", TIME_PATTERN)
    return cfg
