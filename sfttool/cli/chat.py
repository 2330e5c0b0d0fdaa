"""`sfttool chat MODEL [--adapter A] [--prompt-template T | --hf-template] ...`."""
from __future__ import annotations

import sys

import click

from sfttool.cli.errors import user_errors


@click.command("chat")
@click.argument("model")
@click.option("--adapter", default=None, type=click.Path(exists=True, file_okay=False),
              help="A peft adapter folder (e.g. from `sfttool convert pth_to_hf`) to apply to MODEL.")
@click.option("--prompt-template", default=None,
              help="PROMPT_TEMPLATE name used in training, e.g. qwen_chat.")
@click.option("--hf-template", is_flag=True,
              help="Render prompts with the tokenizer's own chat_template.")
@click.option("--system", default=None, help="System prompt text.")
@click.option("--system-template", default=None, help="SYSTEM_TEMPLATE name, e.g. alpaca.")
@click.option("--bits", type=click.Choice(["4", "8"]), default=None,
              help="Load MODEL quantised with bitsandbytes.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=2048, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0), default=0.1, show_default=True,
              help="0 means greedy decoding.")
@click.option("--top-p", type=click.FloatRange(0, 1), default=0.75, show_default=True)
@click.option("--top-k", type=click.IntRange(min=0), default=40, show_default=True)
@click.option("--repetition-penalty", type=float, default=1.0, show_default=True)
@click.option("--stop-words", multiple=True, help="Extra stop words (repeat the option for several).")
@click.option("--no-streamer", is_flag=True, help="Print each answer when it is complete.")
@click.option("--prompt", "prompts", multiple=True,
              help="Answer this prompt and exit (repeat for a multi-turn conversation).")
@click.option("--tools", "tools_file", default=None, type=click.Path(exists=True, dir_okay=False),
              help="A JSON list of tool schemas, rendered by the model's chat template as in training.")
@click.option("--image", "images", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="An image for the first question (repeat for several): an image-text model answers "
                   "through its processor, as training encoded image rows.")
@click.option("--trust-remote-code", is_flag=True, default=False,
              help="Allow MODEL's repository to run its own Python code (off by default).")
@user_errors
def chat(model, adapter, prompt_template, hf_template, system, system_template, bits, max_new_tokens,
         temperature, top_p, top_k, repetition_penalty, stop_words, no_streamer, prompts,
         trust_remote_code, tools_file, images) -> None:
    """Chat with MODEL (an HF folder or hub name), optionally with an adapter.

    Prompts are rendered exactly as in training. Without --prompt-template or
    --hf-template the template comes from the training config saved beside
    the adapter/model by `sfttool convert`, else from the tokenizer's
    chat_template; with --image, the model's processor renders the conversation. Interactive on a terminal (EXIT quits, RESET clears the
    history); with --prompt, or prompts piped on stdin one per line, it prints
    the answers and exits.
    """
    from sfttool.tools import chat as tool
    from sfttool.tools.image_chat import check_images

    system_text = tool.resolve_system(system, system_template)
    llm, tokenizer = tool.load_chat_model(model, adapter, int(bits) if bits else None,
                                          trust_remote_code=trust_remote_code)
    folders = [f for f in (adapter, model) if f]
    processor = None
    if images:
        if prompt_template or tools_file:
            raise tool.ChatError("--image: the model's processor renders the conversation; drop "
                                 f"{'--prompt-template' if prompt_template else '--tools'}")
        processor = tool.load_chat_processor(model, adapter, trust_remote_code=trust_remote_code)
        images = check_images(list(images))
        template, source = tool.PROMPT_TEMPLATE.hf_chat_template, "the processor's chat template (--image)"
    else:
        template, source = tool.resolve_template(tokenizer, prompt_template, hf_template, folders)
    click.echo(f"Prompt template: {source}", err=True)
    settings = tool.GenerationSettings(max_new_tokens, temperature, top_p, top_k, repetition_penalty)
    tools = tool.load_tools(tools_file, template) if tools_file else None
    session = tool.ChatSession(llm, tokenizer, template, system_text, stop_words, settings, tools=tools,
                               processor=processor, images=images)
    out = click.get_text_stream("stdout")
    if prompts:
        tool.run_prompts(session, prompts, out, stream=not no_streamer)
    elif not sys.stdin.isatty():
        tool.run_prompts(session, click.get_text_stream("stdin"), out, stream=not no_streamer)
    else:
        tool.run_interactive(session, out, stream=not no_streamer)
