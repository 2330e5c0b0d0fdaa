"""LoRA / QLoRA with peft.

``target_modules=None`` (and no ``target_parameters``) means the targets ``lora_targets`` names:
``'all'`` (default), every linear layer except the LM head and the routers, plus a mixture-of-experts
model's fused 3-D expert weights (through peft's ``target_parameters``); ``'attention'``, the linear
layers of the attention blocks; ``'experts'``, what lies in the MoE blocks besides the router and gates
(fused experts, shared experts). bnb's ``Linear4bit``/``Linear8bitLt`` subclass ``nn.Linear``, so QLoRA is
covered. Targets the config names must each match a module (or parameter) of the model.

A quantized model first goes through ``prepare_model_for_kbit_training`` (frozen base, norms and head
in float32); a plain model does not, because that function would also upcast every bf16 weight to
float32. A quantized MoE model gets the same minus that upcast of its fused experts (bitsandbytes
quantizes Linear layers only, so the experts stay in the load dtype and an upcast would double them).
In a vision-language model the targets are those of its language model (``sfttool.model.vision``).
"""
from __future__ import annotations

import contextlib
import copy
import difflib
import os
import re
from typing import Any, Iterator

import torch

from sfttool import compat
from sfttool.model import moe
from sfttool.model.vision import (is_vision_language, language_model_prefix, language_model_targets,
                                  unread_tower_modules, vision_modules)
from sfttool.registry import ConfigBuildError, build_if_config

LORA_TARGETS = ("all", "attention", "experts")


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


def apply_lora(llm: torch.nn.Module, lora_config: Any, use_activation_checkpointing: bool,
               lora_targets: str = "all") -> torch.nn.Module:
    """Wrap ``llm`` in a peft model with fresh adapters on ``lora_targets`` (unless the config names
    its own targets, each of which must match)."""
    from peft import get_peft_model, prepare_model_for_kbit_training

    resolve_targets(llm, lora_config, lora_targets)
    if is_quantized(llm) and moe.is_moe(llm):
        freeze_upcasting_all_but_experts(llm)
    elif is_quantized(llm):
        llm = prepare_model_for_kbit_training(
            llm, use_gradient_checkpointing=use_activation_checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False})
    with compat.peft_targets_as_given():
        return get_peft_model(llm, lora_config)


def resolve_targets(llm: torch.nn.Module, lora_config: Any, lora_targets: str = "all") -> None:
    """Set ``lora_config``'s targets to ``lora_targets``' choice when it names none, else check each it
    names; one line for a target that matches nothing, and for dropout on fused experts. Needs only the
    model's module tree (``engine.checks`` runs it on a meta-device copy before anything is built)."""
    if lora_config.target_modules is None and not lora_config.target_parameters:
        lora_config.target_modules, lora_config.target_parameters = chosen_targets(llm, lora_targets)
    else:
        check_named_targets(llm, lora_config, lora_targets)
        if lora_config.target_modules is None:  # parameters only: peft would add its default modules
            lora_config.target_modules = []
    if lora_config.target_parameters and lora_config.lora_dropout:
        raise ConfigBuildError(f"model.lora.lora_dropout={lora_config.lora_dropout}: LoRA on fused expert weights "
                               f"({', '.join(sorted(lora_config.target_parameters))}) runs without dropout in peft; "
                               "set model.lora.lora_dropout=0 (or model.lora_targets='attention')")


def freeze_upcasting_all_but_experts(llm: torch.nn.Module) -> None:
    """``prepare_model_for_kbit_training`` minus the float32 copy of the fused experts: the base frozen,
    half-precision weights of fewer than 3 dimensions (norms, router, embeddings, head) in float32.
    (Activation checkpointing and input gradients are already on: ``SupervisedFinetune`` sets them.)"""
    for param in llm.parameters():
        param.requires_grad_(False)
        if param.dtype in (torch.float16, torch.bfloat16) and param.dim() < 3 \
                and type(param).__name__ != "Params4bit":
            param.data = param.data.float()


def _suffix(name: str) -> str:
    """A module's name as a target: its parent's leaf and its own (``'self_attn.q_proj'``)."""
    return ".".join(name.split(".")[-2:])


