"""Pre-flight checks and safe writes for a training run.

- ``check_work_dir_writable``: fail before anything is built when the run
  could not save its checkpoints.
- Safe writes (checkpoints, dataset cache) live in ``sfttool.utils.atomic``;
  their ``CheckpointSaveError`` is shown by the CLI as one line.
- ``apply_trust_remote_code``: ``trust_remote_code`` is off unless the config
  or ``--trust-remote-code`` asks for it.
- ``report_rank_failure``: a failing rank says who it is before it dies.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

from sfttool.utils.atomic import _os_error_text
from sfttool.errors import SfttoolError


class WorkDirError(SfttoolError, OSError):
    """The work dir cannot hold the run's outputs."""



def check_work_dir_writable(work_dir: str | os.PathLike, need_bytes: int = 0, keep: bool = True) -> Path:
    """Create ``work_dir`` if needed and prove a file can be written, synced and removed there.

    ``need_bytes`` (e.g. one checkpoint's size) is also checked against the free space.
    ``keep=False``: the folders this call created are removed again afterwards.

    >>> check_work_dir_writable('/tmp/run1')
    PosixPath('/tmp/run1')
    """
    path = Path(work_dir).expanduser()
    fix = "choose another folder with --work-dir, or fix its permissions / free some space"
    created = [p for p in (path, *path.parents) if not p.exists()]  # deepest first
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=path)
        try:
            os.write(fd, b"sfttool write probe\n" * 64)
            os.fsync(fd)
        finally:
            os.close(fd)
            os.remove(probe)
    except OSError as exc:
        raise WorkDirError(f"work dir {path} is not writable: {_os_error_text(exc)}; {fix}") from None
    free = shutil.disk_usage(path).free
    if not keep:
        for folder in created:  # empty: the probe file is gone
            folder.rmdir()
    if need_bytes and free < need_bytes:
        raise WorkDirError(f"work dir {path} has {free / 2**20:.0f} MiB free but one checkpoint needs about "
                           f"{need_bytes / 2**20:.0f} MiB; {fix}")
    return path


def checkpoint_bytes_estimate(model: Any, optimizer_states_per_param: int = 2) -> int:
    """Rough size of one checkpoint: the saved state dict plus fp32 optimizer moments
    (AdamW keeps two) for every trainable parameter."""
    state = sum(t.numel() * t.element_size() for t in model.state_dict().values() if hasattr(t, "numel"))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return state + trainable * 4 * optimizer_states_per_param


# --------------------------------------------------------------------------
# trust_remote_code: executing a model repository's Python code is opt-in.

def _loads_pretrained(node: dict) -> bool:
    type_ = node.get("type")
    name = type_ if isinstance(type_, str) else getattr(type_, "__qualname__", "") or ""
    return name.endswith("from_pretrained") or "pretrained_model_name_or_path" in node


def _pretrained_nodes(node: Any, key: str = "") -> Iterator[tuple[str, dict]]:
    if isinstance(node, dict):
        if "type" in node and _loads_pretrained(node):
            yield key or "<root>", node
        for k, v in node.items():
            yield from _pretrained_nodes(v, f"{key}.{k}" if key else str(k))
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            yield from _pretrained_nodes(v, f"{key}[{i}]")


def apply_trust_remote_code(cfg: Any, trust_remote_code: bool = False) -> list[str]:
    """Make every ``from_pretrained`` node of ``cfg`` say whether remote code may run.

    Without the flag, nodes that do not mention it get ``trust_remote_code=False``
    (transformers' default, made explicit); with it, every node gets True.
    Returns the key paths where remote code is allowed, for a warning:

    >>> apply_trust_remote_code({'llm': {'type': 'AutoModelForCausalLM.from_pretrained'}}, True)
    ['llm']
    """
    allowed = []
    # An mmengine Config is not a dict; its top-level values are (live) ConfigDicts.
    roots = cfg if isinstance(cfg, dict) else {k: cfg[k] for k in cfg.keys()}
    for key, node in _pretrained_nodes(roots):
        if trust_remote_code:
            node["trust_remote_code"] = True
        else:
            node.setdefault("trust_remote_code", False)
        if node["trust_remote_code"] is True:
            allowed.append(key)
    return allowed


def remote_code_warning(keys: list[str]) -> str:
    return ("trust_remote_code is on for " + ", ".join(keys) + ": Python code shipped with those model "
            "repositories will run on this machine with your permissions. Use it only for repositories "
            "you trust, and pin a revision.")


# --------------------------------------------------------------------------
# A failing rank names itself; the launcher (torchrun) stops the others.

@contextlib.contextmanager
def report_rank_failure() -> Iterator[None]:
    """In a multi-process run, print ``[sfttool] rank R of W failed: <error>`` to
    stderr before the exception ends the process (its traceback follows, from
    Python). The first such line is the root cause; the other ranks then fail
    on the broken collective, or are stopped by torchrun, whose summary also
    names the first failing rank."""
    try:
        yield
    except BaseException as exc:
        rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
        if rank is not None and world not in (None, "1") and not isinstance(exc, (KeyboardInterrupt, SystemExit)):
            first_line = (str(exc).splitlines() or [""])[0]
            sys.stderr.write(f"[sfttool] rank {rank} of {world} failed: {type(exc).__name__}: {first_line}\n")
            sys.stderr.flush()
        raise
