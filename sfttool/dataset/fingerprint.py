"""Fingerprints: what decides a processed dataset, hashed without pickling it.

``datasets`` fingerprints each ``map`` by pickling the function's arguments; a
tokenizer among them costs seconds per call. The pipeline hashes the tokenizer
once (``tokenizer_digest``) and passes ``new_fingerprint`` to each ``map``
(``stage_fingerprint``); the disk cache keys its folders with the same hashes.
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import json
from pathlib import Path
from typing import Any


def file_digest(path: str | Path) -> str:
    """sha256 of a file's content (streamed)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def describe(obj: Any) -> Any:
    """A JSON-able description of a config value that changes when its meaning does.

    >>> describe({'type': 'json', 'n': 1})
    {'n': 1, 'type': 'json'}
    """
    if isinstance(obj, dict):
        return {str(k): describe(v) for k, v in sorted(obj.items(), key=lambda kv: str(kv[0]))}
    if isinstance(obj, (list, tuple)):
        return [describe(v) for v in obj]
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    if isinstance(obj, functools.partial):
        return {"partial": describe(obj.func), "args": describe(list(obj.args)),
                "keywords": describe(dict(obj.keywords))}
    if callable(obj):
        return {"callable": f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', repr(obj))}",
                "source": _source_digest(obj)}
    if hasattr(obj, "_fingerprint"):  # a built datasets.Dataset
        return {"dataset_fingerprint": obj._fingerprint}
    return repr(obj)


def _source_digest(fn: Any) -> str | None:
    try:
        return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:16]
    except (OSError, TypeError):
        return None


def tokenizer_digest(tokenizer: Any) -> str:
    """Hash of what decides token ids: the backend tokenizer (vocab, merges,
    normalizer), special tokens and the chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    state = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    extra = json.dumps([type(tokenizer).__name__, tokenizer.bos_token_id, tokenizer.eos_token_id,
                        getattr(tokenizer, "chat_template", None), sorted(tokenizer.all_special_tokens)])
    return hashlib.sha256((state + extra).encode()).hexdigest()


def stage_fingerprint(previous: str, stage: str, *parts: Any) -> str:
    """The fingerprint of ``stage`` applied to a dataset fingerprinted ``previous`` with arguments
    ``parts`` (described by ``describe``; pass a tokenizer as its ``tokenizer_digest``)."""
    text = json.dumps([previous, stage, describe(list(parts))], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
