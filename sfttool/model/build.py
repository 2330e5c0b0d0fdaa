"""Build the HF causal LM a config describes.

    llm = dict(type=AutoModelForCausalLM.from_pretrained,
               pretrained_model_name_or_path='Qwen/Qwen2.5-0.5B',
               dtype='bfloat16',                       # or torch.bfloat16, or 'torch.bfloat16'
               quantization_config=dict(type=BitsAndBytesConfig, load_in_4bit=True, ...))

What this adds to a plain ``build``: dtype strings (mmengine dumps
``torch.bfloat16`` as ``'torch.bfloat16'``) become torch dtypes, XTuner's
``torch_dtype`` becomes transformers 5's ``dtype``, a quantization dict becomes
a ``BitsAndBytesConfig``, a 4-bit model is placed on this process's device,
the attention backend is chosen, and the context can be stretched with linear
RoPE scaling (XTuner's ``max_position_embeddings``).
"""
from __future__ import annotations

import logging
import math
import os
from typing import Any

import torch

from sfttool.model.vision import quantization_skip_modules
from sfttool.registry import ConfigBuildError, build, resolve_type

logger = logging.getLogger(__name__)

DTYPE_KEYS = ("dtype", "torch_dtype", "bnb_4bit_compute_dtype", "bnb_4bit_quant_storage")


def to_torch_dtype(value: Any, key: str = "dtype") -> Any:
    """``'bfloat16'`` / ``'torch.bfloat16'`` / ``torch.bfloat16`` -> ``torch.bfloat16``;
    ``None`` and ``'auto'`` pass through."""
    if value is None or value == "auto" or isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        dtype = getattr(torch, value.removeprefix("torch."), None)
        if isinstance(dtype, torch.dtype):
            return dtype
    raise ConfigBuildError(f"{key}: unknown dtype {value!r}; use 'bfloat16', 'float16', 'float32' or a torch dtype")


def dtype_name(dtype: Any) -> str | None:
    """``'bfloat16'`` for 'bfloat16', 'torch.bfloat16' or torch.bfloat16; None when unset."""
    return None if dtype is None else str(dtype).replace("torch.", "")


def configured_dtype(model_cfg: Any) -> str | None:
    """The dtype the config loads the LLM in (``model.llm.dtype``, or transformers 4's ``torch_dtype``)."""
    llm = (model_cfg or {}).get("llm") if isinstance(model_cfg, dict) else None
    if not isinstance(llm, dict):
        return None
    return dtype_name(llm.get("dtype", llm.get("torch_dtype")))


def build_quantization_config(cfg: Any) -> Any:
    """A quantization dict (typed or not) -> its config object; objects pass through.

    dict(load_in_4bit=True, bnb_4bit_compute_dtype='torch.float32')
    -> BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32)
    """
    if not isinstance(cfg, dict):
        return cfg
    from transformers import BitsAndBytesConfig

    key = "model.llm.quantization_config"
    args = {k: (to_torch_dtype(v, f"{key}.{k}") if k in DTYPE_KEYS else v) for k, v in cfg.items() if k != "type"}
    cls = resolve_type(cfg.get("type", BitsAndBytesConfig), f"{key}.type")
    return cls(**args)


def default_attn_implementation(use_varlen_attn: bool) -> str:
    """SDPA by default: with ``position_ids`` restarting at 0, no attention
    mask and no KV cache, transformers 5 already keeps packed samples apart on
    it. Flash-attention 2 (varlen kernels, no wasted block-diagonal work) when
    varlen attention is asked for and this machine can run it."""
    from transformers.utils import is_flash_attn_2_available

    if not use_varlen_attn:
        return "sdpa"
    if torch.cuda.is_available() and is_flash_attn_2_available():
        return "flash_attention_2"
    logger.warning("use_varlen_attn=True but flash-attention 2 is not usable here; using SDPA, "
                   "which still isolates packed samples through position_ids (just without the speed-up)")
    return "sdpa"


