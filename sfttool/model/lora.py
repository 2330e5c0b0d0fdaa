"""LoRA / QLoRA with peft.

``target_modules=None`` means every linear layer except the LM head (bnb's
``Linear4bit``/``Linear8bitLt`` subclass ``nn.Linear``, so QLoRA is covered); in a
vision-language model, those of its language model.
A quantized model first goes through ``prepare_model_for_kbit_training``
(frozen base, norms and head in float32); a plain model does not, because that
function would also upcast every bf16 weight to float32.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from sfttool.model.vision import is_vision_language, language_model_targets
from sfttool.registry import ConfigBuildError, build_if_config


def find_linear_names(llm: torch.nn.Module) -> list[str]:
    """Leaf names of all linear layers but the output head.

    Tiny Llama -> ['down_proj', 'gate_proj', 'k_proj', 'o_proj', 'q_proj', 'up_proj', 'v_proj']
    """
    head = llm.get_output_embeddings() if hasattr(llm, "get_output_embeddings") else None
    names = {name.rsplit(".", 1)[-1] for name, module in llm.named_modules()
             if isinstance(module, torch.nn.Linear) and module is not head}
    return sorted(names)


def build_lora_config(lora: Any) -> Any:
    """A typed config dict, a plain dict of ``LoraConfig`` arguments, or a
    ready config -> a peft config for a causal LM."""
    from peft import LoraConfig

    if isinstance(lora, dict) and "type" not in lora:
        lora = LoraConfig(**lora)
    lora = build_if_config(lora, "model.lora")
    if getattr(lora, "task_type", None) is None:
        lora.task_type = "CAUSAL_LM"
    return lora


def is_quantized(llm: torch.nn.Module) -> bool:
    return getattr(llm, "hf_quantizer", None) is not None


def apply_lora(llm: torch.nn.Module, lora_config: Any, use_activation_checkpointing: bool) -> torch.nn.Module:
    """Wrap ``llm`` in a peft model with fresh adapters."""
    from peft import get_peft_model, prepare_model_for_kbit_training

    if is_quantized(llm):
        llm = prepare_model_for_kbit_training(
            llm, use_gradient_checkpointing=use_activation_checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora_config.target_modules is None:
        lora_config.target_modules = default_targets(llm)
    return get_peft_model(llm, lora_config)


def default_targets(llm: torch.nn.Module) -> str | list[str]:
    """Every linear layer of the language model but its head (a vision-language model's vision tower
    and projector are left out: ``sfttool.model.vision``)."""
    if not is_vision_language(llm):
        return find_linear_names(llm)
    return language_model_targets(llm, find_linear_names(llm.get_decoder()))


def load_adapter_folder(peft_llm: torch.nn.Module, path: str | os.PathLike) -> None:
    """Load a saved peft adapter (``adapter_model.safetensors``) into ``peft_llm``."""
    from peft import load_peft_weights, set_peft_model_state_dict

    result = set_peft_model_state_dict(peft_llm, load_peft_weights(str(path), device="cpu"))
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise ConfigBuildError(f"model.peft_model: {path} holds weights this adapter does not have, "
                               f"e.g. {unexpected[:3]}; was it trained with the same LoRA settings and base model?")
