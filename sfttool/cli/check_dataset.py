"""`sfttool check-custom-dataset CONFIG`."""
from __future__ import annotations

import sys

import click

from sfttool.cli.errors import user_errors
from sfttool.cli.options import CFG_OPTIONS_CONTEXT, cfg_options_option


@click.command("check-custom-dataset", context_settings=CFG_OPTIONS_CONTEXT)
@click.argument("config")
@cfg_options_option
@click.option("--max-errors", type=click.IntRange(min=1), default=10, show_default=True,
              help="How many bad rows to list before summarising the rest.")
@click.option("--color/--no-color", default=None,
              help="Dim masked text instead of wrapping it in [MASKED:...] (default: when printing to a terminal).")
@click.option("--skip-bad-rows", is_flag=True, default=False,
              help="As `sfttool train --skip-bad-rows`: drop, counted, the rows whose trained answers the template "
                   "cannot render instead of reporting the first as an error.")
@click.option("--decode-images", is_flag=True, default=False,
              help="Image-text data: decode every image whole (slower), not only read its header, so a file cut "
                   "short is found before training.")
@user_errors
def check_custom_dataset(config, cfg_options, max_errors, color, skip_bad_rows, decode_images) -> None:
    """Build CONFIG's training dataset stage by stage, validate every row,
    show trained vs masked text and print statistics. Exits 1 on errors."""
    from sfttool.tools.check_dataset import check_dataset

    color = sys.stdout.isatty() if color is None else color
    code = check_dataset(config, list(cfg_options), max_errors=max_errors, echo=click.echo, color=color,
                         skip_bad_rows=skip_bad_rows, decode_images=decode_images)
    sys.exit(code)
