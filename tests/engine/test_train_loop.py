"""TrainLoop: step windows, the look-ahead loss normaliser, data position."""
from __future__ import annotations

import os

import pytest
import torch
from mmengine.optim import OptimWrapper
from safetensors.torch import load_file

from sfttool.engine.runner import _ResumableBatches, optimizer_step_window


def wrapper(accum: int) -> OptimWrapper:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    return OptimWrapper(opt, accumulative_counts=accum)


@pytest.mark.parametrize("it, expected", [
    (0, (4, 4)), (1, (3, 4)), (4, (4, 4)), (8, (2, 2)), (9, (1, 2)),  # 10 iters: windows 4, 4, 2
])
def test_step_windows_match_the_optim_wrapper(it, expected):
    assert optimizer_step_window(wrapper(4), None, it, max_iters=10) == expected


def test_no_accumulation():
    assert optimizer_step_window(wrapper(1), None, 7, max_iters=10) == (1, 1)


class _EpochSampler(torch.utils.data.Sampler):
    """Shuffles with seed + epoch, like mmengine's DefaultSampler."""

    def __init__(self, n):
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator().manual_seed(100 + self.epoch)
        return iter(torch.randperm(self.n, generator=g).tolist())

    def __len__(self):
        return self.n


def test_resumable_batches_start_anywhere():
    data = list(range(10))
    loader = torch.utils.data.DataLoader(data, batch_size=3, sampler=_EpochSampler(10))  # 4 batches per epoch
    full = _ResumableBatches(loader, 0)
    reference = [next(full).tolist() for _ in range(11)]
    for start in (0, 2, 4, 5, 9):
        resumed = _ResumableBatches(loader, start)
        assert [next(resumed).tolist() for _ in range(11 - start)] == reference[start:]
    assert sorted(sum(reference[:4], [])) == data  # one epoch covers every row once


@pytest.mark.slow
def test_accumulation_split_gives_the_same_step(tmp_path, tiny_config):
    """micro-batch 1 x accumulation 4 == micro-batch 4 x accumulation 1 (one SGD step, LoRA)."""
    from sfttool.engine.train import train

    sgd = dict(_delete_=True, type="torch.optim.SGD", lr=1.0)  # linear in the gradient, unlike Adam
    common = {"optim_wrapper.optimizer": sgd, "optim_wrapper.clip_grad": None,
              "param_scheduler": None}
    outs = {}
    for name, bs, accum in (("split", 1, 4), ("whole", 4, 1)):
        cfg = tiny_config(f"{name}.py", batch_size=bs, accumulative_counts=accum, dropout=0.0, save_steps=100)
        opts = dict(common, **{"train_cfg.max_iters": 4 // bs, "train_cfg.max_epochs": None})
        outs[name] = load_file(train(str(cfg), work_dir=str(tmp_path / name), cfg_options=opts)
                               / "hf_adapter" / "adapter_model.safetensors")
    split, whole = outs["split"], outs["whole"]
    moved = [k for k in split if "lora_B" in k and split[k].abs().sum() > 0]
    assert moved, "the step changed nothing"
    for k in split:
        torch.testing.assert_close(split[k], whole[k], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_deepspeed_applies_the_last_short_accumulation_window(tmp_path, tiny_config):
    """5 micro-batches with accumulation 2: the 5th is a window of one. Plain
    training steps on it; DeepSpeed's own counter would not, so the loop marks it."""
    from safetensors.torch import load_file

    from sfttool.engine.train import train

    cfg = tiny_config(accumulative_counts=2, dropout=0.0)

    def adapter(name, iters, deepspeed=None):
        options = {"train_cfg.max_iters": iters, "train_cfg.max_epochs": None}
        work = train(str(cfg), work_dir=str(tmp_path / name), deepspeed=deepspeed, cfg_options=options)
        return load_file(work / "hf_adapter" / "adapter_model.safetensors")

    plain, ds, ds_four = adapter("plain", 5), adapter("ds", 5, "zero2"), adapter("ds4", 4, "zero2")
    assert all(torch.allclose(plain[k], ds[k], atol=1e-6, rtol=1e-5) for k in plain)
    assert not all(torch.equal(ds[k], ds_four[k]) for k in ds)  # the fifth micro-batch did move the weights


def test_a_run_started_in_the_same_second_gets_its_own_folder(tmp_path, monkeypatch):
    """mmengine names a run's folder after the second it started in; a resumed run started in that
    second appended to the earlier run's log and scalars. Both runners here start at the same instant."""
    import time
    import types

    from mmengine.model import BaseModel
    from mmengine.runner import Runner

    from sfttool import compat

    compat.apply_training()
    frozen = types.SimpleNamespace(time=lambda: 1_790_000_000.0, localtime=time.localtime, strftime=time.strftime)
    monkeypatch.setattr("mmengine.runner.runner.time", frozen)

    class Nothing(BaseModel):
        def forward(self, *args, **kwargs):
            return {}

    folders = [Runner(model=Nothing(), work_dir=str(tmp_path), experiment_name=f"same_second_{i}").log_dir
               for i in range(3)]
    stamp = time.strftime("%Y%m%d_%H%M%S", time.localtime(1_790_000_000.0))
    assert [os.path.basename(f) for f in folders] == [stamp, f"{stamp}_2", f"{stamp}_3"]
    assert sorted(folders) == folders  # the newest is still the last by name
