"""Vision-language checkpoints (image-text-to-text classes: Qwen2.5-VL, Qwen3-VL, LLaVA, Gemma 3, ...)
trained on text and image-text rows.

Such a model is a vision tower and a projector beside a language model (``PARTS``). By default the
vision tower and projector are frozen and left out of LoRA's targets, so the export holds their weights
exactly as they were loaded; ``freeze_parts`` and the LoRA settings choose otherwise:

    model = dict(type=SupervisedFinetune, llm=dict(type=AutoModelForImageTextToText.from_pretrained, ...))

What is vision is found by structure, not by class name: every parameter outside the model's
``get_decoder()`` (the language model, its embeddings included) and its output head.

Models with multimodal rotary positions (Qwen2-VL's ``mrope``: one position per temporal, height and
width axis) take a packed batch's positions as four rows: the text positions, which mark where each
packed sample starts, then the three axes, which for text are the same positions
(``packed_position_ids``) and around images are what the model computes for each sample alone
(``multimodal_position_ids``).

Image-text batches carry the processor's image tensors (``IMAGE_KEYS``) for all images of the batch in
row order then token order; they go to the model as they are.

Models whose attention lets the tokens of one image see each other both ways (Gemma 3:
``attends_within_images``) take a packed batch with images with its attention masks built here, one per
layer type (``packed_image_attention_masks``): each sample's tokens see what they would with the sample
alone, and nothing of the other samples.
"""
from __future__ import annotations

import inspect
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


# Qwen2-VL, Qwen2.5-VL and Qwen3-VL keep their projector (the patch merger) inside the vision tower.
PROJECTOR_NAMES_IN_ENCODER = ("merger", "deepstack_merger_list")
PARTS = ("vision tower", "projector", "language model")


def vision_modules(llm: Any) -> tuple[list[str], list[str]]:
    """``(vision tower, projector)``: the qualified module names of each in the transformers model; both
    empty for a text-only model. The tower is transformers' image encoder (``get_encoder('image')``)
    less any projector inside it; the projector is what else lies outside the language model.

    Qwen2.5-VL -> (['model.visual'], ['model.visual.merger']);
    LLaVA -> (['model.vision_tower'], ['model.multi_modal_projector'])"""
    base = base_model(llm)
    params = vision_parameters(base)
    if not params:
        return [], []
    encoder = base.get_encoder(modality="image")
    tower = next((name for name, module in base.named_modules() if module is encoder and name), None)
    projector = set()
    for name in params:
        if tower and name.startswith(tower + "."):
            parts = name[len(tower) + 1:].split(".")
            hit = next((i for i, part in enumerate(parts) if part in PROJECTOR_NAMES_IN_ENCODER), None)
            if hit is not None:
                projector.add(".".join([tower, *parts[:hit + 1]]))
        else:
            projector.add(_outermost_vision_module(base, name, params))
    if tower is None:  # no encoder transformers knows of: all of it counts as the tower
        return sorted(projector), []
    return [tower], sorted(projector)


def _outermost_vision_module(base: Any, name: str, params: dict) -> str:
    """The outermost module holding parameter ``name`` whose parameters are all outside the language model."""
    ids = {id(p) for p in params.values()}
    parts = name.split(".")
    for k in range(1, len(parts)):
        prefix = ".".join(parts[:k])
        if all(id(p) in ids for p in base.get_submodule(prefix).parameters()):
            return prefix
    return ".".join(parts[:-1])


def part_parameters(llm: Any) -> dict[str, dict[str, torch.nn.Parameter]]:
    """The parameters of each of ``PARTS`` by name (adapters and trained copies inside a part included)."""
    base = base_model(llm)
    tower, projector = vision_modules(base)
    vision = vision_parameters(base)
    under = lambda name, prefixes: any(name.startswith(p + ".") for p in prefixes)  # noqa: E731
    return {"vision tower": {n: p for n, p in vision.items() if under(n, tower) and not under(n, projector)},
            "projector": {n: p for n, p in vision.items() if under(n, projector)},
            "language model": {n: p for n, p in base.named_parameters() if n not in vision}}


def trained_parts(llm: Any) -> dict[str, tuple[str, int]]:
    """Per part of a vision-language model: how it trains ('LoRA', 'full' or 'frozen') and its size
    (the model's own weights, adapters left out); {} for a text-only model. A part trained whole beside
    LoRA (peft's ``modules_to_save``) is 'full'."""
    if not is_vision_language(llm):
        return {}
    out = {}
    for part, params in part_parameters(llm).items():
        trained = [n for n, p in params.items() if p.requires_grad]
        mode = "LoRA" if any(".lora_" in n for n in trained) else "full" if trained else "frozen"
        out[part] = (mode, sum(p.numel() for n, p in params.items() if ".lora_" not in n
                               and ".modules_to_save." not in n))  # not peft's trained copy either
    return out


