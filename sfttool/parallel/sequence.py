"""XTuner 0.2's ``xtuner.parallel.sequence`` import path. XTuner's configs import
``SequenceParallelSampler`` unconditionally and use it only when
``sequence_parallel_size > 1``; sequence parallelism is not implemented here,
so the name exists for the import and refuses to be used."""
from __future__ import annotations

from sfttool.errors import SfttoolError


class SequenceParallelSampler:
    """Stands in for XTuner's sampler; building it is a one-line error."""

    def __init__(self, *args, **kwargs):
        raise SfttoolError("sequence parallelism is not supported: set sequence_parallel_size = 1 "
                           "(train_dataloader.sampler = dict(type=DefaultSampler, shuffle=True))")


__all__ = ["SequenceParallelSampler"]
