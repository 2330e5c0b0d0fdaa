"""The Hugging Face folders sfttool writes, the same way whoever writes them (the end of
``sfttool train``, ``sfttool convert pth_to_hf`` from a checkpoint, ``convert merge``):

- LoRA/QLoRA: a peft adapter folder (``adapter_config.json`` +
  ``adapter_model.safetensors``), loadable with ``PeftModel.from_pretrained``;
- full fine-tune: a model folder (``config.json`` + ``model.safetensors``), in
  the dtype the config named, with the KV cache turned back on;

each with the tokenizer beside it (and, for image-text training, the processor: its image processor
settings and chat template, so ``AutoProcessor.from_pretrained`` loads from the folder) and
``sfttool_config.py`` (the config that was run: ``chat`` and ``convert merge`` read the template from it). The folder
appears complete or not at all (``sfttool.utils.atomic.atomic_folder``).
Below the engine and the tools, which both write through it.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Iterator

from sfttool.dataset.images_stage import build_processor
from sfttool.model.build import configured_dtype
from sfttool.registry import build_if_config
from sfttool.utils.atomic import atomic_folder

SAVED_CONFIG_NAME = "sfttool_config.py"


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
            # the trained adapter only (not a frozen reference copy DPO may hold beside it)
            llm.save_pretrained(str(tmp), safe_serialization=safe_serialization,
                                selected_adapters=[llm.active_adapter])
        else:  # in the dtype the config named (a run on CPU trains in float32)
            save_model(llm, tmp, safe_serialization=safe_serialization, max_shard_size=max_shard_size,
                       dtype=_config_dtype(cfg))
        processor = config_processor(cfg)
        if processor is not None:  # first: the tokenizer below is the one training used
            processor.save_pretrained(str(tmp))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        cfg.dump(str(tmp / SAVED_CONFIG_NAME))
    return save_dir


def config_tokenizer(cfg: Any) -> Any:
    """The tokenizer the config trains with (its ``tokenizer``, else ``model.tokenizer``), or None."""
    node = cfg.get("tokenizer") or (cfg.get("model") or {}).get("tokenizer")
    return build_if_config(node, "tokenizer") if node is not None else None


def config_processor(cfg: Any) -> Any:
    """The processor image-text rows were encoded with (the config's ``processor``, else its training
    dataset's), or None."""
    dataset = ((cfg.get("train_dataloader") or {}).get("dataset") or {})
    node = cfg.get("processor") or (dataset.get("processor") if isinstance(dataset, dict) else None)
    return build_processor(node) if node is not None else None


def save_model(model, save_dir: str | os.PathLike, safe_serialization: bool = True,
               max_shard_size: str | int = "2GB", dtype=None) -> None:
    """Save a full HF model; ``safe_serialization=False`` writes ``pytorch_model.bin``
    (transformers 5 only writes safetensors itself; some older readers want .bin).
    ``dtype``: save the floating-point weights in it (the model itself is not changed)."""
    import torch

    save_dir = Path(save_dir)
    model.config.use_cache = True  # training turns the KV cache off; inference wants it back
    state = {k: v.detach().to(dtype) if dtype is not None and v.is_floating_point() else v.detach()
             for k, v in model.state_dict().items()}
    config_dtype = getattr(model.config, "dtype", None)
    try:
        if safe_serialization:
            model.save_pretrained(save_dir, max_shard_size=max_shard_size, state_dict=state)
        else:
            save_dir.mkdir(parents=True, exist_ok=True)
            if model.can_generate():
                model.generation_config.save_pretrained(save_dir)
            torch.save({k: v.cpu().contiguous() for k, v in state.items()}, save_dir / "pytorch_model.bin")
        if dtype is not None:  # save_pretrained writes the dtype of the model's weights, not of the saved ones
            model.config.dtype = dtype
        model.config.save_pretrained(save_dir)
    finally:
        model.config.dtype = config_dtype


def _is_weights_file(name: str) -> bool:
    return name.endswith((".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json"))


def output_folder(save_dir: Path, error: type[Exception]):
    """Write an HF folder atomically (``sfttool.utils.atomic.atomic_folder``): other files
    already in ``save_dir`` are kept, except weight files of an earlier save that the new
    one does not overwrite (a stale shard or index next to new weights would load as a mix).
    An OS error becomes one line of ``error``."""
    return atomic_folder(save_dir, error, stale=_is_weights_file)


def _config_dtype(cfg: Any) -> Any:
    """The torch dtype the config loads the LLM in, or None (a CPU run may train in float32)."""
    import torch

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
