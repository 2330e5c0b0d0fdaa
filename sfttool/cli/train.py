"""`sfttool train`."""
from __future__ import annotations

import os

import click

from sfttool.cli.errors import user_errors
from sfttool.cli.options import CFG_OPTIONS_CONTEXT, cfg_options_option


@click.command(context_settings=CFG_OPTIONS_CONTEXT)
@click.argument("config")
@click.option("--work-dir", default=None, help="Where checkpoints and logs go (default: ./work_dirs/<config name>).")
@click.option("--deepspeed", default=None, help="DeepSpeed preset name (zero1, zero2, zero2_offload, zero3, zero3_offload) or a JSON path.")
@click.option("--resume", is_flag=False, flag_value="auto", default=None,
              help="Resume from the latest checkpoint in the work dir, or from the given checkpoint path.")
@click.option("--seed", type=int, default=None, help="Overrides every seed of the config: model initialisation, dropout, data shuffling and order.")
@cfg_options_option
@click.option("--nproc-per-node", type=int, default=None,
              help="Processes per machine (torchrun); default: $NPROC_PER_NODE or 1. "
                   "Also read: NNODES, NODE_RANK, ADDR, PORT.")
@click.option("--trust-remote-code", is_flag=True, default=False,
              help="Allow model repositories' own Python code to run (sets trust_remote_code=True on every "
                   "from_pretrained in the config). Off unless given here or in the config.")
@click.option("--max-steps", type=click.IntRange(min=1), default=None,
              help="Stop after N optimizer steps and save a checkpoint (the learning-rate schedule stays the "
                   "full run's, so --resume continues it).")
@click.option("--dry-run", is_flag=True, default=False,
              help="Build and check everything, process the data, run one iteration; save nothing in the "
                   "work dir.")
@click.option("--verbose", is_flag=True, default=False,
              help="Show the full config, environment and hook table on the terminal (always in the log file).")
@click.option("--strict", is_flag=True, default=False,
              help="Make a template that renders differently from the tokenizer's chat_template an error.")
@click.option("--skip-bad-rows", is_flag=True, default=False,
              help="Drop, counted, the rows whose trained answers the template cannot render (tool calls under a "
                   "template without tools, an answer that renders empty) instead of stopping at the first.")
@user_errors
def train(config, nproc_per_node, **flags) -> None:
    """Train the model described by CONFIG (a path or a built-in config name)."""
    from sfttool.config import ConfigError
    from sfttool.engine import launch
    from sfttool.engine.spec import TrainOptions

    options = TrainOptions(**flags)
    try:
        plan = launch.plan_from_env(nproc_per_node)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if launch.needs_launch(plan):
        from sfttool.engine.train import check

        check(config, options, plan.world_size)  # once, here: the processes started do not report again
        code = launch.launch(plan, [config, *options.command_line()])
        if code in (130, 143):  # SIGINT/SIGTERM: the workers saved a checkpoint at a step boundary
            click.echo(f"Stopped by a signal (exit {code}); resume with the same command plus --resume", err=True)
            raise SystemExit(code)
        if code != 0:
            raise click.ClickException(f"training failed: torchrun exited with code {code} (see the ranks' logs above)")
        return
    from sfttool.engine.safety import report_rank_failure
    from sfttool.engine.train import train as run_training

    with report_rank_failure():  # in a multi-process run the log names the failing rank
        out = run_training(config, **flags)
    if os.environ.get("RANK", "0") == "0":
        click.echo("Dry run finished: the config, data and one training step work" if options.dry_run else
                   f"Training finished; outputs in {out}")
