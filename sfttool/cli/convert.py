"""`sfttool convert pth_to_hf | merge`."""
from __future__ import annotations

import click

from sfttool.cli.errors import user_errors
from sfttool.cli.options import CFG_OPTIONS_CONTEXT, cfg_options_option

_SAFE_HELP = "Write safetensors (default) or, with --no-safe-serialization, PyTorch .bin files."


@click.group()
def convert() -> None:
    """Convert checkpoints and merge adapters."""


@convert.command("pth_to_hf", context_settings=CFG_OPTIONS_CONTEXT)
@click.argument("config")
@click.argument("checkpoint", type=click.Path(exists=True))
@click.argument("save_dir", type=click.Path(file_okay=False))
@click.option("--safe-serialization/--no-safe-serialization", default=True, show_default=True, help=_SAFE_HELP)
@click.option("--max-shard-size", default="2GB", show_default=True, help="Largest weight file of a full model.")
@click.option("--best", is_flag=True, help="CHECKPOINT is a work dir: convert its best checkpoint (lowest val/loss, "
              "named by WORK_DIR/best_checkpoint).")
@cfg_options_option
@user_errors
def pth_to_hf(config, checkpoint, save_dir, safe_serialization, max_shard_size, best, cfg_options) -> None:
    """Convert CHECKPOINT (an mmengine .pth or a DeepSpeed checkpoint folder)
    trained with CONFIG into SAVE_DIR: a peft adapter for LoRA/QLoRA runs, a
    full HF model otherwise; the tokenizer and the config are saved beside it."""
    from sfttool.config import load_config
    from sfttool.tools.convert import best_checkpoint, pth_to_hf as run

    if best:
        checkpoint = best_checkpoint(checkpoint)
    cfg = load_config(config, list(cfg_options))
    out = run(cfg, checkpoint, save_dir, safe_serialization=safe_serialization, max_shard_size=max_shard_size)
    click.echo(f"Saved to {out}")


@convert.command("merge")
@click.argument("base")
@click.argument("adapter", type=click.Path(exists=True, file_okay=False))
@click.argument("save_dir", type=click.Path(file_okay=False))
@click.option("--device", type=click.Choice(["cpu", "cuda", "auto"]), default="cpu", show_default=True,
              help="Where to load the base model for merging.")
@click.option("--safe-serialization/--no-safe-serialization", default=True, show_default=True, help=_SAFE_HELP)
@click.option("--max-shard-size", default="2GB", show_default=True, help="Largest weight file.")
@user_errors
def merge(base, adapter, save_dir, device, safe_serialization, max_shard_size) -> None:
    """Merge the peft ADAPTER into BASE (an HF folder or hub name) and save a
    full model with its tokenizer to SAVE_DIR, loadable with
    AutoModelForCausalLM.from_pretrained."""
    from sfttool.tools.merge import merge_adapter

    out = merge_adapter(base, adapter, save_dir, device=device, safe_serialization=safe_serialization,
                        max_shard_size=max_shard_size)
    click.echo(f"Saved to {out}")
