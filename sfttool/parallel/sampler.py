"""``SequenceParallelSampler``: mmengine's ``DefaultSampler`` over data-parallel ranks, so the ranks of
one sequence-parallel group read the same rows (each then keeps its slice of them); and
``train_sampler``, the training sampler as a run builds it."""
from __future__ import annotations

import math
from typing import Any, Sized

from mmengine.dataset import DefaultSampler
from mmengine.registry import DATA_SAMPLERS

from sfttool.parallel.groups import (get_data_parallel_rank, get_data_parallel_world_size,
                                     get_sequence_parallel_world_size)
from sfttool.registry import resolve_type


class SequenceParallelSampler(DefaultSampler):
    """XTuner 0.2's sampler: ``dict(type=SequenceParallelSampler, seed=None, shuffle=True)``. The order is
    ``DefaultSampler``'s (the same seed gives the same order), shared out over data-parallel ranks."""

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int | None = None, round_up: bool = True):
        super().__init__(dataset, shuffle=shuffle, seed=seed, round_up=round_up)
        self.rank, self.world_size = get_data_parallel_rank(), get_data_parallel_world_size()
        if round_up:
            self.num_samples = math.ceil(len(dataset) / self.world_size)
            self.total_size = self.num_samples * self.world_size
        else:
            self.num_samples = math.ceil((len(dataset) - self.rank) / self.world_size)
            self.total_size = len(dataset)


def sampler_class(kind: Any) -> Any:
    """A sampler ``type``: a class, a dotted path, or a name in mmengine's sampler registry."""
    if isinstance(kind, str):
        return resolve_type(kind, "train_dataloader.sampler.type") if "." in kind else DATA_SAMPLERS.get(kind)
    return kind


def shares_rows_by_group(kind: Any) -> bool:
    """Whether a sampler of this ``type`` gives the ranks of a sequence-parallel group the same rows
    (``SequenceParallelSampler``, or ``DefaultSampler``, which ``train_sampler`` replaces by it)."""
    found = sampler_class(kind)
    return isinstance(found, type) and issubclass(found, (SequenceParallelSampler, DefaultSampler))


def train_sampler(sampler: Any) -> Any:
    """``train_dataloader.sampler`` as the run builds it: under sequence parallelism mmengine's
    ``DefaultSampler``, which shares rows out by process, becomes ``SequenceParallelSampler`` with the
    same arguments, so a config keeps one sampler line whatever ``sequence_parallel_size`` is."""
    if get_sequence_parallel_world_size() == 1 or not isinstance(sampler, dict):
        return sampler
    return dict(sampler, type=SequenceParallelSampler) if sampler_class(sampler.get("type")) is DefaultSampler \
        else sampler
