"""OpenAI fine-tuning format: ``messages`` = [{role: system|user|assistant|tool, content, loss?,
tool_calls?, reasoning_content?}, ...], and an optional row-level ``tools`` list."""
from __future__ import annotations

import json
from typing import Any

from sfttool.registry import MAP_FUNC

from sfttool.dataset.chat_messages import MessageError, drop_nulls, is_structured, tool_turns
from sfttool.dataset.conversation import content_text, is_content_parts, turns_from_messages

from ._fields import list_field, text_field
from .errors import MapFnError


def _with_loss(message: dict) -> bool:
    # `loss` may be absent, a bool, or the strings 'true'/'false' (JSONL written by hand).
    value = message.get("loss", True)
    if isinstance(value, str):
        return value.strip().lower() == "true"
    return bool(value) if value is not None else True


@MAP_FUNC.register_module()
def openai_map_fn(example: dict, notes: list[str] | None = None) -> dict:
    """One turn per assistant message; the user messages before it are its input.

    >>> openai_map_fn({'messages': [
    ...     {'role': 'system', 'content': 'Be terse.'},
    ...     {'role': 'user', 'content': 'Tell me a story.'},
    ...     {'role': 'assistant', 'content': 'Once, a cat.', 'loss': False}]})
    {'conversation': [{'system': 'Be terse.', 'input': 'Tell me a story.', 'output': 'Once, a cat.', 'output_with_loss': False}]}

    As sharegpt_map_fn (``turns_from_messages``): leading assistant messages
    are skipped (nothing asked them); consecutive user (or assistant) messages
    are joined with a blank line; the system messages before the first
    assistant message are the first turn's ``system``, and one after it is a
    MapFnError (the standard format has ``system`` on the first turn only);
    trailing user messages without an answer are dropped. An assistant
    message with ``loss: false`` is kept as context but not trained.
    ``notes`` (a list) collects what the conversion changed.

    Rows with tool calls, ``tool`` messages, ``reasoning_content`` or ``tools`` become turns that
    carry their chat messages (``chat_messages.tool_turns``) for the chat template. Content given as
    parts is joined into text when it is all text; with images it stays parts (docs/multimodal.md).
    """
    messages = [text_parts_joined(m) for m in list_field(example, "messages", "openai_map_fn")]
    tools = row_tools_field(example, "openai_map_fn")
    if is_structured(messages, tools):
        try:
            return {"conversation": tool_turns(messages, tools, notes)}
        except MessageError as exc:
            raise MapFnError(f"openai_map_fn: {exc}") from None
    tagged: list[tuple[str, str, bool]] = []
    answered = False
    for index, message in enumerate(messages):  # index into the row's own list, for errors
        role = message.get("role")
        if role not in ("system", "user", "assistant"):
            raise MapFnError(f"openai_map_fn: messages[{index}] has role {role!r}; expected 'system', 'user' "
                             f"or 'assistant' (tool and function messages are not supported)")
        content = text_field(message, "content", f"openai_map_fn (messages[{index}])")
        if role == "system" and answered:
            # Carried to a later turn, the encoder would reject it; dropped, the row would train without it.
            raise MapFnError(f"openai_map_fn: messages[{index}] is a system message after the first turn, "
                             f"which the standard format does not support (only the first turn has a system "
                             f"prompt); move it before the first assistant message or drop it")
        answered = answered or (role == "assistant" and any(r == "user" for r, _, _ in tagged))
        tagged.append((role, content, _with_loss(message) if role == "assistant" else True))
    return {"conversation": turns_from_messages(tagged, notes, loss_flags=True)}


def text_parts_joined(message: dict) -> dict:
    """A message whose content parts are all text, with that text as its content (any template renders a
    string); content with an image part stays parts (the image stage binds them, ``image_rows``).

    >>> text_parts_joined({'role': 'user', 'content': [{'type': 'text', 'text': 'Hi'}, {'type': 'text', 'text': '!'}]})
    {'role': 'user', 'content': 'Hi!'}
    """
    content = message.get("content")
    if is_content_parts(content) and all(part.get("type") == "text" for part in content):
        return {**message, "content": content_text(content)}
    return message


def row_tools_field(example: dict, fn: str) -> list[dict]:
    """The row's ``tools``: a list of schemas, or its JSON text (LLaMA-Factory writes it so)."""
    value: Any = example.get("tools")
    if not isinstance(value, str):
        value = drop_nulls(value)
    else:
        try:
            value = json.loads(value) if value.strip() else []
        except ValueError:
            raise MapFnError(f"{fn}: field 'tools' is not valid JSON: {value!r:.80}") from None
    if not value:
        return []
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise MapFnError(f"{fn}: field 'tools' must be a list of tool schemas, got {value!r:.80}")
    return value
