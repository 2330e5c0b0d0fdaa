"""`sfttool version` and `sfttool env`."""
from __future__ import annotations

import importlib.metadata
import platform

import click

from sfttool import __version__

PACKAGES = ("torch", "transformers", "datasets", "tokenizers", "peft", "bitsandbytes",
            "deepspeed", "mmengine", "accelerate", "flash-attn")


@click.command()
def version() -> None:
    """Print the sfttool version."""
    click.echo(__version__)


def _pkg_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


@click.command()
def env() -> None:
    """Print versions of the stack and what this machine can do."""
    import torch

    rows = [("sfttool", __version__), ("python", platform.python_version()),
            ("platform", platform.platform())]
    rows += [(name, _pkg_version(name)) for name in PACKAGES]
    cuda = torch.cuda.is_available()
    rows += [
        ("CUDA (torch build)", torch.version.cuda or "none (CPU build)"),
        ("GPU available", f"yes: {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}" if cuda else "no"),
        ("bf16 supported", "yes" if cuda and torch.cuda.is_bf16_supported() else ("CPU only" if not cuda else "no")),
        ("flash-attn usable", "yes" if cuda and _pkg_version("flash-attn") != "not installed" else "no"),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        click.echo(f"{key:<{width}}  {value}")
