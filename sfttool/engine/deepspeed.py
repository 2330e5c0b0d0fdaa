"""DeepSpeed presets: find one, fill its ``"auto"`` fields from the config, and
turn the config's optimizer wrapper into what mmengine's DeepSpeed strategy wants.

    >>> ds = deepspeed_config('zero2', cfg)     # also 'deepspeed_zero2' or 'my_ds.json'
    >>> ds['train_micro_batch_size_per_gpu'], ds['gradient_accumulation_steps']
    (1, 16)                                     # from train_dataloader / optim_wrapper

Filled fields: ``train_micro_batch_size_per_gpu`` <- ``train_dataloader.batch_size``;
``gradient_accumulation_steps`` <- ``optim_wrapper.accumulative_counts``;
``gradient_clipping`` <- ``optim_wrapper.clip_grad.max_norm`` (0 when unset);
``fp16``/``bf16`` <- ``AmpOptimWrapper``'s ``dtype`` on GPUs (both off on CPU).
A preset value that is not ``"auto"`` and disagrees with the config is an error.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from sfttool.config import ConfigError
from sfttool.config.loader import deepspeed_preset_dir, list_deepspeed_presets


def find_preset(name_or_path: str) -> Path:
    """``zero2`` / ``deepspeed_zero2`` / ``zero2.json`` -> the shipped preset; else a JSON path."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    stem = path.stem if path.suffix == ".json" else str(name_or_path)
    stem = stem.removeprefix("deepspeed_")
    preset = deepspeed_preset_dir() / f"{stem}.json"
    if preset.is_file():
        return preset
    raise ConfigError(f"--deepspeed {name_or_path}: no such file and no such preset; "
                      f"presets: {', '.join(list_deepspeed_presets())} (or a path to a DeepSpeed JSON file)")


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == "auto"


def _type_name(cfg: dict) -> str:
    type_ = cfg.get("type", "OptimWrapper")
    return (type_ if isinstance(type_, str) else getattr(type_, "__name__", str(type_))).rsplit(".", 1)[-1]


def _precision(optim_wrapper: dict, on_gpu: bool, bf16_ok: bool) -> tuple[bool, bool]:
    """(fp16, bf16) the config asks for."""
    if not on_gpu or not _type_name(optim_wrapper).endswith("AmpOptimWrapper"):
        return False, False
    dtype = str(optim_wrapper.get("dtype") or "").replace("torch.", "")
    if dtype == "bfloat16" or (dtype == "" and bf16_ok):
        return False, True
    return True, False


def _fill(ds: dict, key: str, wanted: Any, source: str, preset: Path, errors: list) -> None:
    current = ds.get(key, "auto")
    if _is_auto(current):
        ds[key] = wanted
    elif current != wanted:
        errors.append(f"{preset}: {key} is {current!r} but the config's {source} gives {wanted!r}; "
                      f"set {key} to \"auto\" in the DeepSpeed JSON or change {source}")


def fill_auto(ds: dict, cfg: Any, preset: Path, on_gpu: bool, bf16_ok: bool = True) -> dict:
    """A copy of preset ``ds`` with every ``"auto"`` replaced from ``cfg``."""
    ds = copy.deepcopy(ds)
    errors: list[str] = []
    ow = cfg.get("optim_wrapper", {}) or {}
    _fill(ds, "train_micro_batch_size_per_gpu", int(cfg["train_dataloader"].get("batch_size", 1)),
          "train_dataloader.batch_size", preset, errors)
    _fill(ds, "gradient_accumulation_steps", int(ow.get("accumulative_counts", 1) or 1),
          "optim_wrapper.accumulative_counts", preset, errors)
    clip = (ow.get("clip_grad") or {}).get("max_norm", 0.0)
    _fill(ds, "gradient_clipping", float(clip), "optim_wrapper.clip_grad.max_norm", preset, errors)
    fp16, bf16 = _precision(ow, on_gpu, bf16_ok)
    for key, wanted in (("fp16", fp16), ("bf16", bf16)):
        section = ds.setdefault(key, {"enabled": "auto"})
        if _is_auto(section.get("enabled", "auto")):
            section["enabled"] = wanted
        elif section["enabled"] and not on_gpu:
            errors.append(f"{preset}: {key}.enabled is true but this machine has no GPU; "
                          f"set it to \"auto\" or false")
    if errors:
        raise ConfigError("the DeepSpeed config contradicts the training config:\n  " + "\n  ".join(errors))
    return ds


def deepspeed_config(name_or_path: str, cfg: Any) -> dict:
    """Load a preset (or JSON file) and fill it from ``cfg``."""
    import torch

    preset = find_preset(name_or_path)
    try:
        ds = json.loads(preset.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{preset}: not valid JSON ({exc})") from None
    on_gpu = torch.cuda.is_available()
    bf16_ok = on_gpu and torch.cuda.is_bf16_supported()
    return fill_auto(ds, cfg, preset, on_gpu, bf16_ok)


def deepspeed_optim_wrapper(optim_wrapper: dict) -> dict:
    """The config's optimizer wrapper for DeepSpeed: same torch optimizer (so
    DeepSpeed compiles none of its own), DeepSpeed does clipping, accumulation
    and precision itself."""
    kept = {k: v for k, v in optim_wrapper.items() if k in ("optimizer", "constructor", "paramwise_cfg")}
    return dict(type="DeepSpeedOptimWrapper", **kept)


def deepspeed_strategy(ds_config: dict, lora: bool) -> dict:
    # A LoRA run saves only the adapter: the frozen base weights stay out of checkpoints.
    return dict(type="DeepSpeedStrategy", config=ds_config, exclude_frozen_parameters=lora)
