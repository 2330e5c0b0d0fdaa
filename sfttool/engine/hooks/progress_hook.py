"""Live progress on rank 0, from the first optimizer step: a bar on a terminal,
plain lines otherwise (a log file, a CI job, a pipe).

    iter 48/80  60% | step 3/5 | loss 2.3141 | lr 1.2e-04 | 312 tok/s | ETA 0:04:10

``loss`` (and a preference run's ``margin``) is the last optimizer step's value,
exact over all of its micro-batches and processes (``sfttool.engine.runner``);
``step`` is shown when a step takes several iterations. On a terminal the bar is
redrawn in place after every iteration (the loss changes at each step's end);
elsewhere a line is printed at the end of the first optimizer step, of each step
that holds a multiple of ``interval`` iterations (the logger's, so the lines come
with the log's) and of the last. Speed and ETA count only this process's
iterations after its first (which carries one-time costs; no ETA until the
second): after ``--resume`` the time before the interruption is not averaged in
either.
"""
from __future__ import annotations

import sys
import time

from mmengine.hooks import Hook

from sfttool.engine.hooks.step_logger_hook import holds_a_multiple
from sfttool.engine.runner import iterations_per_step, planned_end
from sfttool.registry import BUILDER

BAR_WIDTH = 24


def format_eta(seconds: float) -> str:
    """``4210.2`` -> ``'1:10:10'``."""
    seconds = int(round(max(seconds, 0)))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


# Shown beside the loss, each the last optimizer step's value: preference training's mean reward margin
# (chosen minus rejected); online RL's (GRPO) mean reward, KL, mean completion length and fraction of
# clipped tokens.
SHOWN_SCALARS = (("margin", "train/rewards/margins"), ("reward", "train/reward"), ("kl", "train/kl"),
                 ("len", "train/completions/mean_length"), ("clip", "train/clip_ratio/region_mean"))


def progress_line(done: int, total: int, loss: float | None, lr: float | None, tokens_per_s: float | None,
                  eta_s: float | None, bar: bool, extra: dict | None = None, per_step: int = 1) -> str:
    """One progress report; ``extra`` adds named values after the loss; ``per_step``: iterations per
    optimizer step (above 1, the step is shown).

    >>> progress_line(12, 80, 2.31412, 1.2e-4, 312.4, 250, bar=False)
    'iter 12/80  15% | loss 2.3141 | lr 1.2e-04 | 312 tok/s | ETA 0:04:10'
    >>> progress_line(48, 80, 0.61, 1.2e-4, 312.4, None, bar=False, extra={'margin': 0.4567}, per_step=16)
    'iter 48/80  60% | step 3/5 | loss 0.6100 | margin 0.457 | lr 1.2e-04 | 312 tok/s'
    """
    fraction = done / total if total else 1.0
    shown = f"[{'#' * round(BAR_WIDTH * fraction):-<{BAR_WIDTH}}] " if bar else ""
    parts = [f"iter {done}/{total} {shown}{fraction:4.0%}"]
    if per_step > 1:
        parts.append(f"step {-(-done // per_step)}/{-(-total // per_step)}")
    if loss is not None:
        parts.append(f"loss {loss:.4f}")
    parts += [f"{name} {value:.3f}" for name, value in (extra or {}).items()]
    if lr is not None:
        parts.append(f"lr {lr:.1e}")
    if tokens_per_s is not None:
        parts.append(f"{tokens_per_s:.0f} tok/s")
    if eta_s is not None:
        parts.append(f"ETA {format_eta(eta_s)}")
    return " | ".join(parts)


def validation_line(step: int, metrics: dict) -> str:
    """``validation at iter 20: val/loss 0.5698 (ppl 1.77)``."""
    line = f"validation at iter {step}: val/loss {metrics['val/loss']:.4f}"
    return line + (f" (ppl {metrics['val/ppl']:.2f})" if "val/ppl" in metrics else "")


