"""OpenAI fine-tuning format: ``messages`` = [{role: system|user|assistant, content, loss?}, ...]."""
from __future__ import annotations

from sfttool.registry import MAP_FUNC

from ._fields import list_field, text_field
from .errors import MapFnError


def _with_loss(message: dict) -> bool:
    # `loss` may be absent, a bool, or the strings 'true'/'false' (JSONL written by hand).
    value = message.get("loss", True)
    if isinstance(value, str):
        return value.strip().lower() == "true"
    return bool(value) if value is not None else True


@MAP_FUNC.register_module()
def openai_map_fn(example: dict) -> dict:
    """One turn per assistant message; the user messages before it are its input.

    >>> openai_map_fn({'messages': [
    ...     {'role': 'system', 'content': 'Be terse.'},
    ...     {'role': 'user', 'content': 'Tell me a story.'},
    ...     {'role': 'assistant', 'content': 'Once, a cat.', 'loss': False}]})
    {'conversation': [{'system': 'Be terse.', 'input': 'Tell me a story.', 'output': 'Once, a cat.', 'output_with_loss': False}]}

    Leading assistant messages are skipped (nothing asked them); consecutive
    user messages are concatenated; a system message applies to the next
    turn; trailing user messages without an answer are dropped. An assistant
    message with ``loss: false`` is kept as context but not trained.
    """
    messages = list_field(example, "messages", "openai_map_fn")
    while messages and messages[0].get("role") == "assistant":
        messages = messages[1:]
    conversation, system, user = [], "", ""
    for index, message in enumerate(messages):
        role = message.get("role")
        if role not in ("system", "user", "assistant"):
            raise MapFnError(f"openai_map_fn: messages[{index}] has role {role!r}; expected 'system', 'user' "
                             f"or 'assistant' (tool and function messages are not supported)")
        content = text_field(message, "content", f"openai_map_fn (messages[{index}])")
        if role == "system":
            system = content
        elif role == "user":
            user += content
        else:
            turn = {"system": system} if system else {}
            turn.update(input=user, output=content, output_with_loss=_with_loss(message))
            conversation.append(turn)
            system, user = "", ""
    return {"conversation": conversation}
