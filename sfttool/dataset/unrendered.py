"""Trained answers the template cannot render: never trained.

A row may say more than a template renders. A chat template without tool support (SmolLM2's ChatML)
renders a call-only answer as nothing, so its end-of-turn token alone would be trained; an XTuner-style
prompt template renders only each turn's plain text. Such a row is refused before training, naming
the file, the row, what the template leaves out and the fix (``refuse``); with ``skip_bad_rows``
(``--skip-bad-rows``) it is dropped instead, counted by what is missing (``REFUSED``).

What is refused, for each trained answer:

* its tool calls are not rendered (``TOOL_CALLS``: the answer would train a turn that ends where it
  should call);
* its render is empty (special tokens aside) while the row gives it text (``ANSWER_TEXT``) or only
  reasoning (``REASONING``).

A template that leaves out an answer's reasoning but renders its text (Qwen2.5's) trains that text, and
the pipeline counts the rows (``stages.ignored_field_notes``).
"""
from __future__ import annotations

from sfttool.dataset.conversation import content_text, flag, json_list
from sfttool.dataset.errors import DatasetError, where

TOOL_CALLS, REASONING, ANSWER_TEXT = "tool calls", "reasoning_content", "answer text"
# ``first_trained`` of the one empty sample a row dropped with skip_bad_rows becomes: what is missing.
REFUSED = {TOOL_CALLS: -3, REASONING: -4, ANSWER_TEXT: -5}

FIXES = {
    TOOL_CALLS: "a chat format that renders them (PROMPT_TEMPLATE.qwen2_5, qwen3, llama3_1) or hf_chat_template "
                "with a tokenizer whose chat template renders them",
    REASONING: "a chat format that renders it (PROMPT_TEMPLATE.qwen3) or hf_chat_template with a tokenizer "
               "whose chat template renders it",
    ANSWER_TEXT: "a template that renders the assistant's content",
}


class Unrendered(DatasetError):
    """A trained answer whose render leaves out what the row says the assistant did. ``feature`` names what
    is missing, ``trained_as`` the text that would be trained instead."""

    def __init__(self, feature: str, trained_as: str):
        super().__init__(f"the template does not render {feature}: the answer would be trained as {trained_as!r}")
        self.feature, self.trained_as = feature, trained_as


def unrendered_text(message: dict, rendered: str, specials: list[str]) -> str | None:
    """What the answer ``message`` holds that its ``rendered`` text (special tokens aside) leaves out
    entirely: its text (``ANSWER_TEXT``), or its only content, the reasoning (``REASONING``); None when
    the rendered text holds something, or the message itself is empty.

    >>> unrendered_text({'role': 'assistant', 'content': '', 'reasoning_content': 'R'}, '<|im_end|>', ['<|im_end|>'])
    'reasoning_content'
    """
    for special in specials:
        rendered = rendered.replace(special, "")
    if rendered.strip():
        return None
    if content_text(message.get("content")).strip():
        return ANSWER_TEXT
    return REASONING if (message.get("reasoning_content") or "").strip() else None


def unrendered_turn(conversation: list[dict]) -> tuple[str, str] | None:
    """``(what, trained text)`` when a trained turn's answer holds what a prompt template cannot render (it
    renders each turn's plain input and output): tool calls, or reasoning as its only content.

    >>> unrendered_turn([{'input': 'Q', 'output': '<|im_end|>', 'messages': [{'role': 'user', 'content': 'Q'},
    ...     {'role': 'assistant', 'content': '', 'tool_calls': [{'function': {'name': 'f', 'arguments': {}}}]}]}])
    ('tool calls', '<|im_end|>')
    """
    for turn in conversation:
        if not turn.get("messages") or not flag(turn, "output_with_loss"):
            continue
        answer = next((m for m in reversed(json_list(turn["messages"])) if m.get("role") == "assistant"), {})
        if answer.get("tool_calls"):
            return TOOL_CALLS, turn["output"]
        if not content_text(answer.get("content")).strip() and (answer.get("reasoning_content") or "").strip():
            return REASONING, turn["output"]
    return None


def refuse(feature: str, trained_as: str, row: int, source: str | None, renderer: str, skip_bad_rows: bool) -> int:
    """The ``REFUSED`` code of a row whose answer would train without its ``feature`` (``renderer``: what
    renders it, as ``encode.renderer_name`` says); without ``skip_bad_rows``, a DatasetError naming the
    file, the row, what is missing and the fix."""
    if skip_bad_rows:
        return REFUSED[feature]
    raise DatasetError(f"{where(row, source)}: {renderer} does not render {feature}, so an answer of this row "
                       f"would be trained as {trained_as!r}; use {FIXES[feature]}, or --skip-bad-rows to drop "
                       "such rows (counted)")
