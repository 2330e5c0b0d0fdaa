"""Fault injection for the kill -9 tests: a pause between an atomic save's write and its rename.

    python -m pause_before_rename train CONFIG ...     # `sfttool train CONFIG ...` with the pause armed

With ``SFTTOOL_FAULT_PAUSE_BEFORE_RENAME=<file>`` set, the first save to reach
``sfttool.utils.atomic.before_rename`` writes its temporary path into ``<file>`` and sleeps, so the
test can kill the process at exactly that point; ``SFTTOOL_FAULT_PAUSE_MATCH=<text>`` limits it to
saves whose final name contains ``<text>``. The package itself holds no test hook: this module wraps
its function from outside (``publish`` and ``atomic_folder`` look it up at each call).
"""
from __future__ import annotations

import os
import time
from pathlib import Path

PAUSE_BEFORE_RENAME_ENV = "SFTTOOL_FAULT_PAUSE_BEFORE_RENAME"
PAUSE_MATCH_ENV = "SFTTOOL_FAULT_PAUSE_MATCH"


def arm() -> None:
    """Wrap ``atomic.before_rename`` with the pause the environment asks for."""
    from sfttool.utils import atomic

    flush = atomic.before_rename

    def before_rename(partial, final) -> None:
        flush(partial, final)
        marker = os.environ.get(PAUSE_BEFORE_RENAME_ENV)
        if not marker or os.path.exists(marker) or os.environ.get(PAUSE_MATCH_ENV, "") not in Path(final).name:
            return
        Path(marker).write_text(str(partial))  # pauses once: the marker now exists
        time.sleep(float(os.environ.get("SFTTOOL_FAULT_PAUSE_SECONDS", "600")))

    atomic.before_rename = before_rename


if __name__ == "__main__":
    arm()
    from sfttool.cli.main import cli

    cli(prog_name="sfttool")
