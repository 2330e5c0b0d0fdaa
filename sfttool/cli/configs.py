"""`sfttool list-cfg` and `sfttool copy-cfg`."""
from __future__ import annotations

import shutil
from pathlib import Path

import click

from sfttool.cli.errors import user_errors
from sfttool.config.loader import (ConfigError, builtin_config_dir, find_config,
                                   list_configs, list_deepspeed_presets)


@click.command("list-cfg")
@click.option("-p", "--pattern", default=None, help="Case-insensitive substring to filter names.")
def list_cfg(pattern: str | None) -> None:
    """List built-in configs and DeepSpeed presets."""
    configs = list_configs(pattern)
    presets = list_deepspeed_presets(pattern)
    click.echo("==========================CONFIGS===========================")
    for name in configs:
        click.echo(name)
    click.echo("=====================DEEPSPEED PRESETS======================")
    for name in presets:
        click.echo(name)
    if not configs and not presets:
        click.echo(f"(nothing matches {pattern!r})")


@click.command("copy-cfg")
@click.argument("name")
@click.argument("save_dir", type=click.Path(file_okay=False))
@user_errors
def copy_cfg(name: str, save_dir: str) -> None:
    """Copy built-in config NAME to SAVE_DIR/NAME_copy.py, with the `_base_`
    files it imports, so the copy runs from any directory."""
    src = find_config(name)
    if src.parent != builtin_config_dir():
        raise ConfigError(f"{name}: not a built-in config (see `sfttool list-cfg`)")
    dst_dir = Path(save_dir)
    dst_dir.mkdir(parents=True, exist_ok=True)
    dst = dst_dir / f"{src.stem}_copy.py"
    shutil.copyfile(src, dst)
    if "_base_" in src.read_text():
        shutil.copytree(builtin_config_dir() / "_base_", dst_dir / "_base_",
                        dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    click.echo(f"Copied {src} to {dst}")
