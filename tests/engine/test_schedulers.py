"""Warm-up that warms up on tiny runs (XTuner's lr-stuck-at-1e-5 bug)."""
from __future__ import annotations

import pytest
import torch
from mmengine.optim import CosineAnnealingLR, LinearLR

from sfttool.engine.schedulers import resolve_param_schedulers

XTUNER_STYLE = [
    dict(type=LinearLR, start_factor=1e-5, by_epoch=True, begin=0, end=0.03 * 3, convert_to_iter_based=True),
    dict(type=CosineAnnealingLR, eta_min=0.0, by_epoch=True, begin=0.03 * 3, end=3, convert_to_iter_based=True),
]


def lr_trace(schedulers: list[dict], max_iters: int, lr: float = 1.0) -> list[float]:
    """The lr each iteration trains with, stepping schedulers as ParamSchedulerHook does."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    built = [dict(s)["type"](opt, **{k: v for k, v in s.items() if k != "type"}) for s in schedulers]
    trace = []
    for _ in range(max_iters):
        trace.append(opt.param_groups[0]["lr"])
        for s in built:
            s.step()
    return trace


@pytest.mark.parametrize("iters_per_epoch", [1, 2, 4, 10, 40])
def test_tiny_runs_reach_the_peak(iters_per_epoch):
    max_iters = 3 * iters_per_epoch
    resolved = resolve_param_schedulers(XTUNER_STYLE, iters_per_epoch, max_iters)
    warmup, cosine = resolved
    assert warmup["end"] >= 2 and cosine["begin"] == warmup["end"]
    trace = lr_trace(resolved, max_iters)
    assert trace[0] == pytest.approx(1e-5)
    assert max(trace) == pytest.approx(1.0)                     # the peak is reached...
    assert trace[warmup["end"] - 1] == pytest.approx(1.0)       # ...on the warm-up's last iteration
    assert all(a >= b - 1e-12 for a, b in zip(trace[warmup["end"]:], trace[warmup["end"] + 1:]))  # then decays


def test_rounding_is_to_nearest_iteration():
    resolved = resolve_param_schedulers(XTUNER_STYLE, iters_per_epoch=100, max_iters=300)
    assert [(s["begin"], s["end"]) for s in resolved] == [(0, 9), (9, 300)]
    assert all(s["by_epoch"] is False and "convert_to_iter_based" not in s for s in resolved)


def test_iteration_based_configs_and_single_scheduler():
    resolved = resolve_param_schedulers(dict(type="LinearLR", by_epoch=False, begin=0, end=0.4), 10, 50)
    assert resolved == [dict(type="LinearLR", by_epoch=False, begin=0, end=2)]
    assert resolve_param_schedulers(None, 10, 50) is None


@pytest.mark.parametrize("accumulation", [2, 16])
def test_with_accumulation_the_warm_up_spans_two_optimizer_steps(accumulation):
    """An optimizer step uses the lr of the iteration it happens on (the last of its window): the first
    step sees a reduced lr and the second the peak, even on a run whose 3 % warm-up is under one step."""
    max_iters = 10 * accumulation
    resolved = resolve_param_schedulers(XTUNER_STYLE, iters_per_epoch=max_iters // 3, max_iters=max_iters,
                                        accumulative_counts=accumulation)
    assert resolved[0]["end"] == 2 * accumulation == resolved[1]["begin"]
    trace = lr_trace(resolved, max_iters)
    step_lrs = trace[accumulation - 1::accumulation]  # the lr of each optimizer step
    assert 0.3 < step_lrs[0] < 0.7 and step_lrs[1] == pytest.approx(1.0)
    assert all(a >= b - 1e-12 for a, b in zip(step_lrs[1:], step_lrs[2:]))
