"""Collectives of sequence parallelism, as autograd functions so gradients flow back across ranks.

Attention tensors use transformers' layout ``[batch, heads, seq, head_dim]``. With ``sp`` ranks,
``seq_to_heads`` turns each rank's ``[b, h, seq/sp, d]`` (all heads, its slice of the row) into
``[b, h/sp, seq, d]`` (its share of the heads, the whole row); ``heads_to_seq`` undoes it. Each is
the other's backward.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def _exchange(chunks: torch.Tensor, group: Any) -> torch.Tensor:
    """``chunks`` [sp, ...]: chunk j goes to rank j; the result's chunk i came from rank i."""
    chunks = chunks.contiguous()
    out = torch.empty_like(chunks)  # of a permuted view it would keep the view's strides
    dist.all_to_all_single(out, chunks, group=group)
    return out


def _seq_to_heads(x: torch.Tensor, group: Any) -> torch.Tensor:
    sp = dist.get_world_size(group)
    b, h, s, d = x.shape
    chunks = x.reshape(b, sp, h // sp, s, d).permute(1, 0, 2, 3, 4)  # [sp, b, h/sp, s, d]: head share j -> rank j
    got = _exchange(chunks, group)                                    # [sp, b, h/sp, s, d]: slice i from rank i
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // sp, sp * s, d)


def _heads_to_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    sp = dist.get_world_size(group)
    b, hl, seq, d = x.shape
    chunks = x.reshape(b, hl, sp, seq // sp, d).permute(2, 0, 1, 3, 4)  # [sp, b, h/sp, s, d]: slice j -> rank j
    got = _exchange(chunks, group)                                       # [sp, b, h/sp, s, d]: heads of rank i
    return got.permute(1, 0, 2, 3, 4).reshape(b, sp * hl, seq // sp, d)


class _AllToAll(torch.autograd.Function):
    """``_seq_to_heads`` (``to_heads``) or ``_heads_to_seq``; the backward is the other one."""

    @staticmethod
    def forward(ctx, x, group, to_heads: bool):
        ctx.group, ctx.to_heads = group, to_heads
        return (_seq_to_heads if to_heads else _heads_to_seq)(x, group)

    @staticmethod
    def backward(ctx, grad):
        return (_heads_to_seq if ctx.to_heads else _seq_to_heads)(grad, ctx.group), None, None


def seq_to_heads(x: torch.Tensor, group: Any) -> torch.Tensor:
    """[b, h, seq/sp, d] (this rank's slice) -> [b, h/sp, seq, d] (this rank's heads)."""
    return _AllToAll.apply(x, group, True)


def heads_to_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    """[b, h/sp, seq, d] (this rank's heads) -> [b, h, seq/sp, d] (this rank's slice)."""
    return _AllToAll.apply(x, group, False)


class _GroupMean(torch.autograd.Function):
    """Forward: the mean over the group. Backward: the gradient passes unchanged, so each rank
    differentiates only its own slice's loss, and the data-parallel gradient average over all ranks
    then counts every token of the row once."""

    @staticmethod
    def forward(ctx, x, group):
        total = x.detach().clone()
        dist.all_reduce(total, group=group)
        return total / dist.get_world_size(group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GroupSum(torch.autograd.Function):
    """Forward: the sum over the group. Backward: the gradient passes unchanged, so each rank
    differentiates only its own slice's share (as ``_GroupMean``)."""

    @staticmethod
    def forward(ctx, x, group):
        total = x.detach().clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def sum_over_sequence_parallel_group(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``x`` (e.g. each sequence's log-prob summed over this rank's slice) added over the group: the whole
    rows' value on every rank; each rank's gradient is its slice's."""
    if group is None:
        return x
    return _GroupSum.apply(x, group)


def reduce_sequence_parallel_loss(loss: torch.Tensor, group: Any) -> torch.Tensor:
    """The loss value of the whole row on every rank of the group; each rank's gradient is its slice's."""
    if group is None:
        return loss
    return _GroupMean.apply(loss, group)