def chosen_targets(llm: torch.nn.Module, which: str) -> tuple[list[str], list[str] | None]:
    """``(target_modules, target_parameters)`` for ``which`` of ``LORA_TARGETS``.

    Tiny Qwen3-MoE, 'all' -> (['self_attn.k_proj', ..., 'self_attn.v_proj'],
                              ['experts.down_proj', 'experts.gate_up_proj'])
    """
    if which not in LORA_TARGETS:
        raise ConfigBuildError(f"model.lora_targets must be one of {LORA_TARGETS}, got {which!r}")
    if not moe.is_moe(llm):
        if which == "experts":
            raise ConfigBuildError(f"model.lora_targets='experts': {type(llm).__name__} has no experts (it is "
                                   "not a mixture-of-experts model); use 'all' or 'attention'")
        if which == "all":
            return default_targets(llm), None
    head = llm.get_output_embeddings() if hasattr(llm, "get_output_embeddings") else None
    router_names = tuple(name + "." for name, _ in moe.routers(llm))
    blocks = tuple(name + "." for name in moe.moe_blocks(llm))
    attention = tuple(name + "." for name in attention_modules(llm))
    prefix = language_model_prefix(llm)  # a vision-language model: its language model only
    wanted = {"all": lambda n: True, "attention": lambda n: n.startswith(attention),
              "experts": lambda n: n.startswith(blocks)}[which]
    # A one-output linear layer in an MoE block is a gate (Qwen2-MoE's shared_expert_gate), routing, not a projection.
    modules = sorted({_suffix(name) for name, module in llm.named_modules()
                      if isinstance(module, torch.nn.Linear) and module is not head and wanted(name)
                      and (prefix is None or name.startswith(prefix + ".")) and not name.startswith(router_names)
                      and not (name.startswith(blocks) and module.out_features == 1)})
    parameters = moe.fused_expert_parameters(llm) if which != "attention" else []
    return language_model_targets(llm, modules), (parameters or None)


def attention_modules(llm: torch.nn.Module) -> list[str]:
    """Names of the attention blocks, as the model records their outputs (``'attentions'``)."""
    kind = None
    for module in llm.modules():
        recorder = (getattr(module, "_can_record_outputs", None) or {}).get("attentions")
        if recorder is not None:
            kind = getattr(recorder, "target_class", recorder)
            break
    return [name for name, module in llm.named_modules() if kind is not None and isinstance(module, kind)]


def _matches(target: str, names: list[str]) -> bool:
    return any(name == target or name.endswith("." + target) for name in names)


def check_named_targets(llm: torch.nn.Module, lora_config: Any, lora_targets: str) -> None:
    """Each target the config names matches a module (``target_modules``) or parameter
    (``target_parameters``) of the model; else one line listing the closest names."""
    if lora_targets != "all":
        raise ConfigBuildError(f"model.lora_targets={lora_targets!r} chooses the targets, but model.lora names its "
                               "own (target_modules / target_parameters): keep one of the two")
    modules = [name for name, _ in llm.named_modules() if name]
    parameters = [name for name, _ in llm.named_parameters()]
    if lora_config.target_modules == "all-linear":  # peft's own shorthand
        return
    if isinstance(lora_config.target_modules, str):  # peft: a regular expression over full module names
        if not any(re.fullmatch(lora_config.target_modules, name) for name in modules):
            raise ConfigBuildError(f"model.lora.target_modules={lora_config.target_modules!r} matches no module "
                                   f"name of {type(llm).__name__} (e.g. {modules[-2]!r})")
        return
    for key, targets, names in (("target_modules", lora_config.target_modules or [], modules),
                                ("target_parameters", lora_config.target_parameters or [], parameters)):
        for target in targets:
            if not _matches(target, names):
                candidates = sorted({_suffix(n) for n in names} | {n.rsplit(".", 1)[-1] for n in names})
                close = difflib.get_close_matches(target, candidates, n=4, cutoff=0.4) or candidates[:4]
                raise ConfigBuildError(f"model.lora.{key}: {target!r} matches no {key.split('_')[1][:-1]} of "
                                       f"{type(llm).__name__}; closest names: {', '.join(close)}")


def target_summary(peft_llm: Any) -> str:
    """The targets the adapters sit on, for the run summary:
    ``'self_attn.q_proj, ... and the parameters experts.down_proj, experts.gate_up_proj'``."""
    config = peft_llm.peft_config[peft_llm.active_adapter]
    modules = config.target_modules
    if isinstance(modules, str):  # a pattern (a vision-language model's language model)
        text = f"the modules matching {modules!r}"
    else:
        text = ", ".join(sorted(modules or ()))
    if config.target_parameters:
        text += (" and " if text else "") + "the parameters " + ", ".join(sorted(config.target_parameters))
    return text


def default_targets(llm: torch.nn.Module) -> str | list[str]:
    """Every linear layer of the language model but its head (a vision-language model's vision tower
    and projector are left out: ``sfttool.model.vision``)."""
    if not is_vision_language(llm):
        return find_linear_names(llm)
    return language_model_targets(llm, find_linear_names(llm.get_decoder()))


