"""`sfttool train`."""
from __future__ import annotations

import click

from sfttool.cli.errors import user_errors


@click.command(context_settings={"ignore_unknown_options": False})
@click.argument("config")
@click.option("--work-dir", default=None, help="Where checkpoints and logs go (default: ./work_dirs/<config name>).")
@click.option("--deepspeed", default=None, help="DeepSpeed preset name (zero1, zero2, zero2_offload, zero3, zero3_offload) or a JSON path.")
@click.option("--resume", is_flag=False, flag_value="auto", default=None,
              help="Resume from the latest checkpoint in the work dir, or from the given checkpoint path.")
@click.option("--seed", type=int, default=None, help="Overrides the config's seed.")
@click.option("--cfg-options", multiple=True, help="Override config keys: --cfg-options a.b=1 --cfg-options c=x")
@user_errors
def train(config, work_dir, deepspeed, resume, seed, cfg_options) -> None:
    """Train the model described by CONFIG (a path or a built-in config name)."""
    from sfttool.config import ConfigError, load_config, validate_config

    cfg = load_config(config, list(cfg_options))
    errors = validate_config(cfg, cfg.filename)
    if errors:
        raise ConfigError("the config has problems:\n  " + "\n  ".join(errors))
    raise click.ClickException("training is not available yet in this build")
