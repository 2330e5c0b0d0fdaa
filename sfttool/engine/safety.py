"""Pre-flight checks and safe writes for a training run.

- ``check_work_dir_writable``: fail before anything is built when the run
  could not save its checkpoints.
- ``reported_save`` / ``before_rename`` / ``atomic_output``: write a file or
  folder next to its final name, flush it, then rename it into place; on
  failure remove the partial output and raise ``CheckpointSaveError`` naming
  the path and the OS error. A reader never sees a half-written checkpoint or
  dataset cache, and the previous ones are never touched. (The checkpoint
  hook and the dataset cache use the first two around their own writers.)
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
import time
from pathlib import Path
from typing import Any, Iterator

# Test-only fault injection: when set to a file path, `before_rename` creates
# that file once the temporary output is complete, then sleeps before the
# rename, so a test can kill -9 the process at exactly that point. With
# PAUSE_MATCH_ENV set, only a save whose final name contains it pauses.
PAUSE_BEFORE_RENAME_ENV = "SFTTOOL_FAULT_PAUSE_BEFORE_RENAME"
PAUSE_MATCH_ENV = "SFTTOOL_FAULT_PAUSE_MATCH"

TMP_MARK = ".tmp-"   # partial outputs are named '.<final name>.tmp-<pid>'


class WorkDirError(OSError):
    """The work dir cannot hold the run's outputs."""


class CheckpointSaveError(OSError):
    """A checkpoint could not be written; the previous ones are intact."""


def _register_user_errors() -> None:
    # Shown by the CLI as one line without a traceback: the message is the fix.
    from sfttool.cli.errors import register_user_error

    for exc_type in (WorkDirError, CheckpointSaveError):
        register_user_error(exc_type)


_register_user_errors()


def _os_error_text(exc: OSError) -> str:
    return f"[Errno {exc.errno}] {exc.strerror}" if exc.errno and exc.strerror else str(exc)


def check_work_dir_writable(work_dir: str | os.PathLike, need_bytes: int = 0) -> Path:
    """Create ``work_dir`` if needed and prove a file can be written, synced and removed there.

    ``need_bytes`` (e.g. one checkpoint's size) is also checked against the free space.

    >>> check_work_dir_writable('/tmp/run1')
    PosixPath('/tmp/run1')
    """
    path = Path(work_dir).expanduser()
    fix = "choose another folder with --work-dir, or fix its permissions / free some space"
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


def _fsync_dir(path: Path) -> None:
    # The rename itself must reach the disk, or a crash can bring the old name back.
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _fsync_tree(path: Path) -> None:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for file in files:
        with open(file, "rb+") as f:
            os.fsync(f.fileno())


def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()


def _pause_for_fault_test(tmp: Path, final: Path) -> None:
    marker = os.environ.get(PAUSE_BEFORE_RENAME_ENV)
    if not marker or os.path.exists(marker) or os.environ.get(PAUSE_MATCH_ENV, "") not in final.name:
        return
    Path(marker).write_text(str(tmp))       # pauses once: the marker now exists
    time.sleep(float(os.environ.get("SFTTOOL_FAULT_PAUSE_SECONDS", "600")))


def _replace(tmp: Path, path: Path) -> None:
    if tmp.is_dir() and path.is_dir():
        # os.replace cannot overwrite a non-empty folder: move the old one aside first.
        old = path.with_name(f".{path.name}.old-{os.getpid()}")
        os.replace(path, old)
        os.replace(tmp, path)
        _remove(old)
    else:
        os.replace(tmp, path)


def partial_output_name(path: str | os.PathLike) -> Path:
    path = Path(path)
    return path.with_name(f".{path.name}{TMP_MARK}{os.getpid()}")


def is_partial_output(path: str | os.PathLike) -> bool:
    """True for the temporary names ``atomic_output`` writes to (never a complete checkpoint)."""
    name = Path(path).name
    return name.startswith(".") and TMP_MARK in name


@contextlib.contextmanager
def reported_save(final: str | os.PathLike, partial: str | os.PathLike, what: str = "checkpoint") -> Iterator[None]:
    """Around a save that writes ``partial`` and then renames it to ``final``:
    an OS error (disk full, permission, I/O) removes ``partial`` and becomes a
    ``CheckpointSaveError`` naming ``final`` and the error; other exceptions
    pass through unchanged (after removing ``partial``).

    >>> with reported_save('/w/iter_8.pth', '/w/iter_8.pth.tmp'):
    ...     torch.save(state, '/w/iter_8.pth.tmp'); before_rename(...); os.replace(...)
    """
    final, partial = Path(final), Path(partial)
    try:
        yield
    except CheckpointSaveError:
        _remove(partial)
        raise
    except OSError as exc:
        _remove(partial)
        raise CheckpointSaveError(
            f"could not save {what} {final}: {_os_error_text(exc)}. Nothing was replaced: earlier "
            f"checkpoints in {final.parent} are intact and --resume uses the newest of them. "
            f"Free some space or choose another --work-dir, then resume.") from exc
    except BaseException:
        _remove(partial)
        raise


def before_rename(partial: str | os.PathLike, final: str | os.PathLike) -> None:
    """Flush ``partial`` (file or folder) to disk before it is renamed to ``final``,
    so the new name never points at data still in the page cache after a crash.
    Also the test-only pause point (``SFTTOOL_FAULT_PAUSE_BEFORE_RENAME``)."""
    partial, final = Path(partial), Path(final)
    _fsync_tree(partial)
    _pause_for_fault_test(partial, final)


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike, what: str = "checkpoint") -> Iterator[Path]:
    """Yield a temporary path next to ``path``; when the block succeeds, sync it and
    rename it to ``path`` (file or folder). On any OS error the partial output is
    removed and ``CheckpointSaveError`` names the path and the error.

    >>> with atomic_output('/w/iter_10.pth') as tmp:
    ...     torch.save(state, tmp)      # /w/.iter_10.pth.tmp-<pid>, renamed on success
    """
    path = Path(path)
    tmp = partial_output_name(path)
    _remove(tmp)
    with reported_save(path, tmp, what):
        yield tmp
        before_rename(tmp, path)
        _replace(tmp, path)
        _fsync_dir(path.parent)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Replace a small text file (e.g. a `last_checkpoint` pointer) atomically."""
    with atomic_output(path, what="file") as tmp:
        Path(tmp).write_text(text)


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
