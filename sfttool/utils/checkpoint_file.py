"""Reading a checkpoint file, in one place: ``--resume``'s fit check, ``convert``, the best
checkpoint's export and ``model.peft_model`` all load through ``load_checkpoint``.

Below the engine and the model (both use it), so it imports neither.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from sfttool.errors import SfttoolError


class CheckpointReadError(SfttoolError, ValueError):
    """A file torch cannot read as a checkpoint; the message is one line that names it and says why."""


def load_checkpoint(path: str | os.PathLike) -> Any:
    """A checkpoint file as ``--resume`` reads it: ``weights_only`` with sfttool's allow-list
    (``sfttool.compat.allow_mmengine_checkpoint_globals``), memory-mapped, so reading it costs
    little more than the tensors' headers until they are used."""
    import torch

    from sfttool import compat

    compat.allow_mmengine_checkpoint_globals()
    path = Path(path)
    try:
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # a file in torch's legacy (non-zip) format cannot be mapped
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch.load fails on other files in many ways (KeyError on text, EOFError, ...)
        raise CheckpointReadError(_unreadable(path, exc)) from None


def _unreadable(path: Path, exc: Exception) -> str:
    """One line for torch.load's failure (its own messages run to several paragraphs)."""
    if isinstance(exc, OSError):
        return f"{path}: cannot be read: {exc.strerror or exc}"
    refused = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
    if refused:
        return (f"{path}: holds objects outside the safe-loading allow-list ({refused.group(1)}); "
                "it was not written by `sfttool train`, or by a newer version")
    with open(path, "rb") as f:
        head = f.read(4)
    why = ("the file is empty" if not head else
           "a zip file torch cannot read: truncated or corrupt" if head == b"PK\x03\x04" else
           "torch.load cannot read it")
    return (f"{path}: not an sfttool/mmengine checkpoint ({why}); give an iter_<n>.pth file "
            "or DeepSpeed checkpoint folder from a training work dir")
