"""DeepSpeed presets: find one, fill its ``"auto"`` fields from the config, and
turn the config's optimizer wrapper into what mmengine's DeepSpeed strategy wants.

    >>> ds = deepspeed_config('zero2', cfg)     # also 'deepspeed_zero2' or 'my_ds.json'  # doctest: +SKIP
    >>> ds['train_micro_batch_size_per_gpu'], ds['gradient_accumulation_steps']  # doctest: +SKIP
    (1, 16)                                     # from train_dataloader / optim_wrapper

Filled fields: ``train_micro_batch_size_per_gpu`` <- ``train_dataloader.batch_size``;
``gradient_accumulation_steps`` <- ``optim_wrapper.accumulative_counts``;
``train_batch_size`` <- their product times the number of processes;
``gradient_clipping`` <- ``optim_wrapper.clip_grad.max_norm`` (0 when unset);
``fp16``/``bf16`` <- ``AmpOptimWrapper``'s ``dtype`` on GPUs (both off on CPU).
A preset value that is not ``"auto"`` and disagrees with the config is an error, and
so is an ``"auto"`` anywhere else (except the few DeepSpeed resolves itself).
"""
from __future__ import annotations

import copy
import difflib
import json
from pathlib import Path
from typing import Any

from sfttool.config import ConfigError
from sfttool.model import moe
from sfttool.config.loader import deepspeed_preset_dir, list_deepspeed_presets
from sfttool.registry import type_name

FILLED = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size",
          "gradient_clipping", "fp16.enabled", "bf16.enabled")
# DeepSpeed 0.19's config models drop an "auto" here and use their default (5e8, 5e7, 1e5);
# HF's integration derives them from the hidden size instead, which is not known yet.
DEEPSPEED_RESOLVES = ("zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
                      "zero_optimization.stage3_param_persistence_threshold")