@BUILDER.register_module()
class ProgressHook(Hook):
    """The train entry adds it to every run; ``interval`` is the plain-line interval (iterations)."""

    priority = "LOW"  # after RuntimeInfoHook (VERY_HIGH) has put the step's loss and lr in the hub

    def __init__(self, interval: int = 10, stream=None) -> None:
        self.interval = max(int(interval), 1)
        self.stream = stream
        self._first_iter = 0     # the iteration this process started at (a resume's)
        self._step_end = 0       # the iteration the previous optimizer step ended at
        self._per_step = 1
        self._start: float | None = None   # when this process's first iteration began
        self._clock: tuple | None = None   # (time, iterations done, tokens) at the end of its first iteration
        self._tokens = 0

    def _out(self):
        return self.stream or sys.stdout

    def before_train(self, runner) -> None:
        self._first_iter = self._step_end = runner.iter
        self._start, self._clock, self._tokens = None, None, 0
        self._per_step = iterations_per_step(getattr(runner, "optim_wrapper", None), getattr(runner, "model", None))

    def before_train_iter(self, runner, batch_idx, data_batch=None) -> None:
        if self._start is None:  # the first iteration of this process: after a resume's data skip
            self._start = time.perf_counter()

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None) -> None:
        from mmengine.dist import is_main_process

        if data_batch and "input_ids" in data_batch.get("data", {}):
            self._tokens += data_batch["data"]["input_ids"].numel()
        done, total = runner.iter + 1, planned_end(runner)
        if self._clock is None:
            self._clock = (time.perf_counter(), done, self._tokens)
        if not is_main_process() or self._start is None:
            return
        tty = self._out().isatty()
        if not tty and not self._line_due(done, total, step_ended=outputs != {}):
            return
        line = self._line(runner, done, total, bar=tty)
        self._out().write(("\r" + line + ("\n" if done >= total else "")) if tty else line + "\n")
        self._out().flush()

    def _line_due(self, done: int, total: int, step_ended: bool) -> bool:
        """A plain line at a step's end (the train loop passes empty ``outputs`` inside a step): the
        first of this process, each that holds a multiple of ``interval`` iterations, the last."""
        if not step_ended:
            return False
        previous, self._step_end = self._step_end, done
        return previous == self._first_iter or holds_a_multiple(previous, done, self.interval) or done >= total

    def after_val_epoch(self, runner, metrics=None) -> None:
        """One line per validation, under the bar (which it ends on a terminal)."""
        from mmengine.dist import is_main_process

        if not is_main_process() or not metrics or "val/loss" not in metrics:
            return
        out = self._out()
        line = validation_line(runner.iter, metrics)
        out.write(("\n" if out.isatty() and runner.iter < planned_end(runner) else "") + line + "\n")
        out.flush()

    def after_train(self, runner) -> None:
        from mmengine.dist import is_main_process

        out = self._out()
        if is_main_process() and out.isatty() and self._start is not None and runner.iter < planned_end(runner):
            out.write("\n")  # a run stopped early (a signal) leaves the bar's line open
            out.flush()

    def _line(self, runner, done: int, total: int, bar: bool) -> str:
        scalars = runner.message_hub.log_scalars
        loss, lr = scalars.get("train/loss"), scalars.get("train/lr")
        extra = {name: float(scalars[key].current()) for name, key in SHOWN_SCALARS if key in scalars}
        speed, eta = self._speed_and_eta(done, total)
        return progress_line(done, total, loss.current() if loss is not None else None,
                             lr.current() if lr is not None else None, speed, eta, bar, extra, self._per_step)

    def _speed_and_eta(self, done: int, total: int) -> tuple[float, float | None]:
        """Tokens per second and the seconds left, over this process's iterations after its first
        (its first alone while there is no other: speed, and no ETA)."""
        now = time.perf_counter()
        clock, at, tokens = self._clock
        if done == at:
            return self._tokens / max(now - self._start, 1e-9), None
        elapsed = max(now - clock, 1e-9)
        return (self._tokens - tokens) / elapsed, elapsed / (done - at) * (total - done)
