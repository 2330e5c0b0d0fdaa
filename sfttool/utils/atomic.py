"""Write a file or folder next to its final name, flush it, then rename it
into place: a reader never sees half of a checkpoint or a dataset cache, and
what was there before is never touched. Used by the checkpoint hook and the
dataset cache, so it lives below both.

- ``atomic_output``: the whole protocol as a context manager.
- ``reported_save`` / ``before_rename``: the same around a writer that picks
  its own temporary name; OS errors become ``CheckpointSaveError`` naming the
  path and the error.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import time
from pathlib import Path
from typing import Iterator
from sfttool.errors import SfttoolError

# Test-only fault injection: when set to a file path, `before_rename` creates
# that file once the temporary output is complete, then sleeps before the
# rename, so a test can kill -9 the process at exactly that point. With
# PAUSE_MATCH_ENV set, only a save whose final name contains it pauses.
PAUSE_BEFORE_RENAME_ENV = "SFTTOOL_FAULT_PAUSE_BEFORE_RENAME"
PAUSE_MATCH_ENV = "SFTTOOL_FAULT_PAUSE_MATCH"

TMP_MARK = ".tmp-"   # partial outputs are named '.<final name>.tmp-<pid>'


class CheckpointSaveError(SfttoolError, OSError):
    """A checkpoint could not be written; the previous ones are intact."""


def _os_error_text(exc: OSError) -> str:
    return f"[Errno {exc.errno}] {exc.strerror}" if exc.errno and exc.strerror else str(exc)


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
