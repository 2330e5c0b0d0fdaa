"""Chat with a model through the same prompt rendering as training.

Every prompt goes through :func:`sfttool.dataset.encode.encode_prompt`, so
the ids the model continues from are the ids training produced for the same
turns; generation stops at the template's STOP_WORDS (plus the user's and
the tokenizer's end tokens: ``sfttool.utils.stop_words``, shared with the
training's sample generations) and the history keeps each answer without them,
exactly as a training row would hold it.

    >>> session = ChatSession(model, tokenizer, get_template('qwen_chat'))  # doctest: +SKIP
    >>> session.ask('Who are you?')  # doctest: +SKIP
    'I am Pico, an assistant made by Lumen Labs.'
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, TextIO

from sfttool import compat
from sfttool.config import load_config
from sfttool.dataset.encode import encode_prompt
from sfttool.errors import SfttoolError
from sfttool.tools.image_chat import answer_message, image_messages, prompt_inputs
from sfttool.model.hf_folder import SAVED_CONFIG_NAME
from sfttool.model.vision import language_model_class
from sfttool.tools.merge import (adapter_tokenizer, fit_embeddings_to_adapter, load_errors, saved_processor,
                                 training_output_problem)
from sfttool.utils.stop_words import cut_at_stop_words, stop_words_for
from sfttool.utils.templates import PROMPT_TEMPLATE, SYSTEM_TEMPLATE, get_template, is_hf_chat_template


class ChatError(SfttoolError):
    """The model, adapter or template cannot be used for chat; the message says why."""


@dataclass
class GenerationSettings:
    """Sampling settings; ``temperature=0`` means greedy decoding."""
    max_new_tokens: int = 2048
    temperature: float = 0.1
    top_p: float = 0.75
    top_k: int = 40
    repetition_penalty: float = 1.0

    def generation_kwargs(self) -> dict:
        kwargs: dict[str, Any] = dict(max_new_tokens=self.max_new_tokens,
                                      repetition_penalty=self.repetition_penalty)
        if self.temperature > 0:
            kwargs.update(do_sample=True, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        return kwargs


# ---------------------------------------------------------------------------
# Loading: model (+adapter, +bitsandbytes), tokenizer, template.

def quantization_config(bits: int | None):
    """``4`` -> NF4 with double quantisation, ``8`` -> LLM.int8(), None -> no quantisation."""
    if bits is None:
        return None
    import torch
    from transformers import BitsAndBytesConfig

    if bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True)
    if bits == 4:
        compute = torch.bfloat16 if torch.cuda.is_available() else torch.float32
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                  bnb_4bit_compute_dtype=compute)
    raise ChatError(f"--bits must be 4 or 8, got {bits}")


def load_chat_model(model_path: str | os.PathLike, adapter: str | os.PathLike | None = None,
                    bits: int | None = None, trust_remote_code: bool = False):
    """The model in eval mode (on GPU 0 when there is one) and its tokenizer
    (the adapter's when the adapter folder carries one)."""
    if adapter is not None and not (Path(adapter) / "adapter_config.json").is_file():
        raise ChatError(f"{adapter}: not a peft adapter folder (no adapter_config.json)")
    problem = training_output_problem(model_path)
    if problem:
        raise ChatError(problem)

    compat.quiet_bnb_cpu_kernel_warning()  # peft imports bitsandbytes, whose CPU kernel warning is noise here
    import torch
    from transformers import AutoTokenizer

    device_map = {"": 0} if torch.cuda.is_available() else None
    # trust_remote_code: a repository's own Python code runs only when the user asked (--trust-remote-code).
    with load_errors(model_path, ChatError):
        model_class = language_model_class(model_path, trust_remote_code=trust_remote_code)
        model = model_class.from_pretrained(model_path, dtype="auto", device_map=device_map,
                                                     quantization_config=quantization_config(bits),
                                                     trust_remote_code=trust_remote_code)
    saved = adapter_tokenizer(adapter, trust_remote_code=trust_remote_code) if adapter is not None else None
    if adapter is not None:
        from peft import PeftModel
        fit_embeddings_to_adapter(model, saved)
        model = PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    tokenizer = saved or AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    return model, tokenizer


def load_chat_processor(model_path: str | os.PathLike, adapter: str | os.PathLike | None = None,
                        trust_remote_code: bool = False):
    """The processor of an image-text model (the adapter's when saved with it, else the model's) for
    ``--image``; a model without one is an error."""
    processor = (saved_processor(adapter, trust_remote_code=trust_remote_code) if adapter is not None else None) \
        or saved_processor(model_path, trust_remote_code=trust_remote_code)
    if processor is None:
        raise ChatError(f"--image: {model_path} has no processor (processor_config.json / preprocessor_config.json): "
                        "chat with images needs an image-text model and its processor files")
    return processor


def template_from_saved_config(folder: str | os.PathLike) -> Mapping | str | None:
    """The prompt template recorded in ``folder/sfttool_config.py`` (written by
    ``sfttool convert``), or None when there is no such file or template."""
    path = Path(folder) / SAVED_CONFIG_NAME
    if not path.is_file():
        return None

    cfg = load_config(path)
    return _find_template(cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg))


