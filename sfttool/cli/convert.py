"""`sfttool convert pth_to_hf | merge`."""
from __future__ import annotations

import click


@click.group()
def convert() -> None:
    """Convert checkpoints and merge adapters."""
