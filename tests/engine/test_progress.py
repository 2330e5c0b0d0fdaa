"""ProgressHook and StepLoggerHook: what the terminal and the log show while training. The hooks are
driven as the train loop drives them: the step's values in the message hub and in ``outputs`` at a
step's last micro-batch, empty ``outputs`` at the others; a fake clock times the iterations."""
from __future__ import annotations

import io
from types import SimpleNamespace

import pytest
import torch

from sfttool.engine.hooks import progress_hook
from sfttool.engine.hooks.progress_hook import ProgressHook, format_eta, progress_line


class _Stream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


class _Clock:
    """``perf_counter`` of the hook: the first iteration takes ``first`` seconds, every other one 1 s."""

    def __init__(self, first: float = 1.0):
        self.now, self.first = 0.0, first

    def perf_counter(self) -> float:
        return self.now

    def iteration_done(self, index: int) -> None:
        self.now += self.first if index == 0 else 1.0


def step_loss(step: int) -> float:
    return 2.0 - step / 10


def _progress_run(tty: bool, max_iters: int, interval: int, stop_at: int | None = None, per_step: int = 1,
                  first_seconds: float = 1.0, monkeypatch=None) -> str:
    """A run of ``max_iters`` iterations, ``per_step`` per optimizer step; step ``s`` has loss ``step_loss(s)``."""
    from mmengine.logging import MessageHub

    clock = _Clock(first_seconds)
    monkeypatch.setattr(progress_hook, "time", clock)
    stream = _Stream(tty)
    hook = ProgressHook(interval=interval, stream=stream)
    hub = MessageHub.get_instance(f"progress_{tty}_{max_iters}_{interval}_{stop_at}_{per_step}_{first_seconds}")
    stops = [SimpleNamespace(stop_at=stop_at)] if stop_at else []
    runner = SimpleNamespace(iter=0, max_iters=max_iters, message_hub=hub, hooks=[hook, *stops], model=None,
                             optim_wrapper=SimpleNamespace(_accumulative_counts=per_step))
    hook.before_train(runner)
    end = min(max_iters, stop_at or max_iters)
    for runner.iter in range(end):
        hub.update_scalar("train/lr", 1e-4)  # RuntimeInfoHook, before every iteration
        hook.before_train_iter(runner, runner.iter)
        clock.iteration_done(runner.iter)
        done = runner.iter + 1
        outputs = {}
        if done % per_step == 0 or done == end:
            outputs = {"loss": step_loss(-(-done // per_step))}
            hub.update_scalar("train/loss", outputs["loss"])  # RuntimeInfoHook, from the outputs
        hook.after_train_iter(runner, runner.iter, {"data": {"input_ids": torch.zeros(1, 16)}}, outputs)
    runner.iter += 1  # as the loop leaves it
    hook.after_train(runner)
    return stream.getvalue()


def test_progress_without_a_terminal_is_plain_lines_from_the_first_step(monkeypatch):
    lines = _progress_run(tty=False, max_iters=25, interval=10, monkeypatch=monkeypatch).splitlines()
    assert [line.split(" | ")[:2] for line in lines] == [["iter 1/25   4%", "loss 1.9000"],
                                                          ["iter 10/25  40%", "loss 1.0000"],
                                                          ["iter 20/25  80%", "loss 0.0000"],
                                                          ["iter 25/25 100%", "loss -0.5000"]]
    assert all(" | lr 1.0e-04 | 16 tok/s" in line for line in lines)
    assert "ETA" not in lines[0] and lines[-1].endswith("ETA 0:00:00")


def test_with_accumulation_each_line_is_an_optimizer_step_and_shows_its_loss(monkeypatch):
    """4 iterations per step: nothing inside a step; the first step, the steps holding iteration 10
    and 20, and the last (short) one."""
    lines = _progress_run(tty=False, max_iters=22, interval=10, per_step=4, monkeypatch=monkeypatch).splitlines()
    assert [line.split(" | ")[:3] for line in lines] == [["iter 4/22  18%", "step 1/6", "loss 1.9000"],
                                                          ["iter 12/22  55%", "step 3/6", "loss 1.7000"],
                                                          ["iter 20/22  91%", "step 5/6", "loss 1.5000"],
                                                          ["iter 22/22 100%", "step 6/6", "loss 1.4000"]]


def test_the_eta_leaves_out_the_first_iteration(monkeypatch):
    """The first iteration carries one-time costs (100 s here, 1 s for the others): the ETA comes from the
    iterations after it, so there is none on the first line (it used to say 0:06:40 for a 4-second rest)."""
    lines = _progress_run(tty=False, max_iters=5, interval=1, first_seconds=100.0,
                          monkeypatch=monkeypatch).splitlines()
    assert [line.rsplit(" | ", 1)[-1] for line in lines] == [
        "0 tok/s", "ETA 0:00:03", "ETA 0:00:02", "ETA 0:00:01", "ETA 0:00:00"]
    assert [line.split(" | ")[-2] for line in lines[1:]] == ["16 tok/s"] * 4  # the first iteration left out


def test_progress_on_a_terminal_is_one_bar_redrawn_in_place(monkeypatch):
    out = _progress_run(tty=True, max_iters=4, interval=10, per_step=2, monkeypatch=monkeypatch)
    frames = out.split("\r")[1:]
    assert [frame.split(" | ")[:3] for frame in frames] == [
        ["iter 1/4 [######------------------]  25%", "step 1/2", "lr 1.0e-04"],  # no step has ended yet
        ["iter 2/4 [############------------]  50%", "step 1/2", "loss 1.9000"],
        ["iter 3/4 [##################------]  75%", "step 2/2", "loss 1.9000"],  # the last step's, until its end
        ["iter 4/4 [########################] 100%", "step 2/2", "loss 1.8000"]]
    assert out.endswith("\n") and out.count("\n") == 1


def test_progress_counts_to_where_max_steps_stops_the_run(monkeypatch):
    lines = _progress_run(tty=False, max_iters=100, interval=10, stop_at=4, monkeypatch=monkeypatch).splitlines()
    assert [line.split(" | ")[0] for line in lines] == ["iter 1/4  25%", "iter 4/4 100%"]


def test_progress_line_format():
    assert progress_line(12, 80, 2.31412, 1.2e-4, 312.4, 250, bar=False) == \
        "iter 12/80  15% | loss 2.3141 | lr 1.2e-04 | 312 tok/s | ETA 0:04:10"
    assert progress_line(17, 80, 0.61, None, None, None, bar=False, extra={"margin": 0.4567}, per_step=16) == \
        "iter 17/80  21% | step 2/5 | loss 0.6100 | margin 0.457"
    assert format_eta(4210.2) == "1:10:10"


@pytest.mark.parametrize("tty", [False, True])
def test_each_validation_is_one_line_under_the_progress(tty):
    from mmengine.logging import MessageHub

    stream = _Stream(tty)
    hook = ProgressHook(interval=10, stream=stream)
    runner = SimpleNamespace(iter=10, max_iters=20, message_hub=MessageHub.get_instance(f"val_{tty}"), hooks=[hook])
    hook.after_val_epoch(runner, {"val/loss": 0.56981, "val/ppl": 1.76801})
    hook.after_val_epoch(runner, {"accuracy": 1.0})  # another metric: nothing to say here
    # On a terminal the bar's line is open: the validation starts a new line and the bar redraws below.
    assert stream.getvalue() == ("\n" if tty else "") + "validation at iter 10: val/loss 0.5698 (ppl 1.77)\n"


# -- StepLoggerHook ---------------------------------------------------------------------


def test_the_log_gets_a_line_at_the_steps_that_hold_a_multiple_of_the_interval_and_the_last():
    from sfttool.engine.hooks.step_logger_hook import StepLoggerHook

    hook = StepLoggerHook(interval=10)
    written = []
    runner = SimpleNamespace(iter=0, max_iters=22, hooks=[hook], logger=SimpleNamespace(info=lambda line: None),
                             log_processor=SimpleNamespace(get_log_after_iter=lambda r, i, mode: ({"i": i}, "")),
                             visualizer=SimpleNamespace(add_scalars=lambda tag, step, file_path: written.append(step)))
    hook.before_train(runner)
    for runner.iter in range(22):
        done = runner.iter + 1
        hook.after_train_iter(runner, runner.iter, outputs={"loss": 1.0} if done % 4 == 0 or done == 22 else {})
    assert written == [12, 20, 22]


def test_step_logger_replaces_mmengines_logger_hook_only():
    from mmengine.hooks import LoggerHook

    from sfttool.engine.hooks.step_logger_hook import StepLoggerHook, log_processor_cfg, step_logger

    assert step_logger(dict(type=LoggerHook, interval=5)) == dict(type=StepLoggerHook, interval=5)
    assert step_logger(dict(type="LoggerHook")) == dict(type=StepLoggerHook)
    own = dict(type="my.LoggerHook")
    assert step_logger(own) is own
    assert log_processor_cfg(None) == dict(by_epoch=False, mean_pattern=r".*(time|data_time).*")
    assert log_processor_cfg(dict(by_epoch=False, mean_pattern="x"))["mean_pattern"] == "x"