def _find_template(node: Any) -> Mapping | str | None:
    """First template under a `prompt_template` or `template` key, depth-first:
    a template dict, or the name a dumped config writes for a built-in
    (``'sfttool.utils.PROMPT_TEMPLATE.qwen_chat'`` -> ``'qwen_chat'``)."""
    if isinstance(node, Mapping):
        for key in ("prompt_template", "template"):
            value = node.get(key)
            if isinstance(value, Mapping) and ("INSTRUCTION" in value or "HF_CHAT_TEMPLATE" in value):
                return value
            if isinstance(value, str) and "PROMPT_TEMPLATE." in value:
                return value.rsplit("PROMPT_TEMPLATE.", 1)[1]
        children: Iterable = node.values()
    elif isinstance(node, (list, tuple)):
        children = node
    else:
        return None
    for child in children:
        found = _find_template(child)
        if found is not None:
            return found
    return None


def resolve_template(tokenizer, prompt_template: str | None = None, hf_template: bool = False,
                     folders: Iterable[str | os.PathLike] = ()) -> tuple[Mapping, str]:
    """The template to chat with and where it came from, in this order: the
    user's choice, the training config saved beside the model/adapter, the
    tokenizer's own chat_template."""
    if prompt_template and hf_template:
        raise ChatError("give either --prompt-template or --hf-template, not both")
    if hf_template:
        return PROMPT_TEMPLATE.hf_chat_template, "--hf-template"
    if prompt_template:
        try:
            return get_template(prompt_template), f"--prompt-template {prompt_template}"
        except ValueError as exc:
            raise ChatError(str(exc)) from None
    for folder in folders:
        template = template_from_saved_config(folder)
        if template is not None:
            return get_template(template), f"{Path(folder) / SAVED_CONFIG_NAME}"
    if getattr(tokenizer, "chat_template", None):
        return PROMPT_TEMPLATE.hf_chat_template, "the tokenizer's chat_template"
    raise ChatError("this tokenizer has no chat_template and no training config was found beside the "
                    "model: pass --prompt-template NAME (the template used in training)")


def resolve_system(system: str | None = None, system_template: str | None = None) -> str:
    """``--system`` text, or a SYSTEM_TEMPLATE entry by name, or ''."""
    if system and system_template:
        raise ChatError("give either --system or --system-template, not both")
    if system_template:
        if system_template not in SYSTEM_TEMPLATE:
            raise ChatError(f"unknown system template {system_template!r}; valid names: "
                            f"{', '.join(sorted(SYSTEM_TEMPLATE))}")
        return SYSTEM_TEMPLATE[system_template]
    return system or ""


# ---------------------------------------------------------------------------
# Streaming that hides stop words.

def _held_back(text: str, stop_words: Iterable[str]) -> int:
    """Length of the longest end of ``text`` that could still grow into a stop word."""
    longest = 0
    for word in stop_words:
        for n in range(min(len(word) - 1, len(text)), longest, -1):
            if text.endswith(word[:n]):
                longest = n
                break
    return longest


def make_streamer(tokenizer, stop_words: list[str], out: TextIO):
    """A ``TextStreamer`` that prints the answer as it comes and stops printing
    at the first stop word (it never shows a stop word, even split across tokens)."""
    from transformers import TextStreamer

    class StopWordStreamer(TextStreamer):
        def __init__(self):
            super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=False)
            self.pending, self.stopped = "", False

        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            if not self.stopped:
                self.pending += text
                cut = cut_at_stop_words(self.pending, stop_words)
                if len(cut) < len(self.pending) or stream_end:
                    out.write(cut)
                    self.pending, self.stopped = "", True
                else:
                    keep = _held_back(self.pending, stop_words)
                    out.write(self.pending[:len(self.pending) - keep])
                    self.pending = self.pending[len(self.pending) - keep:]
                out.flush()
            if stream_end:
                out.write("\n")
                out.flush()
                self.pending, self.stopped = "", False

    return StopWordStreamer()


# ---------------------------------------------------------------------------
# A conversation.

