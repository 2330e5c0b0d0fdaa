"""Chat messages with tool calls, tool results and reasoning -> standard turns.

The standard turn keeps its plain ``input``/``output`` text (what template mode
renders) and, for a turn that holds more, its chat messages as the chat template
expects them in ``messages`` (JSON text), with the row's tool schemas in the first
turn's ``tools``::

    >>> turns = tool_turns([{'role': 'user', 'content': 'Weather?'},
    ...     {'role': 'assistant', 'content': None, 'tool_calls': [{'type': 'function',
    ...      'function': {'name': 'weather', 'arguments': '{"city": "Oslo"}'}}]},
    ...     {'role': 'tool', 'content': '12 C'}, {'role': 'assistant', 'content': 'It is 12 C.'}], [])
    >>> [(t['input'], t['output']) for t in turns]
    [('Weather?', ''), ('', 'It is 12 C.')]
    >>> json.loads(turns[1]['messages'])
    [{'role': 'tool', 'content': '12 C'}, {'role': 'assistant', 'content': 'It is 12 C.'}]

Normalised for the templates we test against (Qwen2.5, Qwen3, Llama-3.1): tool-call
``arguments`` given as JSON text become objects (the templates print them with
``tojson``; Qwen2.5 would quote a string a second time); ``content: null`` becomes
``""`` (Qwen3's template tests ``'</think>' in content``); empty ``tool_calls`` and
null ``reasoning_content`` are left out (Llama-3.1 treats a present ``tool_calls``
key as a call). Tool schemas and arguments given as objects lose their null values:
Arrow (``load_dataset('json')``) gives every object of a column the keys of all of them,
as nulls, which would put keys into the rendered schemas that the data never had; give
them as JSON text to keep a null.
"""
from __future__ import annotations

import json
from typing import Any

from sfttool.dataset.conversation import (JOIN, NOTE_LEADING_ASSISTANT, content_text, is_content_parts, NOTE_TWO_ASSISTANTS, NOTE_TWO_USERS,
                                          NOTE_UNANSWERED)

ROLES = ("system", "user", "assistant", "tool")
# Message keys the chat templates read; anything else (ids, names) is kept as written.
STRUCTURED_KEYS = ("tool_calls", "reasoning_content")
NOTE_TOOL_BEFORE_USER = "a user message before tool results in one turn (kept in order)"


class MessageError(ValueError):
    """A message the standard format cannot carry; the map fn names its row."""


def is_structured(messages: list[dict], tools: Any = None) -> bool:
    """Whether a message list needs the ``messages``/``tools`` keys (else the plain turns are exact)."""
    return bool(tools) or any(m.get("role") == "tool" or any(m.get(k) for k in STRUCTURED_KEYS)
                              or is_content_parts(m.get("content")) for m in messages)


def normalise_tool_call(call: Any, where: str) -> dict:
    """An OpenAI tool call (or a bare ``{name, arguments}``) -> ``{'type': 'function', 'function': {...}}``."""
    if not isinstance(call, dict):
        raise MessageError(f"{where}: a tool call must be an object, got {type(call).__name__}")
    function = call.get("function", call)
    name, arguments = function.get("name"), function.get("arguments", function.get("parameters", {}))
    if not isinstance(name, str) or not name:
        raise MessageError(f"{where}: a tool call needs a function name")
    if not isinstance(arguments, str):
        arguments = drop_nulls(arguments)
    else:
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            raise MessageError(f"{where}: tool call {name!r} has arguments that are not JSON: {arguments!r:.80}; "
                               "give them as an object or as JSON text") from None
    out = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if call.get("id"):
        out["id"] = call["id"]
    return out


