"""The one base class for errors whose message is written for the user.

Every such error says where (file, row, field or config key) and how to fix it,
so the CLI prints it as one ``Error: ...`` line and exits 1, without a
traceback. A module declares a user-facing error by subclassing
``SfttoolError`` (next to a builtin base where callers catch that, e.g.
``ValueError``); nothing has to be registered with the CLI.
"""
from __future__ import annotations


class SfttoolError(Exception):
    """An error meant for the user: its message is the diagnosis and the fix."""