# Sections DeepSpeed would use instead of (optimizer: ignored) or on top of (scheduler) the config's.
NOT_USED = {
    "optimizer": "sfttool hands DeepSpeed the config's torch optimizer, so DeepSpeed ignores this section; "
                 "remove it and set optim_wrapper.optimizer",
    "scheduler": "DeepSpeed would step this learning-rate schedule on top of the config's param_scheduler; "
                 "remove it and set param_scheduler",
}


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
    presets = list_deepspeed_presets()
    close = difflib.get_close_matches(stem, presets, n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    raise ConfigError(f"--deepspeed {name_or_path}: no such file and no such preset; {hint}"
                      f"presets: {', '.join(presets)} (or a path to a DeepSpeed JSON file)")


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == "auto"


def _precision(optim_wrapper: dict, on_gpu: bool, bf16_ok: bool) -> tuple[bool, bool]:
    """(fp16, bf16) the config asks for."""
    if not on_gpu or not type_name(optim_wrapper.get("type")).endswith("AmpOptimWrapper"):
        return False, False
    dtype = str(optim_wrapper.get("dtype") or "").replace("torch.", "")
    if dtype == "bfloat16" or (dtype == "" and bf16_ok):
        return False, True
    return True, False


def _fill(ds: dict, key: str, wanted: Any, source: str, errors: list) -> None:
    current = ds.get(key, "auto")
    if _is_auto(current):
        ds[key] = wanted
    elif current != wanted:
        errors.append(f"{key} is {current!r} but the config's {source} gives {wanted!r}; "
                      f"set {key} to \"auto\" in the DeepSpeed JSON or change {source}")


def _clip_norm(optim_wrapper: dict, errors: list) -> float | None:
    """``gradient_clipping`` for ``optim_wrapper.clip_grad``; None when DeepSpeed cannot do what it asks."""
    clip = optim_wrapper.get("clip_grad") or {}
    kind, norm_type = clip.get("type", "norm"), clip.get("norm_type", 2)
    if kind != "norm" or norm_type != 2:  # DeepSpeed clips only by the global L2 norm
        what = f"type={kind!r}" if kind != "norm" else f"norm_type={norm_type!r}"
        errors.append(f"optim_wrapper.clip_grad has {what} but DeepSpeed clips only by the L2 norm of the "
                      f"gradients; use clip_grad=dict(max_norm=...) or train without --deepspeed")
        return None
    if clip and "max_norm" not in clip:
        errors.append("optim_wrapper.clip_grad has no max_norm; set clip_grad=dict(max_norm=...) "
                      "or clip_grad=None for no clipping")
        return None
    return float(clip.get("max_norm", 0.0))


def _fill_precision(ds: dict, ow: dict, on_gpu: bool, bf16_ok: bool, errors: list) -> None:
    fp16, bf16 = _precision(ow, on_gpu, bf16_ok)
    trains_in = "bfloat16" if bf16 else "float16" if fp16 else "float32"
    for key, wanted in (("fp16", fp16), ("bf16", bf16)):
        section = ds.setdefault(key, {"enabled": "auto"})
        current = section.get("enabled", "auto")
        if _is_auto(current):
            section["enabled"] = wanted
        elif current and not on_gpu:
            errors.append(f"{key}.enabled is true but this machine has no GPU; set it to \"auto\" or false")
        elif bool(current) != wanted:
            errors.append(f"{key}.enabled is {json.dumps(current)} but the config's optim_wrapper trains in "
                          f"{trains_in}; set {key}.enabled to \"auto\" in the DeepSpeed JSON or change "
                          f"optim_wrapper (type AmpOptimWrapper, dtype 'bfloat16' or 'float16')")


def _autos(value: Any, path: str = ""):
    """Key paths (``a.b[0].c``) of the ``"auto"`` values in a JSON tree."""
    if _is_auto(value):
        yield path
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _autos(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _autos(item, f"{path}[{i}]")


def _unfillable(ds: dict, errors: list) -> None:
    for section, why in NOT_USED.items():
        if section in ds:
            errors.append(f"{section}: {why}")
    for path in _autos({k: v for k, v in ds.items() if k not in NOT_USED}):
        if path not in DEEPSPEED_RESOLVES + FILLED:  # a filled one left "auto" has its own error
            errors.append(f"{path} is \"auto\" but nothing fills it; set a value (sfttool fills "
                          f"{', '.join(FILLED)}; DeepSpeed {', '.join(DEEPSPEED_RESOLVES)})")


def fill_auto(ds: dict, cfg: Any, preset: Path, on_gpu: bool, bf16_ok: bool = True, world_size: int = 1) -> dict:
    """A copy of preset ``ds`` with every ``"auto"`` replaced from ``cfg`` (``world_size`` processes)."""
    ds = copy.deepcopy(ds)
    errors: list[str] = []
    ow = cfg.get("optim_wrapper", {}) or {}
    micro = int(cfg["train_dataloader"].get("batch_size", 1))
    accum = int(ow.get("accumulative_counts", 1) or 1)
    _fill(ds, "train_micro_batch_size_per_gpu", micro, "train_dataloader.batch_size", errors)
    _fill(ds, "gradient_accumulation_steps", accum, "optim_wrapper.accumulative_counts", errors)
    _fill(ds, "train_batch_size", micro * accum * world_size,
          f"train_dataloader.batch_size × optim_wrapper.accumulative_counts × {world_size} "
          f"process{'es' if world_size != 1 else ''}", errors)
    clip = _clip_norm(ow, errors)
    if clip is not None:
        _fill(ds, "gradient_clipping", clip, "optim_wrapper.clip_grad.max_norm", errors)
    _fill_precision(ds, ow, on_gpu, bf16_ok, errors)
    _unfillable(ds, errors)
    if errors:
        raise ConfigError(f"the DeepSpeed config {preset} does not fit the training config:\n  "
                          + "\n  ".join(errors))
    return ds


def deepspeed_config(name_or_path: str, cfg: Any, world_size: int) -> dict:
    """Load a preset (or JSON file) and fill it from ``cfg`` for ``world_size`` processes (the launcher
    checks it for the planned number before starting them)."""
    import torch

    preset = find_preset(name_or_path)
    try:
        ds = json.loads(preset.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{preset}: not valid JSON ({exc})") from None
    on_gpu = torch.cuda.is_available()
    bf16_ok = on_gpu and torch.cuda.is_bf16_supported()
    return fill_auto(ds, cfg, preset, on_gpu, bf16_ok, world_size)


def deepspeed_optim_wrapper(optim_wrapper: dict) -> dict:
    """The config's optimizer wrapper for DeepSpeed: same torch optimizer (so
    DeepSpeed compiles none of its own), DeepSpeed does clipping, accumulation
    and precision itself."""
    kept = {k: v for k, v in optim_wrapper.items() if k in ("optimizer", "constructor", "paramwise_cfg")}
    return dict(type="DeepSpeedOptimWrapper", **kept)


def deepspeed_strategy(ds_config: dict, lora: bool) -> dict:
    # A LoRA run saves only the adapter: the frozen base weights stay out of checkpoints.
    return dict(type="DeepSpeedStrategy", config=ds_config, exclude_frozen_parameters=lora)


def register_moe_leaf_modules(model: Any) -> list[str]:
    """Mark each mixture-of-experts block of ``model.llm`` as a ZeRO-3 leaf: DeepSpeed then gathers the
    whole block (router and every expert) on entry instead of tracing the experts one by one, so ranks
    whose tokens reach different experts do not wait on each other (and prefetching does not follow one
    rank's routing). Returns the class names marked; nothing for a dense model."""
    classes = moe.moe_block_classes(getattr(model, "llm", model))
    if classes:
        from deepspeed.utils import set_z3_leaf_modules

        set_z3_leaf_modules(model, classes)
    return [c.__name__ for c in classes]
