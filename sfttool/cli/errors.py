"""Turn sfttool's user-facing exceptions into one-line CLI errors (exit 1)."""
from __future__ import annotations

import functools

import click

from sfttool.config.loader import ConfigError
from sfttool.dataset.errors import DatasetError  # bad data found by any command (train, check, process)
from sfttool.registry import ConfigBuildError
from sfttool.utils.atomic import CheckpointSaveError  # a failed save (disk full) during train or process

USER_ERRORS: tuple[type[BaseException], ...] = (ConfigError, ConfigBuildError, FileNotFoundError, DatasetError,
                                                CheckpointSaveError)


def register_user_error(exc_type: type[BaseException]) -> None:
    """Let a module declare an exception type whose message is meant for users."""
    global USER_ERRORS
    if exc_type not in USER_ERRORS:
        USER_ERRORS = USER_ERRORS + (exc_type,)


def user_errors(fn):
    """Print user-facing errors without a traceback and exit non-zero."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except USER_ERRORS as exc:
            raise click.ClickException(str(exc)) from None
    return wrapper