def freeze_parts(llm: Any, freeze_vision_tower: bool, freeze_projector: bool | None, freeze_llm: bool,
                 lora_vision_tower: bool = False) -> None:
    """Freeze the vision tower, projector and language model as asked (``freeze_projector=None``: as the
    tower). On a text-only model any of them asked to train, or the model asked to freeze, is an error."""
    if not is_vision_language(llm):
        asked = [f"{key}={value}" for key, value, default in (
            ("freeze_vision_tower", freeze_vision_tower, True), ("freeze_projector", freeze_projector, None),
            ("freeze_llm", freeze_llm, False), ("lora_vision_tower", lora_vision_tower, False)) if value != default and not (key == "freeze_projector" and value)]
        if asked:
            raise ConfigBuildError(f"model.{asked[0]}: {type(base_model(llm)).__name__} has no vision tower "
                                   "or projector to train or freeze; remove the setting")
        return
    freeze = {"vision tower": freeze_vision_tower, "language model": freeze_llm,
              "projector": freeze_vision_tower if freeze_projector is None else freeze_projector}
    unread = unread_tower_modules(llm)
    for part, params in part_parameters(llm).items():
        for name, p in params.items():
            if freeze[part] or any(name.startswith(module + ".") for module in unread):
                p.requires_grad_(False)


def unread_tower_modules(llm: Any) -> list[str]:
    """The qualified names of the vision tower's modules whose output the model never reads, so that nothing
    they compute reaches the loss: trained, they would get no gradient, and DDP stops on a trained parameter
    that took no part in the loss. They stay frozen and take no LoRA. Two kinds:

    - a pooling head (SigLIP's ``head``, built with ``vision_use_head``): image-text models read the tower's
      hidden states, not its pooled output (Gemma 3 puts its projector's output in its place);
    - for a model that reads the tower's hidden states at ``vision_feature_layer`` (LLaVA: -2), the encoder
      layers after the deepest one read, and the tower's ``post_layernorm`` (CLIP and SigLIP apply it to the
      pooled output or the last hidden state only, neither of which such a model reads)."""
    base = base_model(llm)
    unread = []
    for prefix in vision_modules(base)[0]:
        tower = base.get_submodule(prefix)
        for name, module in tower.named_modules():
            if getattr(module, "use_head", False) and isinstance(getattr(module, "head", None), torch.nn.Module):
                unread.append(".".join(part for part in (prefix, name, "head") if part))
        feature_layer = getattr(base.config, "vision_feature_layer", None)
        found = _encoder_layers(tower)
        if feature_layer is None or found is None:
            continue
        layers_name, layers = found
        # hidden_states[k] is the output of the first k layers (0: the embeddings), k < 0 counted from the end
        read = [k if k >= 0 else len(layers) + 1 + k
                for k in (feature_layer if isinstance(feature_layer, (list, tuple)) else [feature_layer])]
        unread += [f"{prefix}.{layers_name}.{i}" for i in range(max(read), len(layers))]
        unread += [f"{prefix}.{name}" for name, _ in tower.named_children() if name == "post_layernorm"]
    return unread


def _encoder_layers(tower: torch.nn.Module) -> tuple[str, torch.nn.ModuleList] | None:
    """``(name within the tower, layers)`` of a CLIP/SigLIP-style tower's encoder layers, or None."""
    for name, module in tower.named_modules():
        if name.endswith("encoder.layers") and isinstance(module, torch.nn.ModuleList):
            return name, module
    return None


def check_vision_settings(use_lora: bool, freeze_vision_tower: bool, freeze_projector: bool | None,
                          freeze_llm: bool, lora_vision_tower: bool) -> None:
    """The freeze switches and LoRA agree, and something trains."""
    if use_lora and not freeze_vision_tower:
        raise ConfigBuildError("model.freeze_vision_tower=False with model.lora: set model.lora_vision_tower=True "
                               "for LoRA on the vision tower, or lora=None to train it whole")
    if lora_vision_tower and not use_lora:
        raise ConfigBuildError("model.lora_vision_tower=True needs model.lora (LoRA settings); for full fine-tuning "
                               "of the vision tower set freeze_vision_tower=False instead")
    if use_lora and freeze_llm and not lora_vision_tower:
        raise ConfigBuildError("model.freeze_llm=True with model.lora: LoRA would adapt nothing; set "
                               "model.lora_vision_tower=True, or lora=None to train the projector alone")
    if not use_lora and freeze_llm and freeze_vision_tower and freeze_projector in (None, True):
        raise ConfigBuildError("model.freeze_llm=True with the vision tower and projector frozen: nothing trains; "
                               "set model.freeze_projector=False (e.g. LLaVA's pretraining stage)")


