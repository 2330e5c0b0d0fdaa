"""The end of ``sfttool train``: the trained model as a Hugging Face folder in the work dir
(``hf_adapter`` or ``hf_model``), written by ``sfttool.model.hf_folder.write_hf_folder`` as
``sfttool convert pth_to_hf`` writes it from a checkpoint; under ZeRO-3 the weights are gathered first.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from mmengine.dist import barrier, is_main_process

from sfttool.engine.runner import deepspeed_engine, unwrap_model
from sfttool.model.hf_folder import config_tokenizer, export_folder_name, write_hf_folder
from sfttool.utils.atomic import CheckpointSaveError


def save_hf(runner: Any, cfg: Any, work_dir: Path) -> Path | None:
    """The end of ``sfttool train``: ``work_dir/hf_adapter`` or ``work_dir/hf_model``. Under ZeRO-3
    the trained weights are gathered first; rank 0 writes."""
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


def _gathered(wrapped: Any, model: Any):
    """ZeRO-3 partitions parameters across ranks: gather them for saving."""
    partitioned = getattr(deepspeed_engine(wrapped), "zero_optimization_partition_weights", None)
    if callable(partitioned) and partitioned():
        import deepspeed  # imported by the run already (the engine found); seconds to import elsewhere

        # A LoRA export holds only the trained weights (the adapter, and embeddings when they grew): gather
        # those, not the whole frozen base model at once, which is what ZeRO-3 exists to avoid holding.
        lora = getattr(model, "use_lora", False)
        params = [p for p in model.parameters() if p.requires_grad or not lora]
        return deepspeed.zero.GatheredParameters(params, modifier_rank=None)
    return contextlib.nullcontext()