def quantized_device_map() -> dict:
    """Where a bnb-quantized model must live: this rank's GPU, else the CPU
    (bitsandbytes >= 0.48 runs 4-bit on CPU)."""
    if torch.cuda.is_available():
        return {"": int(os.environ.get("LOCAL_RANK", 0))}
    return {"": "cpu"}


def extend_context(config: Any, max_position_embeddings: int) -> Any:
    """Linear RoPE scaling so the model covers ``max_position_embeddings``
    (XTuner semantics: factor = ceil(wanted / current context)).

    E.g. 4096 positions wanted of a 1024-position model -> linear factor 4.0.
    """
    rope = dict(getattr(config, "rope_parameters", None) or {})
    old_factor = float(rope.get("factor", 1.0))
    context = config.max_position_embeddings * old_factor
    if max_position_embeddings <= context:
        return config
    rope.update(rope_type="linear", factor=old_factor * math.ceil(max_position_embeddings / context))
    config.rope_parameters = rope
    return config


def normalise_llm_args(args: dict, use_varlen_attn: bool, max_position_embeddings: int | None,
                       model_class: Any = None) -> dict:
    """Fill and fix the keyword arguments of ``model_class.from_pretrained``."""
    args = dict(args)
    if "torch_dtype" in args:  # transformers 5 renamed it
        args.setdefault("dtype", args.pop("torch_dtype"))
    if "dtype" in args:
        args["dtype"] = to_torch_dtype(args["dtype"], "model.llm.dtype")
    if args.get("quantization_config") is not None:
        args["quantization_config"] = build_quantization_config(args["quantization_config"])
        args.setdefault("device_map", quantized_device_map())
        if model_class is not None:
            keep_vision_unquantized(model_class, args)
    args.setdefault("attn_implementation", default_attn_implementation(use_varlen_attn))
    if max_position_embeddings and args.get("pretrained_model_name_or_path"):
        from transformers import AutoConfig

        config = args.get("config") or AutoConfig.from_pretrained(
            args["pretrained_model_name_or_path"], trust_remote_code=args.get("trust_remote_code", False))
        args["config"] = extend_context(config, max_position_embeddings)
    return args


def keep_vision_unquantized(model_class: Any, args: dict) -> None:
    """QLoRA quantizes the language model only: a vision-language checkpoint's vision tower and projector
    (and its head) go in ``llm_int8_skip_modules`` unless the config names its own."""
    quantization = args["quantization_config"]
    path = args.get("pretrained_model_name_or_path")
    if getattr(quantization, "llm_int8_skip_modules", ()) is not None or path is None:
        return
    from transformers import AutoConfig

    config = args.get("config") or AutoConfig.from_pretrained(path, trust_remote_code=args.get("trust_remote_code", False))
    if getattr(config, "vision_config", None) is not None:
        quantization.llm_int8_skip_modules = quantization_skip_modules(model_class, config)


def build_llm(llm: Any, use_varlen_attn: bool = False, max_position_embeddings: int | None = None) -> Any:
    """Config dict -> loaded model; a module passes through unchanged."""
    if not isinstance(llm, dict):
        return llm
    fn = resolve_type(llm.get("type"), "model.llm.type")
    args = {k: v for k, v in llm.items() if k != "type"}
    if getattr(fn, "__name__", "") == "from_pretrained":
        args = normalise_llm_args(args, use_varlen_attn, max_position_embeddings, getattr(fn, "__self__", None))
    return build({"type": fn, **args}, "model.llm")


def resize_embeddings(llm: Any, tokenizer: Any) -> None:
    """Grow the embeddings when the tokenizer has tokens the model lacks; new
    rows start at the mean of the old ones (transformers' mean resizing)."""
    vocab = llm.get_input_embeddings().num_embeddings
    if len(tokenizer) > vocab:
        logger.info("resizing token embeddings %d -> %d to fit the tokenizer", vocab, len(tokenizer))
        llm.resize_token_embeddings(len(tokenizer))
