"""`sfttool check-custom-dataset`."""
from __future__ import annotations

import click


@click.command("check-custom-dataset")
@click.argument("config")
def check_custom_dataset(config) -> None:
    """Not available yet."""
    raise click.ClickException("`sfttool check-custom-dataset` is not available yet in this build")
