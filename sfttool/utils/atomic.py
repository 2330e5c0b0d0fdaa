"""Write a file or folder next to its final name, flush it, then rename it
into place: a reader never sees half of a checkpoint, a dataset cache or an
exported model, and what was there before is never touched. The one way
sfttool writes what a later run or tool reads (checkpoints and their
``last_checkpoint`` pointer, the dataset cache, the HF export of ``train``,
``convert`` and ``merge``), so it lives below all of them.

- ``atomic_output(path)``: the whole protocol as a context manager; give
  ``partial=`` for a writer that needs a fixed temporary name.
- ``atomic_write_text(path, text)``: a small text file.
- ``atomic_folder(folder)``: files written into a new or an existing folder
  (an HF model folder) appear all together.
- ``reported_save`` + ``publish``: the same split in two, for a save that
  several processes write and one renames (DeepSpeed checkpoints).

OS errors become ``CheckpointSaveError`` (or the caller's error class) naming
the path and the error, after the partial output is removed.
"""
from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Iterator

from sfttool.errors import SfttoolError

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


def discard(path: str | os.PathLike) -> None:
    """Remove a file or folder if it is there (a partial output, a checkpoint beyond max_keep_ckpts)."""
    path = Path(path)
    with contextlib.suppress(OSError):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()


def _replace(tmp: Path, path: Path) -> None:
    if tmp.is_dir() and path.is_dir():
        # os.replace cannot overwrite a non-empty folder: move the old one aside first.
        old = path.with_name(f".{path.name}.old-{os.getpid()}")
        os.replace(path, old)
        os.replace(tmp, path)
        discard(old)
    else:
        os.replace(tmp, path)


def partial_output_name(path: str | os.PathLike) -> Path:
    path = Path(path)
    return path.with_name(f".{path.name}{TMP_MARK}{os.getpid()}")


def is_partial_output(path: str | os.PathLike) -> bool:
    """True for the temporary names ``atomic_output`` writes to (never a complete checkpoint)."""
    name = Path(path).name
    return name.startswith(".") and TMP_MARK in name


def _save_failed(what: str, final: Path, exc: OSError) -> str:
    if what == "checkpoint":
        return (f"could not save checkpoint {final}: {_os_error_text(exc)}. Nothing was replaced: earlier "
                f"checkpoints in {final.parent} are intact and --resume uses the newest of them. "
                f"Free some space or choose another --work-dir, then resume.")
    return f"could not save {final}: {_os_error_text(exc)}; the partial output was removed"


@contextlib.contextmanager
def reported_save(final: str | os.PathLike, partial: str | os.PathLike, what: str = "checkpoint",
                  error: type[Exception] = CheckpointSaveError) -> Iterator[None]:
    """Around a save that writes ``partial`` and then renames it to ``final``:
    an OS error (disk full, permission, I/O) removes ``partial`` and becomes an
    ``error`` naming ``final`` and the error; other exceptions pass through
    unchanged (after removing ``partial``).

    >>> with reported_save('/w/iter_8.pth', '/w/iter_8.pth.tmp'):  # doctest: +SKIP
    ...     torch.save(state, '/w/iter_8.pth.tmp'); publish('/w/iter_8.pth.tmp', '/w/iter_8.pth')
    """
    final, partial = Path(final), Path(partial)
    try:
        yield
    except error:
        discard(partial)
        raise
    except OSError as exc:
        discard(partial)
        raise error(_save_failed(what, final, exc)) from exc
    except BaseException:
        discard(partial)
        raise


def publish(partial: str | os.PathLike, final: str | os.PathLike) -> None:
    """Rename the complete ``partial`` (file or folder) to ``final``, replacing what was there,
    after flushing it to disk; then flush the rename itself."""
    partial, final = Path(partial), Path(final)
    before_rename(partial, final)
    _replace(partial, final)
    _fsync_dir(final.parent)


def before_rename(partial: str | os.PathLike, final: str | os.PathLike) -> None:
    """Flush ``partial`` (file or folder) to disk before it is renamed to ``final``,
    so the new name never points at data still in the page cache after a crash.
    (Every save passes here between its write and its rename: the robustness tests
    pause a save here to kill the process at that point.)"""
    _fsync_tree(Path(partial))


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike, what: str = "checkpoint", partial: str | os.PathLike | None = None,
                  error: type[Exception] = CheckpointSaveError) -> Iterator[Path]:
    """Yield a temporary path next to ``path`` (``partial`` when given); when the block
    succeeds, sync it and rename it to ``path`` (file or folder). On any OS error the
    partial output is removed and ``error`` names the path and the error.

    >>> with atomic_output('/w/iter_10.pth') as tmp:  # doctest: +SKIP
    ...     torch.save(state, tmp)      # /w/.iter_10.pth.tmp-<pid>, renamed on success
    """
    path = Path(path)
    tmp = Path(partial) if partial is not None else partial_output_name(path)
    discard(tmp)
    with reported_save(path, tmp, what, error):
        yield tmp
        publish(tmp, path)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Replace a small text file (e.g. a `last_checkpoint` pointer) atomically."""
    with atomic_output(path, what="file") as tmp:
        Path(tmp).write_text(text)


@contextlib.contextmanager
def atomic_folder(folder: str | os.PathLike, error: type[Exception] = CheckpointSaveError,
                  stale=lambda name: False) -> Iterator[Path]:
    """A hidden folder to write into, next to ``folder`` (inside it when it already
    exists); when the block succeeds its files move into ``folder``: a new folder by
    one rename, an existing one file by file, keeping the files the save does not
    write except those ``stale(name)`` marks (e.g. weight shards of an earlier save,
    which would load as a mix with the new ones). On failure the partial output is
    removed and an OS error becomes one line of ``error``.

    >>> with atomic_folder('out/hf_model') as tmp:  # doctest: +SKIP
    ...     model.save_pretrained(tmp)
    """
    folder = Path(folder)
    if not folder.is_dir():
        with atomic_output(folder, what="folder", error=error) as tmp:
            tmp.mkdir(parents=True)
            yield tmp
        return
    tmp = folder / f".partial{TMP_MARK}{os.getpid()}"
    discard(tmp)
    with reported_save(folder, tmp, "folder", error):
        tmp.mkdir()
        yield tmp
        before_rename(tmp, folder)
        new = {item.name for item in tmp.iterdir()}
        for old in folder.iterdir():
            if old.is_file() and old.name not in new and stale(old.name):
                old.unlink()
        for item in tmp.iterdir():
            _replace(item, folder / item.name)
        discard(tmp)
        _fsync_dir(folder)
