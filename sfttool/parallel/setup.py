"""Switching a run to sequence parallelism: check the config and the model, create the groups, give the
model's attention to the Ulysses attention function. Every check is a one-line error naming the setting."""
from __future__ import annotations

from typing import Any

from sfttool.parallel.groups import SequenceParallelError, init_sequence_parallel


def sequence_parallel_size(cfg: Any) -> int:
    """PART 1's ``sequence_parallel_size`` (1 when the config has none)."""
    size = cfg.get("sequence_parallel_size", 1)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise SequenceParallelError(f"sequence_parallel_size must be a positive integer (1: off), got {size!r}")
    return size


def check_sequence_parallel_config(cfg: Any) -> None:
    """What can be checked before the data is processed (which may take hours): the size, the sampler,
    validation, and the number of processes (the process group exists by then)."""
    import torch.distributed as dist

    from sfttool.parallel.groups import check_world_size

    size = sequence_parallel_size(cfg)
    if size > 1:
        check_config(cfg, size)
        check_world_size(size, dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1)


def setup_sequence_parallel(cfg: Any, model: Any, dataset: Any = None) -> int:
    """Create the sequence- and data-parallel groups (every rank, after the process group exists) and,
    with ``sequence_parallel_size > 1``, switch ``model`` to Ulysses attention. Returns the size."""
    import torch

    size = sequence_parallel_size(cfg)
    if size > 1:
        check_config(cfg, size)
        check_model(model, size)
        if isinstance(dataset, torch.utils.data.IterableDataset):  # a stream shares rows out by rank itself
            raise SequenceParallelError(f"sequence_parallel_size={size} needs a map-style dataset: "
                                        "turn streaming off in train_dataloader.dataset")
    init_sequence_parallel(size)
    if size > 1:
        use_sequence_parallel_attention(model.llm)
    return size


def _sampler_class(kind: Any) -> Any:
    """A sampler ``type``: a class, a dotted path, or a name in mmengine's sampler registry."""
    from mmengine.registry import DATA_SAMPLERS

    from sfttool.registry import resolve_type

    if isinstance(kind, str):
        return resolve_type(kind, "train_dataloader.sampler.type") if "." in kind else DATA_SAMPLERS.get(kind)
    return kind


def check_config(cfg: Any, size: int) -> None:
    from mmengine.dataset import DefaultSampler

    from sfttool.engine.validation import validation_enabled
    from sfttool.parallel.sampler import SequenceParallelSampler

    sampler = _sampler_class((cfg.train_dataloader.get("sampler") or {}).get("type"))
    if not (isinstance(sampler, type) and issubclass(sampler, (SequenceParallelSampler, DefaultSampler))):
        raise SequenceParallelError(f"sequence_parallel_size={size} needs train_dataloader.sampler = "
                                    "dict(type=SequenceParallelSampler, seed=None, shuffle=True) "
                                    "(from sfttool.parallel.sequence), so the ranks of a group read the same rows")
    if validation_enabled(cfg):
        raise SequenceParallelError(f"validation does not run with sequence_parallel_size={size}: "
                                    "set val_ratio = 0 and val_data_path = None (or val_dataloader = None)")


def train_sampler(sampler: Any) -> Any:
    """``train_dataloader.sampler`` as the run builds it: under sequence parallelism mmengine's
    ``DefaultSampler``, which shares rows out by process, becomes ``SequenceParallelSampler`` with the
    same arguments, so a config keeps one sampler line whatever ``sequence_parallel_size`` is."""
    from mmengine.dataset import DefaultSampler

    from sfttool.parallel.groups import get_sequence_parallel_world_size
    from sfttool.parallel.sampler import SequenceParallelSampler

    if get_sequence_parallel_world_size() == 1 or not isinstance(sampler, dict):
        return sampler
    return dict(sampler, type=SequenceParallelSampler) if _sampler_class(sampler.get("type")) is DefaultSampler \
        else sampler


def check_model(model: Any, size: int) -> None:
    from sfttool.model.sft import SupervisedFinetune

    if not isinstance(model, SupervisedFinetune) or type(model).compute_loss is not SupervisedFinetune.compute_loss:
        raise SequenceParallelError(f"model.type={type(model).__name__} does not train with sequence parallelism "
                                    "(SupervisedFinetune does): set sequence_parallel_size = 1")
    config = model.llm.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % size or kv_heads % size:
        raise SequenceParallelError(f"sequence_parallel_size={size} must divide the model's attention heads "
                                    f"({heads}) and key/value heads ({kv_heads}): choose a divisor of both")


def use_sequence_parallel_attention(llm: Any) -> None:
    """The model's eager/sdpa/flash attention, wrapped by the Ulysses function of the same inner kind."""
    from sfttool.parallel.attention import register, sequence_parallel_name

    register()
    config = llm.config
    config._attn_implementation = sequence_parallel_name(config._attn_implementation)
