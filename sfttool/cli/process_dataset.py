"""`sfttool process-dataset CONFIG --out DIR`: tokenize and pack once, train many times."""
from __future__ import annotations

from pathlib import Path

import click

from sfttool.cli.errors import user_errors
from sfttool.cli.options import CFG_OPTIONS_CONTEXT, cfg_options_option
from sfttool.tools.process_dataset import DEFAULT_SHARD_ROWS


@click.command("process-dataset", context_settings=CFG_OPTIONS_CONTEXT)
@click.argument("config")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Folder to write (Arrow shards in data/, Parquet ones with --ray, plus manifest.json).")
@click.option("--num-proc", type=click.IntRange(min=1), default=None,
              help="Processes for tokenizing, packing and writing (default: the config's map_num_proc).")
@click.option("--shard-rows", type=click.IntRange(min=1), default=DEFAULT_SHARD_ROWS, show_default=True,
              help="Raw rows tokenized and packed together; memory follows this, not the dataset size "
                   "(about 60 bytes per token of a shard, see docs/scale.md).")
@click.option("--overwrite", is_flag=True, help="Replace a dataset already saved in --out.")
@click.option("--ray", "ray_address", is_flag=False, flag_value="", default=None, metavar="[ADDRESS]",
              help="Run on a Ray cluster, one task per --shard-rows block, writing Parquet shards (pip install "
                   "'sfttool[ray]'). ADDRESS as ray.init takes it: omitted, RAY_ADDRESS or a Ray started "
                   "for the run; 'auto', the cluster running on this machine; or HOST:PORT of its head.")
@cfg_options_option
@user_errors
def process_dataset(config, out_dir, num_proc, shard_rows, overwrite, ray_address, cfg_options) -> None:
    """Run CONFIG's dataset pipeline once and save the result to --out.

    Then point the config at it instead of re-processing on every run:

    \b
        from sfttool.tools.process_dataset import load_processed_dataset
        train_dataset = dict(type=load_processed_dataset, path='DIR')
    """
    from sfttool.config import load_config
    from sfttool.tools.process_dataset import process_dataset as run

    cfg = load_config(config, list(cfg_options))
    if ray_address is None:
        manifest = run(cfg, out_dir, num_proc=num_proc, overwrite=overwrite, shard_rows=shard_rows)
    else:
        if num_proc is not None:
            raise click.UsageError("--num-proc sets local processes; with --ray the cluster's CPUs run the "
                                   "blocks: leave --num-proc out")
        from sfttool.tools.process_ray import ray_process_dataset
        manifest = ray_process_dataset(cfg, out_dir, address=ray_address or None, overwrite=overwrite,
                                       shard_rows=shard_rows)
    efficiency = manifest["packing_efficiency"]
    click.echo(f"Saved {manifest['rows']} rows, {manifest['tokens']} tokens "
               f"({manifest['trained_tokens']} trained) in {len(manifest['shards'])} shard(s) to {out_dir}")
    if efficiency is not None:
        click.echo(f"Packing efficiency {efficiency:.1%} of {manifest['max_length']} tokens per row; "
                   f"fingerprint {manifest['fingerprint']}")
    if "ray" in manifest:
        ray = manifest["ray"]
        click.echo(f"Ray: {ray['blocks']} blocks on {ray['nodes_used']} of {ray['nodes']} node(s), "
                   f"{ray['worker_processes']} worker processes, "
                   f"{manifest['tokens'] / max(ray['cpu_seconds'], 0.01):,.0f} tokens per worker CPU second")
    click.echo("Use it: in PART 3 of the config, replace the train_dataset assignment (it must stay before "
               "train_dataloader, which copies it) with\n"
               "    from sfttool.tools.process_dataset import load_processed_dataset\n"
               f"    train_dataset = dict(type=load_processed_dataset, path={str(Path(out_dir).resolve())!r})")