def drop_nulls(value: Any) -> Any:
    """``value`` without the null values of its objects, at any depth (see the module doc).

    >>> drop_nulls({'a': 1, 'b': None, 'c': [{'d': None}]})
    {'a': 1, 'c': [{}]}
    """
    if isinstance(value, dict):
        return {k: drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [drop_nulls(v) for v in value]
    return value


def normalise_message(message: dict, index: int) -> dict:
    """One message as the chat templates expect it (see the module doc)."""
    where = f"messages[{index}]"
    role = message.get("role")
    if role not in ROLES:
        raise MessageError(f"{where} has role {role!r}; expected one of {', '.join(ROLES)}")
    content = message.get("content")
    if content is None:
        content = ""
    if role != "tool" and is_content_parts(content):
        content = drop_nulls(content)  # Arrow's fill for the keys other parts have (a text part's null `image`)
        if role != "user" and any(part.get("type") != "text" for part in content):
            raise MessageError(f"{where} is a {role} message with an image; images go in user messages")
    elif not isinstance(content, str):
        content = json.dumps(content, ensure_ascii=False)  # a structured tool result
    out = {k: v for k, v in message.items() if v is not None and k not in ("content", "tool_calls", "loss")}
    out["role"], out["content"] = role, content
    calls = message.get("tool_calls") or []
    if calls:
        out["tool_calls"] = [normalise_tool_call(c, f"{where}.tool_calls[{i}]") for i, c in enumerate(calls)]
    if role == "assistant" and isinstance(message.get("loss"), bool):
        out["loss"] = message["loss"]
    return out


def _group(messages: list[dict], notes: list[str] | None) -> tuple[list[str], list[list[dict]]]:
    """System texts, and the messages grouped into turns that each end with an assistant message."""
    systems = [content_text(m["content"]) for m in messages if m["role"] == "system"]
    turns: list[list[dict]] = [[]]
    for message in (m for m in messages if m["role"] != "system"):
        turns[-1].append(message)
        if message["role"] == "assistant":
            turns.append([])
    if turns[-1]:
        _note(notes, NOTE_UNANSWERED)
    turns.pop()
    if turns and len(turns[0]) == 1:  # an answer nothing asked
        turns.pop(0)
        _note(notes, NOTE_LEADING_ASSISTANT)
    return systems, turns


def tool_turns(messages: list[dict], tools: list[dict], notes: list[str] | None = None) -> list[dict]:
    """Messages (roles system/user/assistant/tool) -> standard turns, one per assistant message.

    Each turn's ``messages`` holds its tool and user messages and its answer; ``input`` is its user text
    and ``output`` its answer text, for template mode. System messages are the first turn's ``system``;
    ``tools`` (the schemas) ride on the first turn. A trailing question without an answer and a leading
    answer are dropped and noted, as for plain rows.
    """
    normalised = [normalise_message(m, i) for i, m in enumerate(messages)]
    roles = [m["role"] for m in normalised]
    late = next((i for i, role in enumerate(roles) if role == "system" and set(roles[:i]) - {"system"}), None)
    if late is not None:
        raise MessageError(f"messages[{late}] is a system message after the conversation started, which the "
                           "standard format does not support; move it to the beginning or drop it")
    systems, turns = _group(normalised, notes)
    conversation = []
    for own in turns:
        answer = own[-1]
        roles = [m["role"] for m in own[:-1]]
        if "user" in roles and "tool" in roles[roles.index("user"):]:
            _note(notes, NOTE_TOOL_BEFORE_USER)
        if ("user", "user") in zip(roles, roles[1:]):
            _note(notes, NOTE_TWO_USERS)
        if conversation and not roles:  # the previous turn's answer, then this one
            _note(notes, NOTE_TWO_ASSISTANTS)
        turn = {"system": JOIN.join(systems), "tools": json.dumps(tools, ensure_ascii=False) if tools else ""} \
            if not conversation else {}
        turn.update(input=JOIN.join(content_text(m["content"]) for m in own if m["role"] == "user"),
                    messages=json.dumps(own, ensure_ascii=False), output=content_text(answer["content"]),
                    output_with_loss=answer.get("loss", True))
        conversation.append(turn)
    return conversation


def _note(notes: list[str] | None, note: str) -> None:
    if notes is not None and note not in notes:
        notes.append(note)