class ChatSession:
    """Multi-turn chat: the history is standard turns (the system prompt on the first)."""

    def __init__(self, model, tokenizer, template: Mapping, system: str = "",
                 stop_words: Iterable[str] = (), settings: GenerationSettings | None = None,
                 tools: list[dict] | None = None, processor: Any = None, images: Iterable[str] = ()):
        self.model, self.tokenizer, self.template = model, tokenizer, template
        self.system = system
        self.tools = list(tools or [])  # tool schemas, on the first turn as training rows hold them
        self.stop_words = stop_words_for(template, tokenizer, model, stop_words)
        self.settings = settings or GenerationSettings()
        self.history: list[dict] = []
        # A vision-language model's processor renders the conversation (``image_chat``); ``images`` go
        # with the first question.
        self.processor, self.images = processor, list(images)
        self.messages: list[dict] = []

    def reset(self) -> None:
        self.history, self.messages = [], []

    def prompt_ids(self, text: str) -> list[int]:
        """Ids of the history plus a new user turn, ready for the answer."""
        return encode_prompt(self.history + [self._opening({"input": text})], self.tokenizer, self.template)

    def _opening(self, turn: dict) -> dict:
        """The first turn carries the system prompt and the tools."""
        if not self.history and self.system:
            turn["system"] = self.system
        if not self.history and self.tools:
            turn["tools"] = json.dumps(self.tools, ensure_ascii=False)
        return turn

    def ask(self, text: str, out: TextIO | None = None) -> str:
        """Answer ``text`` (streamed to ``out`` when given), remember the turn, return the answer."""
        import torch

        if self.processor is not None:
            messages = image_messages(self.messages, text, [] if self.messages else self.images, self.system)
            inputs = prompt_inputs(self.processor, messages, self.model.device)
        else:
            ids = self.prompt_ids(text)
            input_ids = torch.tensor([ids], device=self.model.device)  # [1, prompt]
            inputs = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids))
        streamer = make_streamer(self.tokenizer, self.stop_words, out) if out is not None else None
        with torch.no_grad():
            output = self.model.generate(
                **inputs, streamer=streamer, stop_strings=self.stop_words or None, tokenizer=self.tokenizer,
                pad_token_id=_pad_id(self.tokenizer), **self.settings.generation_kwargs())
        prompt_length = inputs["input_ids"].shape[1]
        generated = self.tokenizer.decode(output[0, prompt_length:], skip_special_tokens=False)
        answer = cut_at_stop_words(generated, self.stop_words)
        if self.processor is not None:
            self.messages = messages + [answer_message(answer)]
        self.history.append(self._opening({"input": text, "output": answer}))
        return answer


def load_tools(path: str | os.PathLike, template: Mapping) -> list[dict]:
    """``--tools FILE.json``: a list of tool schemas (bare function schemas are wrapped as
    ``{"type": "function", "function": ...}``), rendered by the model's chat template as in training."""
    if not is_hf_chat_template(template):
        raise ChatError("--tools needs the model's own chat template (--hf-template, a chat format such as "
                        "--prompt-template qwen3, or a run trained with either): XTuner-style prompt templates "
                        "have no place for tools")
    try:
        tools = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ChatError(f"{path}: cannot read the tools: {exc}") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise ChatError(f"{path}: expected a JSON list of tool schemas, got {type(tools).__name__}")
    return [t if "function" in t or "type" in t else {"type": "function", "function": t} for t in tools]


def split_reasoning(answer: str) -> tuple[str, str]:
    """``(reasoning, answer)`` of a reply that thinks first (``<think>...</think>``), else ``('', answer)``.

    >>> split_reasoning('<think>\\nOne and one.\\n</think>\\n\\n2.')
    ('One and one.', '2.')
    """
    if "</think>" not in answer:
        return "", answer
    reasoning, _, rest = answer.partition("</think>")
    return reasoning.replace("<think>", "").strip(), rest.lstrip("\n")


def shown(answer: str) -> str:
    """An answer as printed when not streamed: the reasoning apart, before it."""
    reasoning, text = split_reasoning(answer)
    return f"[reasoning]\n{reasoning}\n[answer]\n{text}" if reasoning else text


def _pad_id(tokenizer) -> int | None:
    """generate() wants a pad id even for one sequence; fall back to EOS (id 0 is a valid pad)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


# ---------------------------------------------------------------------------
# The loops behind `sfttool chat`.

EXIT, RESET = "EXIT", "RESET"


def run_prompts(session: ChatSession, prompts: Iterable[str], out: TextIO = sys.stdout,
                stream: bool = True) -> list[str]:
    """Non-interactive chat: one prompt per item (blank ones skipped), answers
    printed one after another; ``EXIT`` stops and ``RESET`` clears the history."""
    answers = []
    for prompt in prompts:
        prompt = prompt.rstrip("\n")
        if not prompt.strip():
            continue
        if prompt.strip() == EXIT:
            break
        if prompt.strip() == RESET:
            session.reset()
            continue
        answer = session.ask(prompt, out if stream else None)
        if not stream:
            out.write(shown(answer) + "\n")
        answers.append(answer)
    return answers


def run_interactive(session: ChatSession, out: TextIO = sys.stdout, stream: bool = True) -> None:
    """Read prompts from the terminal until ``EXIT`` (or end of input)."""
    out.write(f"Chat started. Type {EXIT} to quit, {RESET} to clear the history.\n")
    while True:
        try:
            prompt = input("\n>>> ")
        except EOFError:
            break
        if prompt.strip() == EXIT:
            break
        if prompt.strip() == RESET:
            session.reset()
            out.write("(history cleared)\n")
            continue
        if prompt.strip():
            answer = session.ask(prompt, out if stream else None)
            if not stream:
                out.write(shown(answer) + "\n")
