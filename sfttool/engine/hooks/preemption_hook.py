"""Survive preemption: on SIGTERM/SIGINT save a checkpoint at the next
optimizer-step boundary, say how to resume, and exit non-zero.

Schedulers (SLURM, Kubernetes, torchrun's agent) send SIGTERM some seconds
before they kill a job. The signal handler only sets a flag; the work
happens in ``after_train_iter`` once the current optimizer step has been
applied, so the checkpoint holds a consistent state and ``--resume``
continues exactly where the run stopped. The exit code is ``128 + signal``
(143 for SIGTERM, 130 for SIGINT), what a shell reports for a job killed by
that signal, so schedulers and scripts still see an interrupted job.

A second SIGINT (Ctrl-C twice) stops at once without saving.

In a multi-process run every rank gets the signal, not necessarily during
the same step; the flag is all-reduced at each step boundary so all ranks
stop, and save, at the same step.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

from mmengine.hooks import CheckpointHook, Hook
from mmengine.logging import print_log

from sfttool.engine.collective import any_rank
from sfttool.registry import BUILDER
from sfttool.utils.atomic import atomic_write_text, publish, reported_save

SAME_SIGNAL_WINDOW_S = 2.0


class TrainingPreempted(SystemExit):
    """Raised after the preemption checkpoint is saved; exits with ``128 + signal``.

    A ``SystemExit`` so that no ``except Exception`` on the way up mistakes it
    for a crash, and the process exit code is the one chosen here.
    """


def at_step_boundary(runner) -> bool:
    """True right after an iteration whose optimizer step was applied
    (the last micro-batch of an accumulation window)."""
    wrapper = runner.optim_wrapper
    if hasattr(wrapper, "should_update"):  # mmengine OptimWrapper: checked after its update_params
        return bool(wrapper.should_update())
    gas = getattr(getattr(runner.model, "model", None), "gradient_accumulation_steps", None)
    if callable(gas):  # DeepSpeed engine
        done = runner.iter + 1
        return done % int(gas()) == 0 or done == runner.max_iters
    return True


@BUILDER.register_module()
class PreemptionHook(Hook):
    """Turn SIGTERM/SIGINT into "checkpoint at the next step boundary, then exit".

    The train entry adds it to every run; list it in ``custom_hooks`` only to
    change ``signals``.

    >>> custom_hooks = [dict(type=PreemptionHook, signals=('SIGTERM', 'SIGUSR1'))]
    """

    # After the checkpoint hook (VERY_LOW): a step that is saved anyway is not saved twice.
    priority = "LOWEST"

    def __init__(self, signals=("SIGTERM", "SIGINT")) -> None:
        self.signals = [getattr(signal, s) if isinstance(s, str) else signal.Signals(s) for s in signals]
        self.received: int | None = None
        self._received_at = 0.0
        self._previous: dict = {}

    # -- signal handling: only set a flag, nothing else is safe in a handler
    def _handle(self, signum, frame) -> None:
        now = time.monotonic()
        if self.received == signal.SIGINT and signum == signal.SIGINT:
            # Ctrl-C again: the user does not want to wait. A copy within a second or two is the
            # same Ctrl-C (the terminal signals every process, and torchrun forwards it too).
            if now - self._received_at > SAME_SIGNAL_WINDOW_S:
                raise KeyboardInterrupt
            return
        if self.received is not None:
            return
        self.received, self._received_at = signum, now
        # os.write, not print: a handler may interrupt a print already in progress.
        os.write(2, f"[sfttool] received {signal.Signals(signum).name}: saving a checkpoint at the end of "
                    f"the current optimizer step, then stopping\n".encode())

    def before_train(self, runner) -> None:
        if self._previous:
            return
        try:
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        except ValueError:  # not the main thread: signals cannot be caught here
            print_log("PreemptionHook: not in the main thread; SIGTERM will not save a checkpoint",
                      logger="current", level=30)

    def after_train(self, runner) -> None:
        self._restore()

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            # None: the old handler was not set from Python; the default is the closest we can restore.
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}

    # -- the work, at a step boundary
    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None) -> None:
        if not self._previous or not at_step_boundary(runner):
            return
        if not any_rank(self.received is not None):
            return
        signum = self.received if self.received is not None else signal.SIGTERM  # another rank's signal
        path = save_checkpoint_now(runner)
        self._restore()
        from mmengine.dist import is_main_process

        if is_main_process():  # to the console and the run's log file
            print_log(self._resume_message(runner, signum, path), logger="current", level=30)
        raise TrainingPreempted(128 + int(signum))

    @staticmethod
    def _resume_message(runner, signum: int, path: Path) -> str:
        config = getattr(getattr(runner, "cfg", None), "filename", None) or "<config>"
        return (f"stopped by {signal.Signals(signum).name} after iteration {runner.iter + 1} of "
                f"{runner.max_iters}; checkpoint saved to {path}. Resume with:\n"
                f"    sfttool train {config} --work-dir {runner.work_dir} --resume\n"
                f"(exit code {128 + int(signum)})")


def save_checkpoint_now(runner) -> Path:
    """A checkpoint of the state after this iteration (an optimizer-step boundary), written by the
    run's checkpoint hook (atomic, keep-last-K, ``last_checkpoint`` pointer) unless that hook saved this
    step already; returns its path. Used when a run stops early: a signal, ``--max-steps``."""
    step = runner.iter + 1
    hooks = [h for h in runner.hooks if isinstance(h, CheckpointHook) and not h.by_epoch]
    if hooks:
        hook = hooks[0]
        last = getattr(hook, "last_ckpt", None)
        if not (last and Path(last).name == hook.filename_tmpl.format(step)):
            hook._save_checkpoint(runner)
        return Path(hook.last_ckpt)
    return _save_without_checkpoint_hook(runner, step)


def _save_without_checkpoint_hook(runner, step: int) -> Path:
    from mmengine.dist import barrier, is_main_process

    name = f"iter_{step}.pth"
    final = Path(runner.work_dir) / name
    with reported_save(final, final.with_name(name + ".tmp")):
        runner.save_checkpoint(runner.work_dir, name + ".tmp", meta=dict(epoch=runner.epoch, iter=step))
        barrier()
        if is_main_process():
            publish(final.with_name(name + ".tmp"), final)
            atomic_write_text(Path(runner.work_dir) / "last_checkpoint", str(final))
    barrier()
    return final


@contextlib.contextmanager
def signal_handlers_restored(signals=(signal.SIGTERM, signal.SIGINT)):
    """Put the process's signal handlers back however training ends: a run that
    raises never reaches ``after_train``, and a library caller (a notebook, a
    test) must get its Ctrl-C back."""
    previous = {sig: signal.getsignal(sig) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            if handler is not None:
                signal.signal(sig, handler)


def run_forwarding_sigterm(cmd: list[str], env: dict) -> int:
    """Run a launcher (torchrun) and wait for it. A SIGTERM sent to this process
    is passed on once (torchrun forwards it to the workers, which save and exit);
    SIGINT from a terminal already reaches every process, so it is not repeated.
    Returns ``128 + signal`` when this process was signalled, else the child's code."""
    proc = subprocess.Popen(cmd, env=env)
    got: list[int] = []

    def forward(signum, frame) -> None:
        if not got:
            got.append(signum)
            if signum == signal.SIGTERM:
                proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 + got[0] if got else code
