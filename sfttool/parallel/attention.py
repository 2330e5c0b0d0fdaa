"""DeepSpeed-Ulysses attention, registered with transformers' ``AttentionInterface``.

Each rank holds all heads of its slice of the rows. The attention function all-to-alls q, k and v
to a share of the heads over the whole rows (``heads / sp``; GQA keeps its groups, as both head
counts divide by ``sp``), runs eager, SDPA or flash-attention varlen attention there, and
all-to-alls the output back. Packed samples stay isolated: the mask (or the varlen boundaries)
comes from the whole rows' ``position_ids`` (``RowSplit``, the ``sequence_parallel`` keyword of
the model's forward), never from the local slice. Without that keyword (``generate()``) the
inner attention runs as transformers would run it.

Names: ``sequence_parallel_eager``, ``sequence_parallel_sdpa``, ``sequence_parallel_flash_attention_2``.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from sfttool.parallel.comm import heads_to_seq, seq_to_heads
from sfttool.parallel.groups import SequenceParallelError
from sfttool.utils.positions import sample_ids

PREFIX = "sequence_parallel_"
INNER = ("eager", "sdpa", "flash_attention_2")


def packed_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """[batch, 1, seq, seq] bool, True where query i may attend to key j: j <= i in the same sample.

    >>> packed_causal_mask(torch.tensor([[0, 1, 0]]))[0, 0].int().tolist()
    [[1, 0, 0], [1, 1, 0], [0, 0, 1]]
    """
    sample = sample_ids(position_ids)  # [batch, seq]
    same = sample[:, :, None] == sample[:, None, :]
    causal = torch.ones(same.shape[-2:], dtype=torch.bool, device=same.device).tril()
    return (same & causal)[:, None]


def varlen_arguments(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(cu_seqlens int32 [samples + 1], max_seqlen)`` of one (flattened) row, for flash-attention varlen.

    >>> varlen_arguments(torch.tensor([[0, 1, 2, 0, 1, 0]]))
    (tensor([0, 3, 5, 6], dtype=torch.int32), 3)
    """
    lengths = torch.bincount(sample_ids(position_ids.reshape(1, -1))[0])  # [samples]
    cu = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32)
    return cu, int(lengths.max())


def eager_attention(q, k, v, mask, scaling: float, dropout: float = 0.0) -> torch.Tensor:
    """[b, h, s, d] attention with a boolean mask, as transformers' eager path computes it."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scaling
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    weights = F.dropout(weights, p=dropout, training=dropout > 0)
    return torch.matmul(weights, v)


def sdpa_attention(q, k, v, mask, scaling: float, dropout: float = 0.0) -> torch.Tensor:
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling)


def flash_varlen_kernel() -> Callable:
    """flash-attn's ``flash_attn_varlen_func``; a one-line error naming the package when it is missing."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError as err:
        raise SequenceParallelError("sequence parallelism with flash_attention_2 needs the flash-attn package "
                                    "(pip install flash-attn), or set the model's attn_implementation to "
                                    "'sdpa'") from err
    return flash_attn_varlen_func


def varlen_attention(q, k, v, boundaries: tuple[torch.Tensor, int], scaling: float, dropout: float = 0.0,
                     kernel: Callable | None = None) -> torch.Tensor:
    """[1, h, s, d] (the batch flattened into one row) through a varlen kernel taking
    ``(q, k, v [total, heads, d], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ...)``;
    ``boundaries`` is ``varlen_arguments`` of the row."""
    if q.shape[0] != 1:
        raise SequenceParallelError("flash-attention varlen runs one row at a time: the model flattens the batch")
    cu, longest = boundaries
    kernel = kernel or flash_varlen_kernel()
    q_, k_, v_ = (t[0].transpose(0, 1) for t in (q, k, v))  # [seq, heads, d]
    out = kernel(q_, k_, v_, cu.to(q.device), cu.to(q.device), longest, longest,
                 dropout_p=dropout, softmax_scale=scaling, causal=True)
    return out.transpose(0, 1)[None]  # [1, heads, seq, d]


def _inner_attention(inner: str, q, k, v, split, scaling: float, dropout: float) -> torch.Tensor:
    if inner == "flash_attention_2":
        return varlen_attention(q, k, v, split.varlen, scaling, dropout)
    return (eager_attention if inner == "eager" else sdpa_attention)(q, k, v, split.mask, scaling, dropout)


def _attention_function(inner: str) -> Callable:
    def attention(module: Any, query, key, value, attention_mask, scaling: float | None = None,
                  dropout: float = 0.0, sequence_parallel: Any = None, **kwargs):
        if sequence_parallel is None:  # no split (generate()): the inner attention, as transformers runs it
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
            plain = ALL_ATTENTION_FUNCTIONS["sdpa" if inner == "eager" else inner]
            return plain(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        if kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None:
            raise SequenceParallelError("sequence parallelism does not support sliding-window or soft-capped "
                                        "attention: set sequence_parallel_size = 1 for this model")
        group = sequence_parallel.group
        scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
        q, k, v = (seq_to_heads(t, group) for t in (query, key, value))  # [b, h/sp, seq, d]
        out = _inner_attention(inner, q, k, v, sequence_parallel, scaling, dropout)
        return heads_to_seq(out, group).transpose(1, 2).contiguous(), None  # [b, seq/sp, h, d]
    attention.__name__ = f"{PREFIX}{inner}"
    return attention


def register() -> None:
    """Register the three names with transformers (idempotent)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    for inner in INNER:
        AttentionInterface.register(PREFIX + inner, _attention_function(inner))
        # the mask transformers builds for a call without a split (generate()); a split ignores it
        ALL_MASK_ATTENTION_FUNCTIONS.register(PREFIX + inner,
                                              flash_attention_mask if inner.startswith("flash") else sdpa_mask)


def sequence_parallel_name(current: str | None) -> str:
    """The registered name wrapping the model's attention implementation ``current``."""
    current = current or "eager"
    if current.startswith(PREFIX):
        return current
    if current not in INNER:
        raise SequenceParallelError(f"sequence parallelism runs eager, sdpa or flash_attention_2 attention, but "
                                    f"the model uses {current!r}: set attn_implementation='sdpa' in model.llm")
    return PREFIX + current
