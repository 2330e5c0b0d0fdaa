"""Merge a LoRA/QLoRA adapter into its base model and save a plain HF folder.

    >>> merge_adapter('Qwen/Qwen2.5-0.5B-Instruct', 'work_dirs/run/hf_adapter', 'merged')
    PosixPath('merged')       # config.json, model.safetensors, tokenizer files

The base is loaded unquantised (also for QLoRA adapters: merging into 4-bit
weights would round the update away), so the merged model is what the adapter
computes on top of full-precision weights.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

SAVED_CONFIG_NAME = "sfttool_config.py"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class MergeError(Exception):
    """The adapter or base model cannot be merged; the message says why."""


def device_map_for(device: str) -> dict | str | None:
    """``'cpu'`` -> None (plain load), ``'cuda'`` -> everything on GPU 0, ``'auto'`` -> accelerate's placement."""
    if device == "cpu":
        return None
    if device == "cuda":
        return {"": 0}
    if device == "auto":
        return "auto"
    raise MergeError(f"--device must be cpu, cuda or auto, got {device!r}")


def has_tokenizer(folder: str | os.PathLike) -> bool:
    folder = Path(folder)
    return folder.is_dir() and any((folder / name).is_file() for name in TOKENIZER_FILES)


def _check_adapter(adapter: Path) -> None:
    if not (adapter / "adapter_config.json").is_file():
        raise MergeError(
            f"{adapter}: not a peft adapter folder (no adapter_config.json); convert a training checkpoint "
            "first with `sfttool convert pth_to_hf CONFIG CHECKPOINT SAVE_DIR`")


def load_merged(base: str | os.PathLike, adapter: str | os.PathLike, device: str = "cpu", dtype="auto"):
    """Base model with ``adapter`` folded into its weights (a plain transformers model)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _check_adapter(Path(adapter))
    model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype, device_map=device_map_for(device))
    model = PeftModel.from_pretrained(model, str(adapter))
    return model.merge_and_unload()


def save_model(model, save_dir: str | os.PathLike, safe_serialization: bool = True,
               max_shard_size: str | int = "2GB") -> None:
    """Save a full HF model; ``safe_serialization=False`` writes ``pytorch_model.bin``
    (transformers 5 only writes safetensors itself; some older readers want .bin)."""
    import torch

    save_dir = Path(save_dir)
    model.config.use_cache = True  # training turns the KV cache off; inference wants it back
    if safe_serialization:
        model.save_pretrained(save_dir, max_shard_size=max_shard_size)
        return
    save_dir.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(save_dir)
    if model.can_generate():
        model.generation_config.save_pretrained(save_dir)
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    torch.save(state, save_dir / "pytorch_model.bin")


def merge_adapter(base: str | os.PathLike, adapter: str | os.PathLike, save_dir: str | os.PathLike,
                  device: str = "cpu", safe_serialization: bool = True,
                  max_shard_size: str | int = "2GB") -> Path:
    """Write the merged model, the tokenizer (the adapter's if it has one, else
    the base's) and the training config when the adapter folder carries it."""
    from transformers import AutoTokenizer

    adapter, save_dir = Path(adapter), Path(save_dir)
    merged = load_merged(base, adapter, device=device)
    save_model(merged, save_dir, safe_serialization=safe_serialization, max_shard_size=max_shard_size)
    tokenizer = AutoTokenizer.from_pretrained(adapter if has_tokenizer(adapter) else base)
    tokenizer.save_pretrained(save_dir)
    if (adapter / SAVED_CONFIG_NAME).is_file():
        shutil.copy(adapter / SAVED_CONFIG_NAME, save_dir / SAVED_CONFIG_NAME)
    return save_dir
