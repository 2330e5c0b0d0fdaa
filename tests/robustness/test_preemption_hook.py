"""PreemptionHook on a bare mmengine Runner: SIGTERM mid-window -> checkpoint at
the step boundary, exit code 143, and a resume that equals an uninterrupted run.
(The end-to-end version through `sfttool train` is in test_faults_e2e.py.)"""
from __future__ import annotations

import os
import signal

import pytest
import torch
from mmengine.hooks import Hook
from mmengine.model import BaseModel
from mmengine.runner import Runner

from sfttool import compat
from sfttool.engine.hooks.preemption_hook import PreemptionHook, TrainingPreempted, signal_handlers_restored


@pytest.fixture(autouse=True)
def _checkpoint_allow_list():
    compat.allow_mmengine_checkpoint_globals()   # resume loads with weights_only=True
    compat.patch_history_buffer_pickling()


class ToyModel(BaseModel):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x, y, mode="loss"):
        return {"loss": (self.linear(x) - y).pow(2).mean()}


class ToyData(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return {"x": torch.randn(4, generator=g), "y": torch.randn(1, generator=g)}


class SignalAt(Hook):
    """Sends a signal to this process in the middle of iteration `at`."""

    def __init__(self, at: int, signum=signal.SIGTERM):
        self.at, self.signum = at, signum

    def before_train_iter(self, runner, batch_idx, data_batch=None):
        if runner.iter + 1 == self.at:
            os.kill(os.getpid(), self.signum)


def _runner(work_dir, name, hooks=(), resume=False) -> Runner:
    return Runner(
        model=ToyModel(), work_dir=str(work_dir), experiment_name=name,
        train_dataloader=dict(dataset=ToyData(), batch_size=2, num_workers=0,
                              sampler=dict(type="DefaultSampler", shuffle=True, seed=0),
                              collate_fn=dict(type="default_collate")),
        optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.05), accumulative_counts=2),
        train_cfg=dict(by_epoch=False, max_iters=12),
        default_hooks=dict(checkpoint=dict(type="CheckpointHook", interval=100, by_epoch=False),
                           logger=dict(type="LoggerHook", interval=100)),
        custom_hooks=[PreemptionHook(), *hooks], resume=resume, randomness=dict(seed=0),
        default_scope="mmengine")


def _weights(runner) -> list[torch.Tensor]:
    return [p.detach().clone() for p in runner.model.parameters()]


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_saves_at_the_step_boundary_and_resume_is_exact(tmp_path, signum, code, capfd):
    reference = _runner(tmp_path / "ref", f"ref{code}")
    reference.train()
    expected = _weights(reference)

    work = tmp_path / "run"
    previous = signal.getsignal(signum)
    with pytest.raises(TrainingPreempted) as info:
        _runner(work, f"cut{code}", hooks=[SignalAt(5, signum)]).train()   # mid-window (accumulation 2)
    assert info.value.code == code
    assert signal.getsignal(signum) is previous          # handlers restored
    assert sorted(p.name for p in work.glob("iter_*.pth")) == ["iter_6.pth"]   # the next boundary
    out, err = capfd.readouterr()
    assert f"received {signal.Signals(signum).name}: saving a checkpoint" in err
    assert f"stopped by {signal.Signals(signum).name} after iteration 6 of 12" in out + err
    assert f"--work-dir {work} --resume" in out + err

    resumed = _runner(work, f"resume{code}", resume=True)
    resumed.train()
    assert resumed.iter == 12
    for a, b in zip(expected, _weights(resumed)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_no_signal_changes_nothing(tmp_path):
    runner = _runner(tmp_path, "plain")
    runner.train()
    assert sorted(p.name for p in tmp_path.glob("iter_*.pth")) == ["iter_12.pth"]


class RaiseAt(Hook):
    def before_train_iter(self, runner, batch_idx, data_batch=None):
        if runner.iter + 1 == 3:
            raise RuntimeError("boom")


def test_handlers_come_back_when_training_fails(tmp_path):
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with pytest.raises(RuntimeError, match="boom"):
        with signal_handlers_restored():     # what the train entry wraps runner.train() in
            _runner(tmp_path, "boom", hooks=[RaiseAt()]).train()
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
