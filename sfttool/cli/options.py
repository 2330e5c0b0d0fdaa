"""Options shared by several subcommands."""
from __future__ import annotations

import functools

import click

# Commands using `cfg_options_option` need these settings, so that XTuner's
# spelling `--cfg-options a=1 b=2` reaches them as extra arguments.
CFG_OPTIONS_CONTEXT = {"allow_extra_args": True}


def merge_cfg_options(given: tuple[str, ...], extra: list[str]) -> list[str]:
    """``--cfg-options a=1 --cfg-options b=2`` and ``--cfg-options a=1 b=2`` mean the same.

    >>> merge_cfg_options(('a=1',), ['b=2'])
    ['a=1', 'b=2']
    """
    if extra and not given:
        raise click.UsageError(f"unexpected argument(s) {' '.join(extra)}; "
                               f"to override config keys write --cfg-options {' '.join(extra)}")
    bad = [arg for arg in extra if "=" not in arg or arg.startswith("-")]
    if bad:
        raise click.UsageError(f"unexpected argument(s) {' '.join(bad)}; --cfg-options takes KEY=VALUE pairs")
    return list(given) + list(extra)


def cfg_options_option(fn):
    """Add ``--cfg-options KEY=VALUE [KEY=VALUE ...]`` (repeatable) to a command."""
    @functools.wraps(fn)
    def wrapper(*args, cfg_options=(), **kwargs):
        extra = click.get_current_context().args
        return fn(*args, cfg_options=merge_cfg_options(tuple(cfg_options), extra), **kwargs)

    return click.option("--cfg-options", multiple=True, metavar="KEY=VALUE",
                        help="Override config settings: a top-level name re-runs the config with it "
                        "(lr=1e-4 max_epochs=1), a dotted key edits the loaded config (model.lora.r=16); "
                        "several pairs after one flag, or repeat the flag.")(wrapper)
