"""`sfttool score MODEL [--adapter A] --prompt P --chosen C --rejected R`."""
from __future__ import annotations

import click

from sfttool.cli.errors import user_errors


@click.command("score")
@click.argument("model")
@click.option("--adapter", default=None, type=click.Path(exists=True, file_okay=False),
              help="The reward model's peft adapter folder (e.g. work_dir/hf_adapter) to apply to MODEL.")
@click.option("--prompt", required=True, help="The user message both answers reply to.")
@click.option("--chosen", required=True, help="The answer expected to score higher.")
@click.option("--rejected", required=True, help="The answer expected to score lower.")
@click.option("--system", default=None, help="System prompt text.")
@click.option("--prompt-template", default=None, help="PROMPT_TEMPLATE name used in training, e.g. qwen_chat.")
@click.option("--hf-template", is_flag=True, help="Render with the tokenizer's own chat_template.")
@click.option("--reward-token-id", type=int, default=None,
              help="The token ending every training sequence (default: the saved training config's).")
@user_errors
def score(model, adapter, prompt, chosen, rejected, system, prompt_template, hf_template, reward_token_id) -> None:
    """Score a chosen and a rejected answer with a reward model (MODEL, or MODEL + --adapter), rendered
    as in training; prints both scores and which answer the model prefers."""
    from sfttool.tools.score import score_pair

    good, bad = score_pair(model, prompt, chosen, rejected, adapter, system, prompt_template, hf_template,
                           reward_token_id)
    click.echo(f"chosen: {good:.4f}\nrejected: {bad:.4f}\npreferred: {'chosen' if good > bad else 'rejected'}")
