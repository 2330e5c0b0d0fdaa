"""The error a map fn raises for a row it cannot convert."""

from sfttool.errors import SfttoolError


class MapFnError(SfttoolError, ValueError):
    """A raw row lacks a field or has one of the wrong type.

    The message names the field and the fix; the pipeline adds the file and row.
    """
