"""`sfttool process-dataset`."""
from __future__ import annotations

import click


@click.command("process-dataset")
@click.argument("config")
def process_dataset(config) -> None:
    """Not available yet."""
    raise click.ClickException("`sfttool process-dataset` is not available yet in this build")
