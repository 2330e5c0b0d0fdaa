"""Preference map fns: raw pair formats -> ``{"prompt", "chosen", "rejected"}`` message lists.

The target is XTuner 0.2's preference format: ``prompt`` is the conversation
so far (an optional system message, user and earlier assistant messages),
``chosen`` and ``rejected`` are each one assistant message::

    {"prompt": [{"role": "user", "content": "2+2?"}],
     "chosen": [{"role": "assistant", "content": "4"}],
     "rejected": [{"role": "assistant", "content": "5"}]}

Rows already in that format need no map fn.
"""
from __future__ import annotations

from typing import Any, Mapping

from sfttool.registry import MAP_FUNC

from ._fields import list_field, text_field
from .errors import MapFnError


def _assistant(content: str) -> list[dict]:
    return [{"role": "assistant", "content": content}]


def _from_strings(example: Mapping[str, Any], question: str, fn: str) -> dict:
    """String fields (an optional ``system``, the user message ``question``, ``chosen``, ``rejected``) -> a pair."""
    system = text_field(example, "system", fn, optional=True)
    prompt = [{"role": "system", "content": system}] if system else []
    prompt.append({"role": "user", "content": text_field(example, question, fn)})
    return {"prompt": prompt, "chosen": _assistant(text_field(example, "chosen", fn)),
            "rejected": _assistant(text_field(example, "rejected", fn))}


def _split_conversations(example: Mapping[str, Any], fn: str) -> dict:
    """Two full conversations that differ in their last (assistant) message -> prompt + the two answers."""
    chosen, rejected = list_field(example, "chosen", fn), list_field(example, "rejected", fn)
    for name, messages in (("chosen", chosen), ("rejected", rejected)):
        if not messages or messages[-1].get("role") != "assistant":
            raise MapFnError(f"{fn}: field {name!r} must end with an assistant message; "
                             "fix the row or use the map fn for this dataset's format")
    if chosen[:-1] != rejected[:-1]:
        raise MapFnError(f"{fn}: 'chosen' and 'rejected' differ before their last message, so they answer "
                         "different prompts; fix the row or drop it")
    return {"prompt": [dict(m) for m in chosen[:-1]], "chosen": [dict(chosen[-1])],
            "rejected": [dict(rejected[-1])]}


@MAP_FUNC.register_module()
def orpo_dpo_mix_40k_map_fn(example: dict) -> dict:
    """mlabonne/orpo-dpo-mix-40k: ``chosen``/``rejected`` are whole conversations.

    >>> orpo_dpo_mix_40k_map_fn({'chosen': [{'role': 'user', 'content': 'Hi'},
    ...                                     {'role': 'assistant', 'content': 'Hello!'}],
    ...                          'rejected': [{'role': 'user', 'content': 'Hi'},
    ...                                       {'role': 'assistant', 'content': 'Go away.'}]})
    {'prompt': [{'role': 'user', 'content': 'Hi'}], 'chosen': [{'role': 'assistant', 'content': 'Hello!'}], 'rejected': [{'role': 'assistant', 'content': 'Go away.'}]}
    """
    return _split_conversations(example, "orpo_dpo_mix_40k_map_fn")


@MAP_FUNC.register_module()
def ultrafeedback_binarized_map_fn(example: dict) -> dict:
    """HuggingFaceH4/ultrafeedback_binarized: whole-conversation ``chosen``/``rejected``
    message lists (its string ``prompt`` column repeats their first user message).

    >>> ultrafeedback_binarized_map_fn({'prompt': 'Hi', 'score_chosen': 8.0,
    ...     'chosen': [{'role': 'user', 'content': 'Hi'}, {'role': 'assistant', 'content': 'Hello!'}],
    ...     'rejected': [{'role': 'user', 'content': 'Hi'}, {'role': 'assistant', 'content': 'No.'}]})
    {'prompt': [{'role': 'user', 'content': 'Hi'}], 'chosen': [{'role': 'assistant', 'content': 'Hello!'}], 'rejected': [{'role': 'assistant', 'content': 'No.'}]}
    """
    return _split_conversations(example, "ultrafeedback_binarized_map_fn")


@MAP_FUNC.register_module()
def intel_orca_dpo_map_fn(example: dict) -> dict:
    """Intel/orca_dpo_pairs: strings ``system``, ``question``, ``chosen``, ``rejected``.

    >>> intel_orca_dpo_map_fn({'system': 'Be brief.', 'question': '2+2?', 'chosen': '4', 'rejected': '5'})
    {'prompt': [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': '2+2?'}], 'chosen': [{'role': 'assistant', 'content': '4'}], 'rejected': [{'role': 'assistant', 'content': '5'}]}

    An empty ``system`` adds no system message.
    """
    return _from_strings(example, "question", "intel_orca_dpo_map_fn")


@MAP_FUNC.register_module()
def preference_strings_map_fn(example: dict) -> dict:
    """Flat strings ``prompt``, ``chosen``, ``rejected`` (and an optional ``system``).

    >>> preference_strings_map_fn({'prompt': '2+2?', 'chosen': '4', 'rejected': '5'})
    {'prompt': [{'role': 'user', 'content': '2+2?'}], 'chosen': [{'role': 'assistant', 'content': '4'}], 'rejected': [{'role': 'assistant', 'content': '5'}]}
    """
    return _from_strings(example, "prompt", "preference_strings_map_fn")
