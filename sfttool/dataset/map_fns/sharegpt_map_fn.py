"""ShareGPT-style rows: ``conversations`` = [{from: human|gpt|system, value}, ...].

Real ShareGPT dumps are messy; this map fn accepts the common variants:

- role spellings (case-insensitive): human/user; gpt/assistant/chatgpt/bing/bard/model; system;
- ``role``/``content`` keys instead of ``from``/``value``; a ``messages`` column instead of ``conversations``;
- consecutive messages from the same side are one turn: joined with a blank line in ``input``/``output``
  (for a prompt template), kept as written in ``messages`` (for the tokenizer's chat template);
- leading assistant messages are dropped (nothing asked them), and so is a final unanswered user message;
- system messages before the first user message become the first turn's ``system``.

A system message later in the conversation, an unknown role or a non-string
message raises MapFnError naming the message position.

LLaMA-Factory's tool format is read too: ``function_call`` messages (the call as JSON,
``{"name", "arguments"}`` or a list of them), ``observation`` messages (the tool's result)
and a row-level ``tools`` (JSON text or a list; bare function schemas are wrapped as
``{"type": "function", "function": schema}``, the form chat templates document). Such rows
become turns that carry their chat messages (``chat_messages.tool_turns``).
"""
from __future__ import annotations

import json
from typing import Any, Mapping

from sfttool.registry import MAP_FUNC

from sfttool.dataset.chat_messages import MessageError, tool_turns
from sfttool.dataset.conversation import JOIN, turns_from_messages

from ._fields import text_field
from .errors import MapFnError
from .openai_map_fn import row_tools_field

TOOL_ROLES = {"function_call": "assistant", "observation": "tool"}  # LLaMA-Factory's names

ROLE_ALIASES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bing": "assistant",
    "bard": "assistant", "model": "assistant",
    "system": "system",
}
__all__ = ["JOIN", "ROLE_ALIASES", "sharegpt_map_fn"]


def _messages(example: Mapping[str, Any]) -> list:
    for field in ("conversations", "messages"):
        value = example.get(field) if isinstance(example, Mapping) else None
        if value is not None:
            if not isinstance(value, (list, tuple)) or not all(isinstance(m, Mapping) for m in value):
                raise MapFnError(f"sharegpt_map_fn: field {field!r} must be a list of message objects, "
                                 f"got {value!r:.80}")
            return list(value)
    fields = sorted(example) if isinstance(example, Mapping) else type(example).__name__
    raise MapFnError(f"sharegpt_map_fn: the row has no 'conversations' (or 'messages') field; found fields {fields}")


def _role_and_text(message: Mapping[str, Any], index: int) -> tuple[str, str]:
    where = f"sharegpt_map_fn (conversations[{index}])"
    # Files mixing both spellings load with the other key present but null.
    raw_role = message.get("from") if message.get("from") is not None else message.get("role")
    role = ROLE_ALIASES.get(raw_role.strip().lower()) if isinstance(raw_role, str) else None
    if role is None:
        raise MapFnError(f"sharegpt_map_fn: conversations[{index}] has unknown role {raw_role!r}; "
                         f"accepted roles are {sorted(ROLE_ALIASES)}")
    text_key = "content" if message.get("value") is None and "content" in message else "value"
    return role, text_field(message, text_key, where)


def _tagged(messages: list) -> list[tuple[str, str, bool]]:
    """``(role, text, True)`` per message; a system message after the first user or assistant one is an error."""
    tagged: list[tuple[str, str, bool]] = []
    for index, message in enumerate(messages):
        role, text = _role_and_text(message, index)
        if role == "system" and any(r != "system" for r, _, _ in tagged):
            raise MapFnError(f"sharegpt_map_fn: conversations[{index}] is a system message after the "
                             f"conversation started; move it to the beginning or drop it")
        tagged.append((role, text, True))
    return tagged


@MAP_FUNC.register_module()
def sharegpt_map_fn(example: dict, notes: list[str] | None = None) -> dict:
    """Pair each user message with the assistant reply that follows it.

    >>> sharegpt_map_fn({'conversations': [
    ...     {'from': 'system', 'value': 'Be kind.'}, {'from': 'human', 'value': 'Hi'},
    ...     {'from': 'gpt', 'value': 'Hello!'}, {'from': 'human', 'value': 'Bye'},
    ...     {'from': 'gpt', 'value': 'Bye!'}]})
    {'conversation': [{'system': 'Be kind.', 'input': 'Hi', 'output': 'Hello!'}, {'input': 'Bye', 'output': 'Bye!'}]}

    ``notes`` (a list) collects what the conversion changed (see ``turns_from_messages``).
    """
    messages = _messages(example)
    tools = row_tools_field(example, "sharegpt_map_fn")
    if tools or any(_raw_role(m) in TOOL_ROLES for m in messages):
        try:
            return {"conversation": tool_turns(_openai_messages(messages), _wrapped(tools), notes)}
        except MessageError as exc:
            raise MapFnError(f"sharegpt_map_fn: {exc}".replace("messages[", "conversations[")) from None
    return {"conversation": turns_from_messages(_tagged(messages), notes)}


def _raw_role(message: Mapping[str, Any]) -> str:
    role = message.get("from") if message.get("from") is not None else message.get("role")
    return role.strip().lower() if isinstance(role, str) else ""


def _openai_messages(messages: list) -> list[dict]:
    """ShareGPT messages with LLaMA-Factory's tool roles -> OpenAI messages (``tool_calls``, ``tool``)."""
    out = []
    for index, message in enumerate(messages):
        raw = _raw_role(message)
        if raw not in TOOL_ROLES:
            role, text = _role_and_text(message, index)
            out.append({"role": role, "content": text})
            continue
        text = text_field(message, "content" if message.get("value") is None else "value",
                          f"sharegpt_map_fn (conversations[{index}])")
        if raw == "observation":
            out.append({"role": "tool", "content": text})
            continue
        try:
            calls = json.loads(text)
        except ValueError:
            raise MapFnError(f"sharegpt_map_fn: conversations[{index}] (function_call) is not JSON: {text!r:.80}; "
                             'write the call as {"name": ..., "arguments": {...}}') from None
        out.append({"role": "assistant", "content": "", "tool_calls": calls if isinstance(calls, list) else [calls]})
    return out


def _wrapped(tools: list[dict]) -> list[dict]:
    """Bare function schemas (LLaMA-Factory) in the OpenAI form chat templates document."""
    return [t if "function" in t or "type" in t else {"type": "function", "function": t} for t in tools]
