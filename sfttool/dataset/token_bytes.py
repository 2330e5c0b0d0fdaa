"""How many bytes of the text each token id stands for, where a tokenizer says so exactly.

A byte-level BPE tokenizer (GPT-2's scheme: Qwen, Llama 3, SmolLM, Mistral's Tekken, ...) writes each
byte of the text as one character of its vocabulary, so a token's byte length is the length of its
vocabulary string, and an added token's is its text's. The tokens of a text then lie end to end over
its UTF-8 bytes, and their positions follow from the ids alone: the chat-template encoder finds the
trained tokens this way instead of asking the tokenizer for every token's character offsets (which cost
it about 15 % more than the ids, and as many Python tuples as tokens).

That holds only where the text reaches the tokens unchanged, so ``byte_lengths`` is None unless the
tokenizer has a BPE model with a byte-level decoder, no normalizer but NFC (the encoder checks each text
is NFC already), no added token that swallows the spaces beside it (``lstrip``/``rstrip``), and no
post-processor that trims whitespace off the offsets (which the encoder's offsets path would see). The
encoder also checks that each text's tokens add up to its bytes.
"""
from __future__ import annotations

import json
from typing import Any

import numpy as np

_CACHE: dict[int, tuple[Any, np.ndarray | None]] = {}  # id(backend) -> (backend, lengths): kept alive, ids stay unique


def byte_lengths(tokenizer: Any) -> np.ndarray | None:
    """``[vocabulary]`` int64: the bytes each id stands for; None where that is not exact (see above)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    cached = _CACHE.get(id(backend))
    if cached is None or cached[0] is not backend:
        cached = _CACHE[id(backend)] = (backend, _byte_lengths(backend))
    return cached[1]


def needs_nfc(tokenizer: Any) -> bool:
    """The tokenizer normalizes to NFC (Qwen's do): a text not already NFC changes on its way to the tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return type(getattr(backend, "normalizer", None)).__name__ == "NFC"


def _byte_lengths(backend: Any) -> np.ndarray | None:
    spec = json.loads(backend.to_str())
    if spec.get("model", {}).get("type") != "BPE" or not _has_type(spec.get("decoder"), "ByteLevel"):
        return None
    if (spec.get("normalizer") or {"type": "NFC"}).get("type") != "NFC" or _trims_offsets(spec.get("post_processor")):
        return None
    added = spec.get("added_tokens") or []
    if any(token.get("lstrip") or token.get("rstrip") for token in added):
        return None
    vocab = spec["model"]["vocab"]
    lengths = np.zeros(max([*vocab.values(), *(t["id"] for t in added), -1]) + 1, np.int64)
    for text, token_id in vocab.items():
        lengths[token_id] = len(text)  # one vocabulary character per byte
    for token in added:
        lengths[token["id"]] = len(token["content"].encode("utf-8"))
    return lengths


def _has_type(component: Any, name: str) -> bool:
    """``component`` (a tokenizer.json part) is of type ``name`` or a Sequence holding one."""
    if not isinstance(component, dict):
        return False
    parts = component.get("decoders") or component.get("processors") or component.get("pretokenizers")
    return component.get("type") == name or any(_has_type(part, name) for part in parts or [])


def _trims_offsets(component: Any) -> bool:
    if not isinstance(component, dict):
        return False
    parts = component.get("processors") or []
    return (component.get("type") == "ByteLevel" and bool(component.get("trim_offsets"))) or any(
        _trims_offsets(part) for part in parts)
