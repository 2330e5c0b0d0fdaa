"""WizardLM evol-instruct (WizardLM_evol_instruct_V2_196k): ``conversations`` of {from: human|gpt, value}."""
from __future__ import annotations

from sfttool.registry import MAP_FUNC

from ._fields import list_field, text_field
from .errors import MapFnError


@MAP_FUNC.register_module()
def wizardlm_map_fn(example: dict) -> dict:
    """One turn per ``gpt`` message; the ``human`` messages before it are its input.

    >>> wizardlm_map_fn({'conversations': [{'from': 'human', 'value': 'Hi'},
    ...                                    {'from': 'gpt', 'value': 'Hello'}]})
    {'conversation': [{'input': 'Hi', 'output': 'Hello'}]}

    Leading ``gpt`` messages are skipped; consecutive ``human`` messages are
    concatenated. For other role spellings use ``sharegpt_map_fn``.
    """
    messages = list_field(example, "conversations", "wizardlm_map_fn")
    start = 0
    while start < len(messages) and messages[start].get("from") == "gpt":
        start += 1
    conversation, user = [], ""
    for index, message in enumerate(messages[start:], start):  # index into the row's own list, for errors
        value = text_field(message, "value", f"wizardlm_map_fn (conversations[{index}])")
        if message.get("from") == "human":
            user += value
        elif message.get("from") == "gpt":
            conversation.append({"input": user, "output": value})
            user = ""
        else:
            raise MapFnError(f"wizardlm_map_fn: conversations[{index}] is from {message.get('from')!r}; expected "
                             f"'human' or 'gpt' (sharegpt_map_fn accepts more spellings and system messages)")
    return {"conversation": conversation}
