"""``SequenceParallelSampler``: mmengine's ``DefaultSampler`` over data-parallel ranks, so the ranks of
one sequence-parallel group read the same rows (each then keeps its slice of them)."""
from __future__ import annotations

import math
from typing import Sized

from mmengine.dataset import DefaultSampler

from sfttool.parallel.groups import get_data_parallel_rank, get_data_parallel_world_size


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
