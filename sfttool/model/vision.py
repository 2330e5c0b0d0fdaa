"""Vision-language checkpoints (image-text-to-text classes: Qwen2.5-VL, Qwen3-VL, LLaVA, Gemma 3, ...)
trained on text rows.

Such a model is a vision tower and a projector beside a language model. Text rows reach only the
language model and its head; the rest is frozen (``freeze_vision_tower``) and left out of LoRA's
default targets, so the export holds the vision weights exactly as they were loaded:

    model = dict(type=SupervisedFinetune, llm=dict(type=AutoModelForImageTextToText.from_pretrained, ...))

What is vision is found by structure, not by class name: every parameter outside the model's
``get_decoder()`` (the language model, its embeddings included) and its output head.

Models with multimodal rotary positions (Qwen2-VL's ``mrope``: one position per temporal, height and
width axis) take a packed batch's positions as four rows: the text positions, which mark where each
packed sample starts, then the three axes, which for text are the same positions
(``packed_position_ids``).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from sfttool.registry import ConfigBuildError


def base_model(llm: Any) -> Any:
    """The transformers model under a peft wrapper (or ``llm`` itself)."""
    return llm.get_base_model() if hasattr(llm, "get_base_model") else llm


def is_vision_language(llm: Any) -> bool:
    """A model with a vision tower: its config has a ``vision_config``."""
    return getattr(getattr(base_model(llm), "config", None), "vision_config", None) is not None


def vision_parameters(llm: Any) -> dict[str, torch.nn.Parameter]:
    """The parameters outside the language model and its head (the vision tower and projector), by
    name; {} for a text-only model."""
    base = base_model(llm)
    if not is_vision_language(base):
        return {}
    kept = {id(p) for module in (base.get_decoder(), base.get_output_embeddings()) if module is not None
            for p in module.parameters()}
    return {name: p for name, p in base.named_parameters() if id(p) not in kept}


def freeze_vision(llm: Any, freeze_vision_tower: bool) -> int:
    """Freeze the vision tower and projector of ``llm``; returns how many parameters that froze.
    ``freeze_vision_tower=False`` on a model without one is an error (nothing to train there)."""
    params = vision_parameters(llm)
    if not params and not freeze_vision_tower:
        raise ConfigBuildError(f"model.freeze_vision_tower=False: {type(base_model(llm)).__name__} has no vision "
                               "tower to train; remove the setting")
    if freeze_vision_tower:
        for p in params.values():
            p.requires_grad_(False)
    return sum(p.numel() for p in params.values()) if freeze_vision_tower else 0


def language_model_prefix(llm: Any) -> str | None:
    """The qualified name of the language model inside ``llm`` (``model.language_model``), or None for a
    text-only model."""
    base = base_model(llm)
    if not is_vision_language(base):
        return None
    decoder = base.get_decoder()
    return next(name for name, module in base.named_modules() if module is decoder)


def language_model_targets(llm: Any, names: list[str]) -> str | list[str]:
    """LoRA targets for the linear layers named ``names``: as they are for a text model; for a
    vision-language model, a pattern (peft matches a string target with ``re.fullmatch``) that keeps them
    to the language model, since the vision tower uses the same names (``q_proj``, ``down_proj``, ...)."""
    prefix = language_model_prefix(llm)
    if prefix is None:
        return names
    return rf"(?:.*\.)?{re.escape(prefix)}\..*\.(?:{'|'.join(map(re.escape, names))})"


def uses_multimodal_rope(llm: Any) -> bool:
    """Qwen2-VL-style rotary positions (an ``mrope_section`` in the text config's rope parameters)."""
    config = getattr(base_model(llm), "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in ("rope_parameters", "rope_scaling"):
        rope = getattr(text, name, None)
        if isinstance(rope, dict) and rope.get("mrope_section") is not None:
            return True
    return False


def packed_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """``[batch, seq]`` text positions -> ``[4, batch, seq]``: the text positions (from which the
    attention mask keeps packed samples apart) and the temporal, height and width positions, which for
    text equal them (what the model computes itself for one unpacked text row)."""
    return position_ids.unsqueeze(0).expand(4, *position_ids.shape)


def language_model_class(path: Any, **kwargs: Any) -> Any:
    """The transformers auto class a text-generating checkpoint folder loads with: the image-text-to-text
    class for a vision-language config (``AutoModelForCausalLM`` knows only some of them), else the causal
    LM class. ``kwargs`` go to ``AutoConfig`` (``trust_remote_code``)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    folder = Path(path)
    if (folder / "adapter_config.json").is_file() and not (folder / "config.json").is_file():
        # an adapter folder, which transformers loads with its base model: the base's config decides
        path = json.loads((folder / "adapter_config.json").read_text()).get("base_model_name_or_path") or path
    config = AutoConfig.from_pretrained(path, **kwargs)
    return AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM
