"""Turn sfttool's user-facing exceptions into one-line CLI errors (exit 1)."""
from __future__ import annotations

import functools

import click

from sfttool.errors import SfttoolError

# A missing file named on the command line or in a config is the user's to fix too.
USER_ERRORS: tuple[type[BaseException], ...] = (SfttoolError, FileNotFoundError)


def user_errors(fn):
    """Print user-facing errors without a traceback and exit non-zero."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except USER_ERRORS as exc:
            raise click.ClickException(str(exc)) from None
    return wrapper
