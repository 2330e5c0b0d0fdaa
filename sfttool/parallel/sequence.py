"""XTuner 0.2's ``xtuner.parallel.sequence`` import path: the names its configs and code use.

    sequence_parallel_size = 2
    accumulative_counts *= sequence_parallel_size   # XTuner's convention: the same rows per optimizer step
    train_dataloader = dict(..., sampler=dict(type=SequenceParallelSampler, seed=None, shuffle=True))

See docs/long_context.md.
"""
from __future__ import annotations

from sfttool.parallel.comm import (heads_to_seq, reduce_sequence_parallel_loss, seq_to_heads,
                                   sum_over_sequence_parallel_group)
from sfttool.parallel.groups import (SequenceParallelError, get_data_parallel_rank, get_data_parallel_world_size,
                                     get_sequence_parallel_group, get_sequence_parallel_rank,
                                     get_sequence_parallel_world_size, init_sequence_parallel,
                                     reset_sequence_parallel)
from sfttool.parallel.sampler import SequenceParallelSampler
from sfttool.parallel.setup import setup_sequence_parallel

__all__ = ["SequenceParallelSampler", "SequenceParallelError", "init_sequence_parallel", "reset_sequence_parallel",
           "setup_sequence_parallel", "get_sequence_parallel_group", "get_sequence_parallel_world_size",
           "get_sequence_parallel_rank", "get_data_parallel_world_size", "get_data_parallel_rank",
           "reduce_sequence_parallel_loss", "seq_to_heads", "heads_to_seq", "sum_over_sequence_parallel_group"]