def vision_language_targets(llm: torch.nn.Module, lora_config: Any, lora_targets: str, freeze_llm: bool,
                            lora_vision_tower: bool, train_projector: bool) -> None:
    """Set the targets of LoRA on a vision-language model: the language model's (``lora_targets``' choice)
    unless it is frozen, the vision tower's linear layers with ``lora_vision_tower``, and the projector
    trained whole beside the adapters (peft's ``modules_to_save``: saved with the adapter, merged by
    ``merge``) with ``train_projector``. Targets the config names itself are kept as they are."""
    tower, projector = vision_modules(llm)
    if lora_config.target_modules is None and not lora_config.target_parameters:
        patterns = []
        if not freeze_llm:
            modules, lora_config.target_parameters = chosen_targets(llm, lora_targets)
            patterns.append(modules)
        if lora_vision_tower:
            patterns.append(vision_tower_targets(llm, tower, projector))
        lora_config.target_modules = patterns[0] if len(patterns) == 1 else "|".join(f"(?:{p})" for p in patterns)
    elif freeze_llm or lora_vision_tower:
        raise ConfigBuildError("model.lora names its own target_modules: they decide where LoRA goes, so "
                               "model.freeze_llm / model.lora_vision_tower cannot; keep one of the two")
    if train_projector:
        lora_config.modules_to_save = sorted(set(lora_config.modules_to_save or ()) | set(projector))


def vision_tower_targets(llm: torch.nn.Module, tower: list[str], projector: list[str]) -> str:
    """A pattern for the linear layers of the vision tower, the projector inside it and the modules whose
    output the model never reads (``vision.unread_tower_modules``) left out.

    Qwen2.5-VL -> '(?:.*\\.)?model\\.visual\\.(?!(?:merger)\\.).*\\.(?:down_proj|gate_proj|proj|qkv|up_proj)'"""
    prefix = tower[0]
    left_out = projector + unread_tower_modules(llm)
    inside = [p[len(prefix) + 1:] for p in left_out if p.startswith(prefix + ".")]
    names = sorted({name.rsplit(".", 1)[-1] for name, module in llm.named_modules()
                    if isinstance(module, torch.nn.Linear) and name.startswith(prefix + ".")
                    and not any(name.startswith(p + ".") for p in left_out)})
    skip = f"(?!(?:{'|'.join(map(re.escape, inside))})\\.)" if inside else ""
    return rf"(?:.*\.)?{re.escape(prefix)}\.{skip}.*\.(?:{'|'.join(map(re.escape, names))})"


def load_adapter_folder(peft_llm: torch.nn.Module, path: str | os.PathLike) -> None:
    """Load a saved peft adapter (``adapter_model.safetensors``) into ``peft_llm``."""
    from peft import load_peft_weights, set_peft_model_state_dict

    result = set_peft_model_state_dict(peft_llm, load_peft_weights(str(path), device="cpu"))
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise ConfigBuildError(f"model.peft_model: {path} holds weights this adapter does not have, "
                               f"e.g. {unexpected[:3]}; was it trained with the same LoRA settings and base model?")


def add_frozen_copy(peft_llm: Any, name: str) -> None:
    """Add to ``peft_llm`` an adapter ``name`` holding a frozen copy of its active adapter's weights
    as they are now (e.g. the adapter a run continues from, kept as DPO's reference). The active
    adapter, and which parameters train, stay as they were."""
    source = peft_llm.active_adapter
    config = copy.deepcopy(peft_llm.peft_config[source])
    config.inference_mode = True  # peft freezes an adapter added in inference mode
    peft_llm.add_adapter(name, config)
    params = dict(peft_llm.named_parameters())
    with torch.no_grad():
        for key, param in params.items():
            if f".{name}." in key:
                param.copy_(params[key.replace(f".{name}.", f".{source}.")])
                param.requires_grad_(False)


@contextlib.contextmanager
def adapter_active(peft_llm: Any, name: str) -> Iterator[None]:
    """Run ``peft_llm`` with the adapter ``name`` instead of the active one. peft's ``set_adapter``
    also changes which adapter's parameters require gradients; every flag is put back afterwards,
    so the trained adapter keeps training."""
    before = peft_llm.active_adapter
    flags = [(param, param.requires_grad) for param in peft_llm.parameters()]
    peft_llm.set_adapter(name, inference_mode=True)
    try:
        yield
    finally:
        peft_llm.set_adapter(before)
        for param, flag in flags:
            param.requires_grad_(flag)
