"""WizardLM evol-instruct (WizardLM_evol_instruct_V2_196k): ``conversations`` of {from: human|gpt, value}."""
from __future__ import annotations

from sfttool.dataset.conversation import turns_from_messages
from sfttool.registry import MAP_FUNC

from ._fields import list_field, text_field
from .errors import MapFnError


@MAP_FUNC.register_module()
def wizardlm_map_fn(example: dict, notes: list[str] | None = None) -> dict:
    """One turn per ``gpt`` message; the ``human`` messages before it are its input.

    >>> wizardlm_map_fn({'conversations': [{'from': 'human', 'value': 'Hi'},
    ...                                    {'from': 'gpt', 'value': 'Hello'}]})
    {'conversation': [{'input': 'Hi', 'output': 'Hello'}]}

    Leading ``gpt`` messages are skipped; consecutive messages of one side are
    joined with a blank line (``turns_from_messages``). For other role
    spellings use ``sharegpt_map_fn``. ``notes`` collects what was changed.
    """
    messages = list_field(example, "conversations", "wizardlm_map_fn")
    tagged = []
    for index, message in enumerate(messages):  # index into the row's own list, for errors
        role = _ROLES.get(message.get("from"))
        if role is None:
            raise MapFnError(f"wizardlm_map_fn: conversations[{index}] is from {message.get('from')!r}; expected "
                             f"'human' or 'gpt' (sharegpt_map_fn accepts more spellings and system messages)")
        tagged.append((role, text_field(message, "value", f"wizardlm_map_fn (conversations[{index}])"), True))
    return {"conversation": turns_from_messages(tagged, notes)}


_ROLES = {"human": "user", "gpt": "assistant"}