def quantization_skip_modules(cls: Any, config: Any) -> list[str]:
    """Modules a 4-bit load of a vision-language ``config`` keeps unquantized: the vision tower, the
    projector and the output head (bitsandbytes' ``llm_int8_skip_modules``; naming any replaces
    transformers' default of the head). Found on a weightless copy of the model (meta device)."""
    with torch.device("meta"):
        model = cls.from_config(config)
    tower, projector = vision_modules(model)
    head = model.get_output_embeddings()
    heads = [name for name, module in model.named_modules() if module is head and name]
    return sorted(set(tower + projector + heads))


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


# The processor outputs an image-text batch hands to the model: Qwen2-VL's patches [total_patches, C*T*P*P]
# and grids [n_images, 3]; LLaVA's pixels [n_images, 3, H, W] (LLaVA-NeXt adds image_sizes [n_images, 2]).
IMAGE_KEYS = ("pixel_values", "image_grid_thw", "image_sizes")


def image_inputs(data: dict) -> dict[str, torch.Tensor]:
    """The image tensors of a collated batch (``IMAGE_KEYS`` present in it); {} for a text batch."""
    return {key: data[key] for key in IMAGE_KEYS if data.get(key) is not None}


def placeholder_image(config: Any, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The smallest image input the vision tower takes, zeros, shaped as the processor gives it: Qwen2-VL's
    family one grid of ``merge x merge`` patches (one token after its merger), a fixed-size encoder (CLIP,
    SigLIP) one image at its size."""
    vision = config.vision_config
    merge = getattr(vision, "spatial_merge_size", None)
    if merge is not None:
        channels = getattr(vision, "in_channels", None) or getattr(vision, "in_chans", 3)
        width = channels * getattr(vision, "temporal_patch_size", 1) * vision.patch_size ** 2
        return {"pixel_values": torch.zeros(merge * merge, width, device=device, dtype=dtype),
                "image_grid_thw": torch.tensor([[1, merge, merge]], device=device)}
    size = vision.image_size
    size = (size, size) if isinstance(size, int) else tuple(size)
    return {"pixel_values": torch.zeros(1, getattr(vision, "num_channels", 3), *size, device=device, dtype=dtype)}


def placeholder_image_zero(llm: Any) -> torch.Tensor:
    """0, computed from the image features of ``placeholder_image``: its backward reaches the trained vision
    parameters through the operations a real image's does, so in the same order whatever the run's
    autocast or kernels make of them (a sum of the parameters themselves reaches a linear layer's bias
    before its weight, where bf16 autocast's image path reaches the weight first)."""
    base = base_model(llm)
    vision = next(iter(vision_parameters(base).values()))
    inputs = placeholder_image(base.config, vision.device, vision.dtype)
    # LLaVA's family reads the feature layer and selection from its config only in forward.
    for key in ("vision_feature_layer", "vision_feature_select_strategy"):
        if getattr(base.config, key, None) is not None:
            inputs[key] = getattr(base.config, key)
    features = base.get_image_features(**inputs)
    features = getattr(features, "pooler_output", features)
    features = [features] if isinstance(features, torch.Tensor) else features
    return sum(f.float().sum() for f in features) * 0.0


def multimodal_decoder(llm: Any) -> Any:
    """The module that turns ``input_ids`` and the image tensors into the language model's last hidden
    states (an image-text-to-text class's ``model``: vision tower, projector and language model), or None
    for a text-only model. The chunked loss runs it in place of ``get_decoder()``, which sees text only."""
    base = base_model(llm)
    if not is_vision_language(base):
        return None
    inner = getattr(base, getattr(base, "base_model_prefix", ""), None)
    return inner if isinstance(inner, torch.nn.Module) and inner is not base else None


def token_types(config: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """``[batch, seq]`` ids -> ``[batch, seq]`` modality of each token as the processor's
    ``mm_token_type_ids`` gives it: 0 text, 1 image, 2 video."""
    types = torch.zeros_like(input_ids)
    for kind, name in ((1, "image_token_id"), (2, "video_token_id")):
        token = getattr(config, name, None)
        if token is not None:
            types = types.masked_fill(input_ids == token, kind)
    return types


def attends_within_images(llm: Any) -> bool:
    """Whether the model's own mask lets the tokens of one image attend to each other both ways: Gemma 3's
    ``create_masks_for_generate`` (the hook generate builds its masks with) reads the processor's
    ``token_type_ids`` (1 on image tokens) for that. Found from the hook's arguments; tested on Gemma 3."""
    base = base_model(llm)
    hook = getattr(base, "create_masks_for_generate", None)
    return is_vision_language(base) and hook is not None and "token_type_ids" in inspect.signature(hook).parameters


def image_blocks(config: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """``[batch, seq]`` ids -> ``[batch, seq]`` the number of each image token's image in its row (a run of
    image tokens is one image), -1 for other tokens: the blocks Gemma 3 reads from ``token_type_ids``.

    >>> image_blocks(type('C', (), {'image_token_id': 9})(), torch.tensor([[1, 9, 9, 2, 9, 3]])).tolist()
    [[-1, 0, 0, -1, 1, -1]]
    """
    is_image = token_types(config, input_ids) == 1
    starts = is_image & ~torch.nn.functional.pad(is_image, (1, 0))[:, :-1]
    return torch.where(is_image, starts.long().cumsum(1) - 1, -1)


def packed_image_attention_masks(llm: Any, input_ids: torch.Tensor, position_ids: torch.Tensor) -> dict[str, Any]:
    """The attention masks of a batch with images for a model that ``attends_within_images``, by layer type,
    as its forward takes them (``attention_mask={'full_attention': ..., 'sliding_attention': ...}``): a
    token sees the earlier tokens of its own packed sample (``position_ids`` restart at 0 at each) and all
    tokens of its own image; on sliding-window layers only within the window. This is Gemma 3's mask for one
    sample, AND(window, OR(causal, same image)), with each sample kept to itself.

    transformers 5.25 builds the sliding-window mask of a packed row with ``token_type_ids`` from each
    token's position within its sample, so past the first sample it reads the image of another token;
    built here from token indices (no ``position_ids`` given to the mask), it needs no such lookup."""
    from transformers.masking_utils import (and_masks, blockwise_overlay, create_causal_mask,
                                            find_packed_sequence_indices, packed_sequence_mask_function,
                                            sliding_window_overlay)

    base = base_model(llm)
    text = base.config.get_text_config()
    samples = find_packed_sequence_indices(position_ids)  # [batch, seq] sample of each token; None: one per row
    same_sample = None if samples is None else packed_sequence_mask_function(samples)
    embeds = torch.empty((*input_ids.shape, 0), dtype=base.dtype, device=input_ids.device)  # shape and dtype only
    common = dict(config=text, inputs_embeds=embeds, attention_mask=None, cache=None, position_ids=None,
                  or_mask_function=blockwise_overlay(image_blocks(base.config, input_ids)))
    masks = {}
    for kind in dict.fromkeys(getattr(text, "layer_types", None) or ["full_attention"]):
        if kind == "full_attention":
            within = same_sample
        elif kind == "sliding_attention":
            window = sliding_window_overlay(text.sliding_window)
            within = window if same_sample is None else and_masks(window, same_sample)
        else:
            raise ValueError(f"{type(base).__name__} has {kind!r} layers: packed rows with images are masked "
                             "for full and sliding-window attention layers only")
        masks[kind] = create_causal_mask(**common, and_mask_function=within)
    return masks


def multimodal_position_ids(llm: Any, input_ids: torch.Tensor, position_ids: torch.Tensor,
                            image_grid_thw: torch.Tensor | None) -> torch.Tensor:
    """``[batch, seq]`` packed ids and text positions -> ``[4, batch, seq]`` positions: the text positions,
    then for each packed sample the model's own ``get_rope_index`` of that sample alone (what it computes
    when the sample is its whole input). ``image_grid_thw`` [n_images, 3] lists the batch's images in row
    order then token order; a sample takes as many as cover its image tokens.

    Two samples [text, image of grid (1, 2, 2), text] packed -> row 0: 0 1 2 | 0 1 2 (one merged image
    token) ..., rows 1-3: each sample's own 3-D positions."""
    positions = packed_position_ids(position_ids)
    if image_grid_thw is None:
        return positions
    base = base_model(llm)
    model = getattr(base, "model", base)  # get_rope_index lives on the multimodal model
    merge = base.config.vision_config.spatial_merge_size
    types = token_types(base.config, input_ids)
    positions, grids = positions.clone(), iter(image_grid_thw)
    for row in range(input_ids.shape[0]):
        starts = (position_ids[row] == 0).nonzero().flatten().tolist() + [input_ids.shape[1]]
        for start, end in zip(starts, starts[1:]):
            wanted, own = int((types[row, start:end] == 1).sum()), []
            while wanted > 0:
                grid = next(grids, None)
                if grid is None:
                    raise ValueError("the batch has more image tokens than image_grid_thw covers")
                own.append(grid)
                wanted -= int(grid.prod()) // merge ** 2
            if wanted < 0:
                raise ValueError(f"row {row}: image_grid_thw does not match the image tokens of the sample "
                                 f"at position {start} (an image split between samples)")
            if own:
                rope, _ = model.get_rope_index(input_ids[row:row + 1, start:end],
                                               mm_token_type_ids=types[row:row + 1, start:end],
                                               image_grid_thw=torch.stack(own))
                positions[1:, row, start:end] = rope[:, 0]
    return positions


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
