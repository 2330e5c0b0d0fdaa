"""`sfttool chat`."""
from __future__ import annotations

import click


@click.command("chat")
@click.argument("config")
def chat(config) -> None:
    """Not available yet."""
    raise click.ClickException("`sfttool chat` is not available yet in this build")
