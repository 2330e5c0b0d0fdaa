"""`sfttool list-cfg` and `sfttool copy-cfg`."""
from __future__ import annotations

import shutil
from pathlib import Path

import click

from sfttool.cli.errors import user_errors
from sfttool.config.bases import relative_bases
from sfttool.config.loader import (AT_A_GLANCE, GLANCE_FIELDS, ConfigError, builtin_config_dir,
                                   config_at_a_glance, find_config, list_configs, list_deepspeed_presets)


@click.command("list-cfg")
@click.option("-p", "--pattern", default=None, help="Case-insensitive substring to filter names.")
def list_cfg(pattern: str | None) -> None:
    """List built-in configs, one line each (method, model size, data, memory estimate),
    and DeepSpeed presets."""
    configs = list_configs(pattern)
    presets = list_deepspeed_presets(pattern)
    click.echo("==========================CONFIGS===========================")
    for line in config_table(configs):
        click.echo(line)
    click.echo("=====================DEEPSPEED PRESETS======================")
    for name in presets:
        click.echo(name)
    if not configs and not presets:
        click.echo(f"(nothing matches {pattern!r})")


def config_table(names: list[str]) -> list[str]:
    """A header and one line per built-in config: its name and its docstring's ``At a glance:`` fields,
    in columns (a config without that line gets a note instead)."""
    if not names:
        return []
    rows = [["NAME", *(field.upper() for field in GLANCE_FIELDS)]]
    for name in names:
        fields = config_at_a_glance(builtin_config_dir() / f"{name}.py")
        rows.append([name, *(fields or [f"(its docstring has no '{AT_A_GLANCE}' line)"])])
    # Every column but the last is padded to its widest cell.
    widths = [max(len(row[i]) for row in rows if len(row) > i + 1) for i in range(len(rows[0]) - 1)]
    return ["  ".join([cell.ljust(width) for cell, width in zip(row[:-1], widths)] + [row[-1]]) for row in rows]


def _check_free(pairs: list[tuple[Path, Path]], force: bool) -> None:
    """Refuse to overwrite a file the user may have edited (identical files are fine)."""
    for src, dst in pairs:
        if dst.exists() and not force and dst.read_bytes() != src.read_bytes():
            raise ConfigError(f"{dst} already exists and differs from {src.name}; "
                              "pass --force to overwrite it, or copy into another folder")


@click.command("copy-cfg")
@click.argument("name")
@click.argument("save_dir", type=click.Path(file_okay=False))
@click.option("--force", is_flag=True, help="Overwrite files that already exist in SAVE_DIR.")
@user_errors
def copy_cfg(name: str, save_dir: str, force: bool) -> None:
    """Copy built-in config NAME to SAVE_DIR/NAME_copy.py, with the `_base_`
    files it imports, so the copy runs from any directory."""
    # Built-ins only, even when a file of that name sits in the current folder.
    stem = name[:-3] if name.endswith(".py") else name
    src = builtin_config_dir() / f"{stem}.py"
    if Path(stem).name != stem or stem.startswith("_") or not src.is_file():
        find_config(name)  # raises with close matches unless NAME is some other file
        raise ConfigError(f"{name}: not a built-in config (see `sfttool list-cfg`)")
    dst_dir = Path(save_dir)
    dst = dst_dir / f"{src.stem}_copy.py"
    bases = relative_bases(src)
    if any(rel.is_absolute() for rel in bases):
        raise ConfigError(f"{src}: imports a base outside its folder; copy it by hand")
    pairs = [(src.parent / rel, dst_dir / rel) for rel in bases] + [(src, dst)]
    _check_free(pairs, force)
    for file_src, file_dst in pairs:
        file_dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(file_src, file_dst)
    click.echo(f"Copied {src.name} to {dst}")
    for rel in bases:
        click.echo(f"  with its base {dst_dir / rel}")
