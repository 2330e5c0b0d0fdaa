"""Switching a run to sequence parallelism, once ``engine.checks`` has checked its settings: create the
groups and give the model's attention to the Ulysses attention function."""
from __future__ import annotations

from typing import Any

from sfttool.parallel.attention import register, sequence_parallel_name
from sfttool.parallel.groups import init_sequence_parallel


def setup_sequence_parallel(size: int, model: Any) -> int:
    """Create the sequence- and data-parallel groups (every rank, after the process group exists) and,
    with ``size > 1``, switch ``model`` (a ``SupervisedFinetune``) to Ulysses attention. Returns the size."""
    init_sequence_parallel(size)
    if size > 1:
        use_sequence_parallel_attention(model.llm)
        if getattr(model, "ref_llm", None) is not None:  # DPO's frozen reference copy runs the same rows
            use_sequence_parallel_attention(model.ref_llm)
    return size


def use_sequence_parallel_attention(llm: Any) -> None:
    """The model's eager/sdpa/flash attention, wrapped by the Ulysses function of the same inner kind."""
    register()
    config = llm.config
    config._attn_implementation = sequence_parallel_name(config._attn_implementation)
