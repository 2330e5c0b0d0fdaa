"""The Hugging Face folders a run leaves behind, written the same way by
``sfttool train`` (at the end of training) and ``sfttool convert pth_to_hf``
(from a checkpoint):

- LoRA/QLoRA: a peft adapter folder (``adapter_config.json`` +
  ``adapter_model.safetensors``), loadable with ``PeftModel.from_pretrained``;
- full fine-tune: a model folder (``config.json`` + ``model.safetensors``), in
  the dtype the config named, with the KV cache turned back on;

each with the tokenizer beside it and ``sfttool_config.py`` (the config that
was run: ``chat`` and ``convert merge`` read the template from it). The folder
appears complete or not at all (``sfttool.utils.atomic.atomic_folder``).
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator

from sfttool.tools.merge import SAVED_CONFIG_NAME, output_folder, save_model


def is_peft(llm: Any) -> bool:
    from peft import PeftModel

    return isinstance(llm, PeftModel)


def export_folder_name(model: Any) -> str:
    """``hf_adapter`` for a LoRA model, ``hf_model`` for a full fine-tune."""
    return "hf_adapter" if getattr(model, "use_lora", False) else "hf_model"


def write_hf_folder(model: Any, tokenizer: Any, cfg: Any, save_dir: str | Path, error: type[Exception],
                    safe_serialization: bool = True, max_shard_size: str | int = "2GB") -> Path:
    """Save ``model`` (a ``SupervisedFinetune``) as an HF folder in ``save_dir``, atomically; an OS
    error (disk full, permissions) becomes one line of ``error``."""
    save_dir = Path(save_dir)
    llm = model.llm
    with output_folder(save_dir, error) as tmp, _kv_cache_on(llm):
        if is_peft(llm):  # the adapter keeps the dtype its weights trained in, as peft saves it
            llm.save_pretrained(str(tmp), safe_serialization=safe_serialization)
        else:  # in the dtype the config named (a run on CPU trains in float32)
            save_model(llm, tmp, safe_serialization=safe_serialization, max_shard_size=max_shard_size,
                       dtype=_config_dtype(cfg))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        cfg.dump(str(tmp / SAVED_CONFIG_NAME))
    return save_dir


def config_tokenizer(cfg: Any) -> Any:
    """The tokenizer the config trains with (its ``tokenizer``, else ``model.tokenizer``), or None."""
    from sfttool.registry import build_if_config

    node = cfg.get("tokenizer") or (cfg.get("model") or {}).get("tokenizer")
    return build_if_config(node, "tokenizer") if node is not None else None


def save_hf(runner: Any, cfg: Any, work_dir: Path) -> Path | None:
    """The end of ``sfttool train``: ``work_dir/hf_adapter`` or ``work_dir/hf_model``. Under ZeRO-3
    the trained weights are gathered first; rank 0 writes."""
    from mmengine.dist import barrier, is_main_process

    from sfttool.engine.runner import unwrap_model
    from sfttool.utils.atomic import CheckpointSaveError

    model = unwrap_model(runner.model)
    if getattr(model, "llm", None) is None:
        return None
    out = work_dir / export_folder_name(model)
    with _gathered(runner.model, model):
        if is_main_process():
            write_hf_folder(model, config_tokenizer(cfg), cfg, out, CheckpointSaveError)
            runner.logger.info(f"Saved the {'adapter' if out.name == 'hf_adapter' else 'model'} to {out}")
    barrier()
    return out


def _config_dtype(cfg: Any) -> Any:
    """The torch dtype the config loads the LLM in, or None (a CPU run may train in float32)."""
    import torch

    from sfttool.engine.preflight import configured_dtype

    name = configured_dtype(cfg.get("model"))
    return getattr(torch, name, None) if name else None


@contextlib.contextmanager
def _kv_cache_on(llm: Any) -> Iterator[None]:
    """Training turned the KV cache off; the saved model is for inference."""
    config = getattr(llm, "config", None)
    before = getattr(config, "use_cache", None)
    if config is not None:
        config.use_cache = True
    try:
        yield
    finally:
        if config is not None:
            config.use_cache = before


def _gathered(wrapped: Any, model: Any):
    """ZeRO-3 partitions parameters across ranks: gather them for saving."""
    from sfttool.engine.runner import deepspeed_engine

    partitioned = getattr(deepspeed_engine(wrapped), "zero_optimization_partition_weights", None)
    if callable(partitioned) and partitioned():
        import deepspeed

        # A LoRA export holds only the trained weights (the adapter, and embeddings when they grew): gather
        # those, not the whole frozen base model at once, which is what ZeRO-3 exists to avoid holding.
        lora = getattr(model, "use_lora", False)
        params = [p for p in model.parameters() if p.requires_grad or not lora]
        return deepspeed.zero.GatheredParameters(params, modifier_rank=None)
    return contextlib.nullcontext()
