"""The process groups of sequence parallelism (XTuner 0.2's names and layout).

The world splits into ``world_size / sequence_parallel_size`` sequence-parallel
groups of consecutive ranks; the ranks of one group share each micro-batch and
each keeps a contiguous slice of every row. Data parallelism runs across groups:
rank ``r`` is data-parallel rank ``r // sp`` of ``world_size // sp``.

    world 4, sp 2:  sequence groups [0, 1] [2, 3];  data-parallel ranks 0 0 1 1
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from sfttool.errors import SfttoolError


class SequenceParallelError(SfttoolError):
    """A setting that sequence parallelism cannot run with."""


@dataclass(frozen=True)
class _State:
    size: int = 1
    rank: int = 0           # rank inside the sequence-parallel group
    group: Any = None       # the sequence-parallel process group (None when size is 1)
    dp_size: int = 1        # data-parallel world: the number of sequence-parallel groups
    dp_rank: int = 0


_state = _State()


def init_sequence_parallel(sequence_parallel_size: int = 1) -> None:
    """Create the groups; every rank calls this, in the same order (``new_group`` is collective)."""
    global _state
    sp = int(sequence_parallel_size)
    if sp == 1:
        _state = _State(dp_size=_world(), dp_rank=_rank())
        return
    world, rank = _world(), _rank()
    check_world_size(sp, world)
    group = None
    for start in range(0, world, sp):
        made = dist.new_group(list(range(start, start + sp)))
        if start <= rank < start + sp:
            group = made
    _state = _State(size=sp, rank=rank % sp, group=group, dp_size=world // sp, dp_rank=rank // sp)


def check_world_size(sp: int, world: int) -> None:
    if sp < 1 or world % sp:
        raise SequenceParallelError(f"sequence_parallel_size={sp} must divide the number of processes ({world}): "
                                    f"launch a multiple of {sp} processes or change sequence_parallel_size")


def reset_sequence_parallel() -> None:
    """Back to no sequence parallelism (a process that trains again, tests)."""
    global _state
    _state = _State()


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def get_sequence_parallel_group() -> Any:
    return _state.group


def get_sequence_parallel_world_size() -> int:
    return _state.size


def get_sequence_parallel_rank() -> int:
    return _state.rank


def get_data_parallel_world_size() -> int:
    """Data-parallel ranks: the whole world without sequence parallelism."""
    return _state.dp_size if _state.size > 1 else _world()


def get_data_parallel_rank() -> int:
    return _state.dp_rank if _state.size > 1 else _rank()
