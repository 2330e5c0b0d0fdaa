"""Step metrics: the values a run shows for each optimizer step (the loss, DPO's reward margin,
a reward model's accuracy, an RL run's rewards and KL...), exact whatever the micro-batch split.

A micro-batch's backward loss is its share of the step's loss (see ``sfttool.engine.runner``),
not a loss one can read. So a model also returns, for each value it wants shown, its
micro-batch's *sum* and *count*, under ``STEP_METRICS`` in the dict ``compute_loss`` returns:

    return {"loss": total / normalizer,                            # what backward uses
            **step_metrics(loss=(total, trained_tokens),           # sum of token losses, tokens
                           **{"rewards/margins": (margins.sum(), pairs)})}

The train loop (``TrainLoop``) adds sums and counts over the step's micro-batches, all-reduces
both over the processes, and shows ``sum / count`` per name once per optimizer step: the value
one batch holding all of the step's micro-batches, on every process, would give. A model names
the same values in every micro-batch (the reduction is one collective over a fixed list).

``count`` is in whatever unit the value is a mean over: trained tokens (or samples) for an SFT
loss, pairs for preference metrics, completions or tokens for RL metrics. Under sequence
parallelism the ``sp`` processes of a group share rows: each returns ``1/sp`` of the rows' sum and
count, so the rows count once in the step.

A value a model returns outside ``STEP_METRICS`` (a model that does not follow this contract)
is shown as the mean of its micro-batches' values.
"""
from __future__ import annotations

from typing import Any, Union

import torch
from mmengine.dist import all_reduce

STEP_METRICS = "step_metrics"

Number = Union[torch.Tensor, int, float]


def step_metrics(**metrics: tuple[Number, Number]) -> dict:
    """``{STEP_METRICS: {name: (sum, count)}}`` for ``compute_loss``'s dict, sums detached.

    >>> step_metrics(loss=(torch.tensor(6.0), 4))[STEP_METRICS]['loss']
    (tensor(6.), 4)
    """
    return {STEP_METRICS: {name: (_detached(total), _detached(count)) for name, (total, count) in metrics.items()}}


def _detached(value: Number) -> Number:
    return value.detach() if isinstance(value, torch.Tensor) else value


def step_means(outputs: dict) -> dict[str, float]:
    """The step metrics of one ``compute_loss`` output as means (``sum / count``): what a step made of
    that one micro-batch shows.

    >>> step_means(step_metrics(loss=(torch.tensor(6.0), 4)))
    {'loss': 1.5}
    """
    return {name: float(total) / float(count) for name, (total, count) in outputs[STEP_METRICS].items()}


def split_step_metrics(losses: dict) -> tuple[dict, dict | None]:
    """``(losses without STEP_METRICS, the step metrics or None)``: mmengine's ``parse_losses``
    takes tensors only."""
    if STEP_METRICS not in losses:
        return losses, None
    rest = dict(losses)
    return rest, rest.pop(STEP_METRICS)


class StepAccumulator:
    """Sums and counts of the current optimizer step's micro-batches; ``reduce`` gives the step's
    values and starts the next step.

    >>> acc = StepAccumulator()
    >>> acc.add({"loss": torch.tensor(9.0), STEP_METRICS: {"loss": (torch.tensor(6.0), 4)}})
    >>> acc.add({"loss": torch.tensor(1.0), STEP_METRICS: {"loss": (torch.tensor(1.0), 1)}})
    >>> acc.reduce()   # one process: (6 + 1) / (4 + 1)
    {'loss': 1.4}
    """

    def __init__(self) -> None:
        self._sums: dict[str, Any] = {}
        self._counts: dict[str, Any] = {}

    def add(self, log_vars: dict) -> None:
        """One micro-batch's ``train_step`` output: its step metrics, and any other value (count 1)."""
        plain, metrics = split_step_metrics(log_vars)
        metrics = dict(metrics or {})
        for name, value in plain.items():
            metrics.setdefault(name, (value, 1))
        for name, (total, count) in metrics.items():
            self._sums[name] = self._sums.get(name, 0.0) + _float64(total)
            self._counts[name] = self._counts.get(name, 0.0) + _float64(count)

    def reduce(self) -> dict[str, float]:
        """``{name: sum / count}`` over the step's micro-batches and every process (one all-reduce;
        every process calls it at the same step); NaN for a count of 0."""
        names = sorted(self._sums)
        if not names:
            return {}
        device = next((v.device for v in self._sums.values() if isinstance(v, torch.Tensor)), torch.device("cpu"))
        table = torch.stack([torch.stack([_float64_on(self._sums[n], device), _float64_on(self._counts[n], device)])
                             for n in names])  # [names, 2]: sum, count
        all_reduce(table, op="sum")
        self._sums, self._counts = {}, {}
        return {name: (total / count if count else float("nan")) for name, (total, count) in zip(names, table.tolist())}


def _float64(value: Number) -> Number:
    """A micro-batch's sum or count, kept on its device (no synchronisation per micro-batch)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(torch.float64).sum()
    return float(value)


def _float64_on(value: Number, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(value, dtype=torch.float64, device=device)
