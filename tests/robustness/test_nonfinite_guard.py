"""The non-finite guard on mmengine's plain OptimWrapper: skip, count, stop."""
from __future__ import annotations

import math

import pytest
import torch
from mmengine.optim import OptimWrapper, build_optim_wrapper

from sfttool.engine.nonfinite import (NonFiniteGuardOptimWrapper, NonFiniteLossError, guard_optim_wrapper_cfg,
                                      guarded_class)


def _model() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 1)


def _loss(model, bad: bool = False) -> torch.Tensor:
    x = torch.ones(2, 3)
    if bad:
        x[0, 0] = float("nan")
    return model(x).pow(2).mean()


def _wrapper(model, limit=3, accum=1) -> NonFiniteGuardOptimWrapper:
    cfg = guard_optim_wrapper_cfg(dict(type="OptimWrapper", optimizer=dict(type="SGD", lr=0.1),
                                       accumulative_counts=accum, max_consecutive_nonfinite=limit))
    return build_optim_wrapper(model, cfg)


def _weights(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_config_swaps_in_the_guarded_wrapper():
    cfg = guard_optim_wrapper_cfg(dict(optimizer=dict(type="SGD", lr=0.1)))
    assert cfg["type"] is NonFiniteGuardOptimWrapper and cfg["max_consecutive_nonfinite"] == 5
    assert guard_optim_wrapper_cfg(dict(type=OptimWrapper, optimizer={}, max_consecutive_nonfinite=None)) == \
        dict(type=OptimWrapper, optimizer={})
    with pytest.raises(ValueError, match="max_consecutive_nonfinite must be a positive integer"):
        guard_optim_wrapper_cfg(dict(optimizer={}, max_consecutive_nonfinite=-2))


def test_guarded_class_is_made_once_per_base_and_keeps_its_base():
    class MyWrapper(OptimWrapper):
        pass

    guarded = guarded_class(MyWrapper)
    assert guarded is guarded_class(MyWrapper) and guarded_class(guarded) is guarded
    assert issubclass(guarded, MyWrapper) and guarded_class(OptimWrapper) is NonFiniteGuardOptimWrapper


def test_nan_loss_skips_the_step_and_counts():
    model = _model()
    wrapper = _wrapper(model)
    before = _weights(model)
    wrapper.update_params(_loss(model, bad=True))
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(model)))
    assert all(p.grad is None for p in model.parameters())
    assert (wrapper.nonfinite_streak, wrapper.nonfinite_skipped) == (1, 1)
    assert wrapper.message_hub.get_scalar("train/nonfinite_steps").current() == 1

    wrapper.update_params(_loss(model))      # a finite step trains and resets the streak
    assert not torch.equal(before[0], _weights(model)[0])
    assert (wrapper.nonfinite_streak, wrapper.nonfinite_skipped) == (0, 1)


def test_stops_after_n_consecutive_nonfinite_steps():
    model = _model()
    wrapper = _wrapper(model, limit=3)
    wrapper.update_params(_loss(model, bad=True))
    wrapper.update_params(_loss(model, bad=True))
    wrapper.update_params(_loss(model))
    wrapper.update_params(_loss(model, bad=True))
    wrapper.update_params(_loss(model, bad=True))
    with pytest.raises(NonFiniteLossError, match=r"3 optimizer steps in a row had a non-finite \(NaN/inf\) loss"):
        wrapper.update_params(_loss(model, bad=True))
    assert wrapper.nonfinite_skipped == 5


def test_one_bad_micro_batch_poisons_its_accumulation_window_only():
    model = _model()
    wrapper = _wrapper(model, accum=2)
    before = _weights(model)
    wrapper.update_params(_loss(model))
    wrapper.update_params(_loss(model, bad=True))   # window 1: good + bad -> skipped
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(model)))
    wrapper.update_params(_loss(model))
    wrapper.update_params(_loss(model))             # window 2: both good -> applied
    assert not torch.equal(before[0], _weights(model)[0])
    assert all(math.isfinite(v) for p in model.parameters() for v in p.detach().flatten().tolist())
    assert (wrapper.nonfinite_streak, wrapper.nonfinite_skipped) == (0, 1)


def test_infinite_gradient_with_a_finite_loss_is_caught():
    model = _model()
    wrapper = _wrapper(model)
    model.weight.register_hook(lambda g: torch.full_like(g, float("inf")))
    before = _weights(model)
    wrapper.update_params(_loss(model))
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(model)))
    assert wrapper.nonfinite_skipped == 1


def test_guard_off_trains_on_nan_like_the_plain_wrapper():
    model = _model()
    wrapper = build_optim_wrapper(model, guard_optim_wrapper_cfg(
        dict(optimizer=dict(type="SGD", lr=0.1), max_consecutive_nonfinite=0)))
    assert type(wrapper) is OptimWrapper
    wrapper.update_params(_loss(model, bad=True))
    assert math.isnan(model.weight.detach()[0, 0].item())
