"""ShareGPT-style rows: ``conversations`` = [{from: human|gpt|system, value}, ...].

Real ShareGPT dumps are messy; this map fn accepts the common variants:

- role spellings (case-insensitive): human/user; gpt/assistant/chatgpt/bing/bard/model; system;
- ``role``/``content`` keys instead of ``from``/``value``; a ``messages`` column instead of ``conversations``;
- consecutive messages from the same side are joined with a blank line into one message;
- leading assistant messages are dropped (nothing asked them), and so is a final unanswered user message;
- system messages before the first user message become the first turn's ``system``.

A system message later in the conversation, an unknown role or a non-string
message raises MapFnError naming the message position.
"""
from __future__ import annotations

from typing import Any, Mapping

from sfttool.registry import MAP_FUNC

from sfttool.dataset.conversation import JOIN, turns_from_messages

from ._fields import text_field
from .errors import MapFnError

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
    return {"conversation": turns_from_messages(_tagged(_messages(example)), notes)}
