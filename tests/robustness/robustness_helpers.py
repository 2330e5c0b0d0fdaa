"""Fault injectors that test configs load by dotted path (``robustness_helpers.X``);
the test puts this folder on the training subprocess's PYTHONPATH.

Each injects one real fault from inside a real run: a real signal, a real
OS write limit, a real NaN in the forward pass, a real exception on one rank.
"""
from __future__ import annotations

import os
import resource
import signal
import time

from mmengine.hooks import Hook


def _now_iter(runner) -> int:
    return runner.iter + 1   # 1-based number of the iteration being run


class SignalAt(Hook):
    """Sends ``signum`` to this process while iteration ``at`` runs (mid-window when
    accumulating), as a scheduler's SIGTERM would arrive."""

    def __init__(self, at: int, signum: str = "SIGTERM"):
        self.at, self.signum = at, getattr(signal, signum)

    def before_train_iter(self, runner, batch_idx, data_batch=None):
        if _now_iter(runner) == self.at:
            os.kill(os.getpid(), self.signum)


class NaNLossAt(Hook):
    """Makes the decoder's hidden states NaN during the given iterations (``from_iter`` on:
    every iteration from there), so the loss is NaN as with a diverging run. The decoder, not
    the whole LLM: the chunked loss runs the decoder and applies the head itself."""

    def __init__(self, iters=(), from_iter: int | None = None):
        self.iters, self.from_iter = set(iters), from_iter
        self.active = False

    def before_train(self, runner):
        from sfttool.engine.runner import unwrap_model

        def poison(module, args, output):
            if self.active:
                output.last_hidden_state = output.last_hidden_state * float("nan")
            return output

        llm = unwrap_model(runner.model).llm
        base = llm.get_base_model() if hasattr(llm, "get_base_model") else llm  # under a peft wrapper
        base.get_decoder().register_forward_hook(poison)

    def before_train_iter(self, runner, batch_idx, data_batch=None):
        it = _now_iter(runner)
        self.active = it in self.iters or (self.from_iter is not None and it >= self.from_iter)


class FileSizeLimitAfter(Hook):
    """After iteration ``after`` (once its checkpoint is written), limit the size of
    any file this process writes to ``limit_bytes``: the next checkpoint write then
    fails in the kernel with EFBIG, like a full disk. SIGXFSZ is ignored so the
    write returns an error instead of killing the process."""

    priority = "LOWEST"   # after the checkpoint hook

    def __init__(self, after: int, limit_bytes: int):
        self.after, self.limit = after, limit_bytes

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
        if _now_iter(runner) == self.after:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
            resource.setrlimit(resource.RLIMIT_FSIZE, (self.limit, hard))


class FailOnRank(Hook):
    """Raises on rank ``rank`` at iteration ``at`` and records when (``fail_time`` file)."""

    def __init__(self, rank: int, at: int, marker: str):
        self.rank, self.at, self.marker = rank, at, marker

    def before_train_iter(self, runner, batch_idx, data_batch=None):
        from mmengine.dist import get_rank

        if get_rank() == self.rank and _now_iter(runner) == self.at:
            with open(self.marker, "w") as f:
                f.write(str(time.time()))
            raise RuntimeError(f"injected failure on rank {self.rank} at iteration {self.at}")


def pause_map_fn(row: dict) -> dict:
    """A dataset map fn that leaves rows as they are, but when
    ``ROBUSTNESS_PAUSE_IN_MAP`` names a file that does not exist yet, creates it
    and sleeps: the test kills the run in the middle of preprocessing."""
    marker = os.environ.get("ROBUSTNESS_PAUSE_IN_MAP")
    if marker and not os.path.exists(marker):
        with open(marker, "w") as f:
            f.write("paused")
        time.sleep(600)
    return row


class PauseAt(Hook):
    """On rank 0, at iteration ``at``: create ``marker`` and sleep ``seconds`` so a test can
    signal the launcher while training is surely in progress."""

    def __init__(self, at: int, marker: str, seconds: float = 5.0):
        self.at, self.marker, self.seconds = at, marker, seconds

    def before_train_iter(self, runner, batch_idx, data_batch=None):
        from mmengine.dist import get_rank

        if get_rank() == 0 and _now_iter(runner) == self.at and not os.path.exists(self.marker):
            with open(self.marker, "w") as f:
                f.write("paused")
            time.sleep(self.seconds)
