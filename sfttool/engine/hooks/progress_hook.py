"""Live progress on rank 0, from the first iteration: a bar on a terminal,
plain lines otherwise (a log file, a CI job, a pipe).

    iter 12/80 [######------------------]  15% | loss 2.3141 | lr 1.2e-04 | 312 tok/s | ETA 0:04:10

On a terminal the bar is redrawn in place after every iteration; elsewhere a
line is printed for the first iteration, every ``interval`` iterations (the
logger's) and the last. Speed and ETA count only this process's iterations:
after ``--resume`` the time before the interruption is not averaged in.
"""
from __future__ import annotations

import sys
import time

from mmengine.hooks import Hook

from sfttool.registry import BUILDER

BAR_WIDTH = 24


def format_eta(seconds: float) -> str:
    """``4210.2`` -> ``'1:10:10'``."""
    seconds = int(round(max(seconds, 0)))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


# Preference training's figure of progress, shown beside the loss: the reward margin (chosen minus
# rejected), averaged over the last iterations (one iteration's pairs are too few to read). Online RL's
# (GRPO): the step's mean reward, KL, mean completion length and fraction of clipped tokens, logged once
# per optimizer step.
SHOWN_SCALARS = (("margin", "train/rewards/margins"), ("reward", "train/reward"), ("kl", "train/kl"),
                 ("len", "train/completions/mean_length"), ("clip", "train/clip_ratio/region_mean"))
SHOWN_WINDOW = 10


def progress_line(done: int, total: int, loss: float | None, lr: float | None, tokens_per_s: float,
                  eta_s: float | None, bar: bool, extra: dict | None = None) -> str:
    """One progress report; ``extra`` adds named values after the loss.

    >>> progress_line(12, 80, 2.31412, 1.2e-4, 312.4, 250, bar=False)
    'iter 12/80  15% | loss 2.3141 | lr 1.2e-04 | 312 tok/s | ETA 0:04:10'
    >>> progress_line(12, 80, 0.61, 1.2e-4, 312.4, 250, bar=False, extra={'margin': 0.4567})
    'iter 12/80  15% | loss 0.6100 | margin 0.457 | lr 1.2e-04 | 312 tok/s | ETA 0:04:10'
    """
    fraction = done / total if total else 1.0
    shown = f"[{'#' * round(BAR_WIDTH * fraction):-<{BAR_WIDTH}}] " if bar else ""
    parts = [f"iter {done}/{total} {shown}{fraction:4.0%}"]
    if loss is not None:
        parts.append(f"loss {loss:.4f}")
    parts += [f"{name} {value:.3f}" for name, value in (extra or {}).items()]
    if lr is not None:
        parts.append(f"lr {lr:.1e}")
    parts.append(f"{tokens_per_s:.0f} tok/s")
    if eta_s is not None:
        parts.append(f"ETA {format_eta(eta_s)}")
    return " | ".join(parts)


def validation_line(step: int, metrics: dict) -> str:
    """``validation at iter 20: val/loss 0.5698 (ppl 1.77)``."""
    line = f"validation at iter {step}: val/loss {metrics['val/loss']:.4f}"
    return line + (f" (ppl {metrics['val/ppl']:.2f})" if "val/ppl" in metrics else "")


def planned_end(runner) -> int:
    """The iteration this run ends after: the loop's end, or where ``--max-steps`` stops it."""
    stops = [h.stop_at for h in runner.hooks if getattr(h, "stop_at", None) is not None]
    return min([runner.max_iters, *stops])


@BUILDER.register_module()
class ProgressHook(Hook):
    """The train entry adds it to every run; ``interval`` is the plain-line interval."""

    priority = "LOW"  # after RuntimeInfoHook (VERY_HIGH) has put this iteration's loss and lr in the hub

    def __init__(self, interval: int = 10, stream=None) -> None:
        self.interval = max(int(interval), 1)
        self.stream = stream
        self._start: float | None = None
        self._first_iter = 0
        self._tokens = 0

    def _out(self):
        return self.stream or sys.stdout

    def before_train(self, runner) -> None:
        self._start, self._first_iter, self._tokens = None, runner.iter, 0

    def before_train_iter(self, runner, batch_idx, data_batch=None) -> None:
        if self._start is None:  # the first iteration of this process: after a resume's data skip
            self._start = time.perf_counter()

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None) -> None:
        from mmengine.dist import is_main_process

        if data_batch and "input_ids" in data_batch.get("data", {}):
            self._tokens += data_batch["data"]["input_ids"].numel()
        if not is_main_process() or self._start is None:
            return
        done, total = runner.iter + 1, planned_end(runner)
        tty = self._out().isatty()
        if not tty and not (done - self._first_iter == 1 or done % self.interval == 0 or done >= total):
            return
        line = self._line(runner, done, total, bar=tty)
        self._out().write(("\r" + line + ("\n" if done >= total else "")) if tty else line + "\n")
        self._out().flush()

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
        elapsed = max(time.perf_counter() - self._start, 1e-9)
        iterations = done - self._first_iter
        scalars = runner.message_hub.log_scalars
        loss, lr = scalars.get("train/loss"), scalars.get("train/lr")
        extra = {name: float(scalars[key].mean(SHOWN_WINDOW)) for name, key in SHOWN_SCALARS if key in scalars}
        return progress_line(done, total, loss.current() if loss is not None else None,
                             lr.current() if lr is not None else None, self._tokens / elapsed,
                             elapsed / iterations * (total - done), bar, extra)
