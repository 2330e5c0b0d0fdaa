"""Decisions every rank must take together."""
from __future__ import annotations


def any_rank(flag: bool) -> bool:
    """True on every rank when ``flag`` is true on any rank (an all-reduce max),
    so all ranks skip a step or stop at the same iteration."""
    from mmengine.dist import all_reduce, get_world_size

    if get_world_size() == 1:
        return flag
    import torch

    value = torch.tensor([1.0 if flag else 0.0])
    all_reduce(value, op="max")
    return bool(value.item() > 0)
