"""The `sfttool` command table. Each subcommand lives in its own module and
imports the rest of sfttool (and with it torch, transformers, mmengine) inside
its function, only when it runs: `sfttool --help` and the light commands start
in a fraction of a second."""
from __future__ import annotations

import click

from sfttool import __version__, compat
from sfttool.cli.check_dataset import check_custom_dataset
from sfttool.cli.chat import chat
from sfttool.cli.configs import copy_cfg, list_cfg
from sfttool.cli.convert import convert
from sfttool.cli.env import env, version
from sfttool.cli.plot import plot
from sfttool.cli.process_dataset import process_dataset
from sfttool.cli.score import score
from sfttool.cli.train import train


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="sfttool")
def cli() -> None:
    """Config-driven supervised fine-tuning of large language models."""
    compat.quiet_library_noise()  # every subcommand: the dependencies' start-up noise, filtered at its source


for command in (list_cfg, copy_cfg, train, check_custom_dataset, process_dataset,
                convert, chat, plot, score, version, env):
    cli.add_command(command)


if __name__ == "__main__":
    cli()
