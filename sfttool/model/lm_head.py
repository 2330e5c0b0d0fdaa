"""Split a causal LM into its decoder (hidden states) and its output head,
so the loss can apply the head chunk by chunk (``sfttool.model.chunked_loss``).

Detected by capability, not class name: the model (or the one peft wraps)
must offer ``get_decoder()`` and ``get_output_embeddings()``, and compute its
logits as ``head(decoder(...).last_hidden_state)`` with nothing in between.
Models that scale or soft-cap their logits (Gemma 2/3, Cohere, Granite, ...)
say so in their config; for them the loss keeps the full-logits path.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from sfttool.model.vision import multimodal_decoder

# Config fields of transformers models whose forward transforms the head's output.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "lm_head_multiplier",
                    "output_multiplier_scale")


@dataclass
class LMParts:
    decoder: torch.nn.Module  # input_ids (and images) -> last_hidden_state [batch, seq, hidden]
    head: torch.nn.Module  # hidden -> logits
    plain_linear: bool  # head(x) is exactly F.linear(x, head.weight, head.bias)


def split_lm(llm: Any) -> tuple[LMParts | None, str]:
    """``(parts, '')``, or ``(None, why)`` when the logits are not head(hidden states)."""
    base = llm.get_base_model() if hasattr(llm, "get_base_model") else llm  # a peft model's HF model
    if not (callable(getattr(base, "get_decoder", None)) and callable(getattr(base, "get_output_embeddings", None))):
        return None, f"{type(base).__name__} has no get_decoder()/get_output_embeddings()"
    # a vision-language model's decoder takes the images too (its get_decoder() is the text model alone)
    decoder, head = multimodal_decoder(base) or base.get_decoder(), base.get_output_embeddings()
    if decoder is base or head is None:
        return None, f"{type(base).__name__} has no separate decoder and output head"
    transforms = [name for name in LOGIT_TRANSFORMS if _config_value(base.config, name) not in (None, 1, 1.0)]
    if transforms:
        return None, f"{type(base).__name__} transforms its logits ({', '.join(transforms)})"
    plain = isinstance(head, torch.nn.Linear) and type(head).forward is torch.nn.Linear.forward
    return LMParts(decoder, head, plain), ""


def _config_value(config: Any, name: str) -> Any:
    value = getattr(config, name, None)
    if value is None and hasattr(config, "get_text_config"):
        value = getattr(config.get_text_config(), name, None)
    return value


@contextlib.contextmanager
def gathered(*params: torch.Tensor | None):
    """Make ZeRO-3 partitioned parameters whole for the block, once (not per
    chunk); a no-op for ordinary parameters.

    Inside DeepSpeed's forward, reading ``head.weight`` has already gathered it
    (DeepSpeed registers it as an external parameter of the running module and
    releases it with that module), so only parameters still partitioned are
    gathered here. Gradients computed meanwhile reach DeepSpeed's reduce hooks
    as usual when autograd accumulates them.
    """
    partitioned = [p for p in params if p is not None and getattr(p, "ds_status", None) is not None
                   and p.ds_status.name == "NOT_AVAILABLE"]
    if not partitioned:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None):
        yield


def is_partitioned(param: torch.Tensor) -> bool:
    """A DeepSpeed ZeRO-3 parameter: whole only inside its module's forward (or ``gathered``), so
    a function that needs it again in backward (``chunked_token_log_probs``) cannot use it."""
    return getattr(param, "ds_id", None) is not None
