"""Checkpoint files, in one place: which one a work dir's pointers name (``find_latest_checkpoint``:
the one ``--resume`` continues; ``find_best_checkpoint``; ``run_config``, the config the run dumped)
and reading one (``load_checkpoint``: ``--resume``'s fit check, ``convert``, the best checkpoint's
export and ``model.peft_model``).

Below the engine, the tools and the model (all use it), so it imports none of them.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from sfttool import compat
from sfttool.errors import SfttoolError

_CKPT_RE = re.compile(r"^iter_(\d+)\.pth$")
BEST_POINTER = "best_checkpoint"  # beside last_checkpoint: the path of the save_best checkpoint


class CheckpointReadError(SfttoolError, ValueError):
    """A file torch cannot read as a checkpoint; the message is one line that names it and says why."""


def load_checkpoint(path: str | os.PathLike) -> Any:
    """A checkpoint file as ``--resume`` reads it: ``weights_only`` with sfttool's allow-list
    (``sfttool.compat.allow_mmengine_checkpoint_globals``), memory-mapped, so reading it costs
    little more than the tensors' headers until they are used."""
    import torch

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


def find_latest_checkpoint(work_dir: str | os.PathLike) -> Path | None:
    """The checkpoint ``work_dir/last_checkpoint`` names, when it is complete;
    else ``work_dir/iter_N.pth`` with the largest N (file or DeepSpeed folder).
    Unfinished ``.tmp`` saves are never considered.

    The pointer wins over the largest N: after ``--resume iter_100.pth`` in a
    folder that also holds an older run's ``iter_3000.pth``, the run continued
    is the one that wrote ``last_checkpoint``."""
    work_dir = Path(work_dir)
    named = _last_checkpoint(work_dir)
    if named is not None:
        return named
    best = None
    for path in work_dir.glob("iter_*.pth"):
        match = _CKPT_RE.match(path.name)
        if match and (best is None or int(match.group(1)) > best[0]):
            best = (int(match.group(1)), path)
    return best[1] if best else None


def _last_checkpoint(work_dir: Path) -> Path | None:
    """The complete ``iter_N.pth`` that ``work_dir/last_checkpoint`` names, or None.

    The hook writes the pointer only after the checkpoint is renamed into place,
    so a named checkpoint that exists is complete. The pointer holds an absolute
    path: in a work dir copied or moved elsewhere the same name here is meant."""
    try:
        named = Path((work_dir / "last_checkpoint").read_text().strip())
    except (OSError, UnicodeDecodeError):
        return None
    if not _CKPT_RE.match(named.name):
        return None
    for candidate in (work_dir / named.name, named):  # the second: a hook with its own out_dir
        if candidate.exists():
            return candidate
    return None


def find_best_checkpoint(work_dir: str | os.PathLike) -> Path | None:
    """The checkpoint ``work_dir/best_checkpoint`` names (``save_best``: the lowest ``val/loss``), when
    it exists (looked up in ``work_dir`` first: the pointer holds an absolute path)."""
    work_dir = Path(work_dir)
    try:
        named = Path((work_dir / BEST_POINTER).read_text().strip())
    except (OSError, UnicodeDecodeError):
        return None
    for candidate in (work_dir / named.name, named):
        if named.name and candidate.exists():
            return candidate
    return None


def run_config(work_dir: Path, meta: Any = None) -> Path | None:
    """The config ``sfttool train`` dumped in ``work_dir`` (it includes the run's --cfg-options):
    the ``*.py`` whose text is a checkpoint's ``meta['cfg']`` when that is given, else the only
    one (DeepSpeed also copies its ``zero_to_fp32.py`` / ``zero_to_torch.py`` there); None when
    it cannot tell."""
    configs = [p for p in sorted(work_dir.glob("*.py")) if not p.name.startswith("zero_to_")]
    text = meta.get("cfg") if isinstance(meta, dict) else None
    matching = [p for p in configs if text is not None and p.read_text(errors="replace") == text]
    if matching:
        return matching[0]
    return configs[0] if len(configs) == 1 else None
