"""Turn a config's ``param_scheduler`` into iteration-based schedulers whose
warm-up really warms up, even on a tiny run.

XTuner configs give phases in epochs (``end=warmup_ratio * max_epochs``,
``convert_to_iter_based=True``). mmengine truncates ``end * epoch_length`` to an
int: on a small dataset the warm-up ends after 0 or 1 iteration, mmengine's
``LinearLR`` never gets past ``start_factor`` (it needs ``end - begin >= 2`` to
reach its end factor), and the chained cosine that follows decays from
``lr * 1e-5``: the model never trains. Here every boundary is rounded to the
nearest iteration, a warm-up lasts at least 2 optimizer steps (2 iterations
without gradient accumulation, 2 × ``accumulative_counts`` with it: the LR a step
uses is the one of the iteration it happens on, so a shorter warm-up would be
over before the first step and no step would see a reduced LR; with 2 steps the
first sees about half the peak and the last the peak), and a phase that started
where the warm-up ended still does.

    >>> resolve_param_schedulers([dict(type='LinearLR', start_factor=1e-5, by_epoch=True, begin=0,  # doctest: +NORMALIZE_WHITESPACE
    ...     end=0.09, convert_to_iter_based=True), dict(type='CosineAnnealingLR', by_epoch=True,
    ...     begin=0.09, end=3, convert_to_iter_based=True)], iters_per_epoch=4, max_iters=12)
    [{'type': 'LinearLR', 'start_factor': 1e-05, 'begin': 0, 'end': 2, 'by_epoch': False},
     {'type': 'CosineAnnealingLR', 'begin': 2, 'end': 12, 'by_epoch': False}]
"""
from __future__ import annotations

import copy
import math

from sfttool.registry import type_name

MIN_WARMUP_STEPS = 2  # LinearLR reaches end_factor on its (end - begin - 1)-th iteration


def _to_iters(value, per_epoch: int, by_epoch: bool, max_iters: int) -> int:
    if value is None or (isinstance(value, float) and math.isinf(value)) or value >= 1e9:
        return max_iters
    return min(max_iters, int(round(value * per_epoch if by_epoch else value)))


def _is_warmup(sched: dict) -> bool:
    return type_name(sched.get("type")) in ("LinearLR", "LinearParamScheduler", "LinearMomentum")


def resolve_param_schedulers(schedulers, iters_per_epoch: int, max_iters: int,
                             accumulative_counts: int = 1) -> list[dict] | None:
    """Iteration-based copies of ``schedulers`` (a dict or list of dicts)."""
    if schedulers is None:
        return None
    if isinstance(schedulers, dict):
        schedulers = [schedulers]
    resolved = []
    for sched in schedulers:
        sched = copy.deepcopy(dict(sched))
        by_epoch = sched.pop("by_epoch", True)
        sched.pop("convert_to_iter_based", None)
        sched["begin"] = _to_iters(sched.get("begin", 0), iters_per_epoch, by_epoch, max_iters)
        sched["end"] = _to_iters(sched.get("end"), iters_per_epoch, by_epoch, max_iters)
        sched["by_epoch"] = False
        resolved.append(sched)
    _stretch_warmups(resolved, max_iters, MIN_WARMUP_STEPS * max(1, int(accumulative_counts)))
    return resolved


def _stretch_warmups(schedulers: list[dict], max_iters: int, min_iters: int) -> None:
    for i, sched in enumerate(schedulers):
        if not _is_warmup(sched):
            continue
        old_end = sched["end"]
        new_end = min(max(old_end, sched["begin"] + min_iters), max_iters)
        sched["end"] = new_end
        for later in schedulers[i + 1:]:
            if later["begin"] == old_end or later["begin"] < new_end:
                later["begin"] = new_end
                later["end"] = max(later["end"], new_end + 1)
