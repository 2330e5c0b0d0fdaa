"""The standard conversation format, in one place: its checks, its conversion
to chat messages, and the conversion of role-tagged message lists into it.

A standard row is ``{"conversation": [turn, ...]}``; a turn has ``input``
(the user's text), ``output`` (the answer), ``system`` (first turn only) and
the optional flags ``output_with_loss`` / ``need_eos_token``. Tool calling and
reasoning travel in two more keys, JSON text (``""`` when unused): ``tools``
(first turn only: the row's tool schemas) and ``messages`` (the turn's chat
messages as the chat template sees them, ending with the answer, when the turn
holds more than one question and one plain answer: tool results, reasoning,
tool calls)::

    >>> check_conversation([{'system': 'S', 'input': 'Q', 'output': 'A'}])
    [{'system': 'S', 'input': 'Q', 'output': 'A'}]
    >>> to_messages([{'system': 'S', 'input': 'Q', 'output': 'A'}])
    [{'role': 'system', 'content': 'S'}, {'role': 'user', 'content': 'Q'}, {'role': 'assistant', 'content': 'A'}]

``load`` checks files against it, the map fns produce it (``turns_from_messages``),
``encode`` checks and renders it, ``check-custom-dataset`` validates every row with it.
"""
from __future__ import annotations

import json
from typing import Any

from sfttool.dataset.errors import DatasetError, where

TURN_KEYS = ("system", "tools", "input", "messages", "output", "output_with_loss", "need_eos_token", "sep")
JOIN = "\n\n"  # between consecutive messages of one role, joined into one

# What converting a message list changed, reported per row (never silently).
NOTE_LEADING_ASSISTANT = "conversation starts with an assistant message (dropped: nothing asked it)"
NOTE_UNANSWERED = "final user message without an answer (dropped)"
# A prompt template renders one question and one answer per turn, so it gets the run joined; a
# chat template gets the messages as written (the turn's ``messages``), without an empty turn between.
NOTE_TWO_USERS = ("two user messages in a row (a prompt template joins them with a blank line; "
                  "a chat template gets them as written)")
NOTE_TWO_ASSISTANTS = ("two assistant messages in a row (a prompt template joins them with a blank line; "
                       "a chat template gets them as written)")


def is_empty(conversation: Any) -> bool:
    """An empty or null conversation: the row is dropped and counted."""
    return conversation is None or (isinstance(conversation, list) and not conversation)


def check_text(value: Any, field: str, row: int | None, source: str | None, allow_none: bool) -> str:
    if value is None and allow_none:
        return ""
    if not isinstance(value, str):
        name = type(value).__name__
        kind = "missing" if value is None else f"{'an' if name[0] in 'aeiou' else 'a'} {name}"
        raise DatasetError(f"{where(row, source, field)}: expected a string, got {kind}; fix the data or "
                           "the dataset_map_fn so every turn's `system`, `input` and `output` are strings")
    return value


def check_conversation(conversation: Any, row: int | None = None, source: str | None = None,
                       need_output: bool = True) -> list[dict]:
    """Validate a ``conversation`` list; return it. Raise DatasetError naming row and field."""
    if not isinstance(conversation, list):
        raise DatasetError(f"{where(row, source, 'conversation')}: expected a list of turns, "
                           f"got {type(conversation).__name__}; set a dataset_map_fn that produces "
                           "{'conversation': [{'input': ..., 'output': ...}]}")
    for i, turn in enumerate(conversation):
        _check_turn(turn, i, row, source, need_output)
    return conversation


def _is_plain_turn(turn: Any, first: bool, need_output: bool) -> bool:
    """The common turn, which ``_check_turn`` passes, told apart in one expression: a dict whose texts
    are ``str`` (or absent), without tools or messages, flags true/false/None, a system prompt only on
    the first turn. Anything else (a ``str`` subclass, tools, a flag written as text) goes through the
    full check, which names what is wrong. This check runs on every turn of every batch."""
    if turn.__class__ is not dict:
        return False
    get = turn.get
    text, answer, system = get("input"), get("output"), get("system")
    return ((text.__class__ is str or (text is None and ("input" in turn or "output" in turn)))
            and (answer.__class__ is str or (answer is None and not need_output))
            and (system is None or system.__class__ is str) and (first or not system)
            and get("tools") in _NO_JSON_LIST and get("messages") in _NO_JSON_LIST
            and get("output_with_loss") in _FLAG_VALUES and get("need_eos_token") in _FLAG_VALUES)


_NO_JSON_LIST, _FLAG_VALUES = (None, ""), (None, True, False)


def _check_turn(turn: Any, i: int, row: int | None, source: str | None, need_output: bool) -> None:
    if not _is_plain_turn(turn, i == 0, need_output):
        check_turn_fully(turn, i, row, source, need_output)


def check_turn_fully(turn: Any, i: int, row: int | None, source: str | None, need_output: bool) -> None:
    """Every rule of a turn, each failure named (``check_conversation`` skips it for a plain turn)."""
    field = f"conversation[{i}]"
    if not isinstance(turn, dict):
        raise DatasetError(f"{where(row, source, field)}: expected a dict with `input` and `output`, "
                           f"got {type(turn).__name__}")
    if "input" not in turn and "output" not in turn:
        keys = ", ".join(sorted(turn)) or "none"
        raise DatasetError(f"{where(row, source, field)}: no `input`/`output` (keys: {keys}); "
                           "convert roles to the standard format with a dataset_map_fn")
    check_text(turn.get("input"), f"{field}.input", row, source, allow_none=True)
    if need_output:
        check_text(turn.get("output"), f"{field}.output", row, source, allow_none=False)
    check_text(turn.get("system"), f"{field}.system", row, source, allow_none=True)
    for name in ("tools", "messages"):
        _check_json_list(turn.get(name), f"{field}.{name}", row, source)
    for name in ("output_with_loss", "need_eos_token"):
        value = turn.get(name)
        if value is not None and not isinstance(value, bool) and value not in (0, 1):
            # bool("false") is True: a quoted flag would silently train what it meant to mask.
            raise DatasetError(f"{where(row, source, f'{field}.{name}')}: expected true or false, got {value!r}")
    for name in ("system", "tools"):
        if i > 0 and turn.get(name):
            raise DatasetError(f"{where(row, source, f'{field}.{name}')}: `{name}` is only allowed on the "
                               "first turn; move it to conversation[0]")


def _check_json_list(value: Any, field: str, row: int | None, source: str | None) -> None:
    """``tools`` / ``messages``: a list of objects, or that list as JSON text ("" or None: none)."""
    try:
        json_list(value)
    except (ValueError, TypeError) as exc:
        raise DatasetError(f"{where(row, source, field)}: expected a list of objects or its JSON text ({exc}); "
                           "fix the data or the dataset_map_fn") from None


def json_list(value: Any) -> list[dict]:
    """A ``tools`` / ``messages`` turn value as a list of dicts (``""``/None: ``[]``).

    >>> json_list('[{"role": "tool", "content": "42"}]')
    [{'role': 'tool', 'content': '42'}]
    """
    if value is None or value == "":
        return []
    items = json.loads(value) if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
        raise TypeError(f"got {type(items).__name__}")
    return items


# What a turn means without each key a map fn may leave out ("system": none; "output_with_loss": trained).
ABSENT = {"system": "", "tools": "", "input": "", "messages": "", "output": None, "output_with_loss": True}


def with_every_key(conversation: Any) -> Any:
    """Turns with every key of ``ABSENT`` (missing ones filled with what their absence means), in one order.

    >>> with_every_key([{'input': 'Q', 'output': 'A'}])
    [{'system': '', 'tools': '', 'input': 'Q', 'messages': '', 'output': 'A', 'output_with_loss': True}]

    Arrow gives a column one struct type, decided by the first rows a ``map`` writes: a map fn that sets
    ``system`` only on rows that have one would otherwise fail on the first such row after them.
    Anything that is not a list of dicts is returned as it is, for the checks to report.
    """
    if not isinstance(conversation, list) or not all(isinstance(turn, dict) for turn in conversation):
        return conversation
    return [{**{key: turn.get(key, absent) for key, absent in ABSENT.items()}, **turn} for turn in conversation]


def check_turn_keys(conversation: list[dict], row: int | None, source: str | None) -> None:
    """Strict check (check-custom-dataset): a turn key the format does not know is probably a typo."""
    for i, turn in enumerate(conversation):
        unknown = sorted(k for k, v in turn.items() if k not in TURN_KEYS and v is not None)
        if unknown:
            raise DatasetError(f"{where(row, source, f'conversation[{i}]')}: unknown keys {', '.join(unknown)}; "
                               "a turn has system and tools (first turn only), input, messages, output "
                               "and optionally output_with_loss")


def flag(turn: dict, key: str) -> bool:
    """A boolean turn field that defaults to True; None (Arrow's fill for a
    field other rows have) also means "not set"."""
    value = turn.get(key)
    return True if value is None else bool(value)


def to_messages(conversation: list[dict], with_last_output: bool = True, owners: list[int] | None = None) -> list[dict]:
    """Standard turns -> chat messages (``system`` / ``user`` / ``assistant``), as written: a turn
    without ``input`` adds no empty user message (the chat template sees two answers in a row,
    or an answer first, and renders them as it does or says it cannot). ``owners`` (a list)
    receives the turn index of each message (the system message counts as turn 0's)."""
    messages = []
    for i, turn in enumerate(conversation):
        if i == 0 and turn.get("system"):
            messages.append({"role": "system", "content": turn["system"]})
        if turn.get("messages"):  # the turn's own messages: runs of one role, tool results, reasoning, calls
            own = json_list(turn["messages"])
            last = i == len(conversation) - 1
            messages += own if with_last_output or not last else [m for m in own if m.get("role") != "assistant"]
        else:
            if turn.get("input") or (with_last_output is False and i == len(conversation) - 1):
                messages.append({"role": "user", "content": turn.get("input") or ""})
            if with_last_output or i < len(conversation) - 1:
                messages.append({"role": "assistant", "content": turn["output"]})
        if owners is not None:
            owners += [i] * (len(messages) - len(owners))
    return messages


def content_text(content: Any) -> str:
    """A message's text: its ``content`` string, or the text of its content parts (an image counts as
    ``<image>``).

    >>> content_text([{'type': 'image', 'image': 'a.png'}, {'type': 'text', 'text': 'What is it?'}])
    '<image>What is it?'
    """
    if isinstance(content, list):
        return "".join(part.get("text") or "" if part.get("type") == "text" else "<image>"
                       for part in content if isinstance(part, dict))
    return content or ""


def is_content_parts(content: Any) -> bool:
    """OpenAI-style content parts: a list of ``{"type": ...}`` objects."""
    return isinstance(content, list) and all(isinstance(part, dict) and "type" in part for part in content)


def row_tools(conversation: list[dict]) -> list[dict]:
    """The row's tool schemas (the first turn's ``tools``), for the chat template's ``tools=``."""
    return json_list(conversation[0].get("tools")) if conversation else []


# ---------------------------------------------------------------------------
# Role-tagged messages (ShareGPT, OpenAI, OASST, WizardLM) -> standard turns.

def turns_from_messages(messages: list[tuple[str, str, bool]], notes: list[str] | None = None,
                        loss_flags: bool = False) -> list[dict]:
    """``(role, text, trained)`` messages, roles ``system``/``user``/``assistant``, -> standard turns.

    >>> turns_from_messages([('system', 'S', True), ('user', 'Q', True), ('assistant', 'A', True)])
    [{'system': 'S', 'input': 'Q', 'output': 'A'}]

    System messages before the first answer are the first turn's ``system``
    (joined with a blank line); a leading answer and a final unanswered question
    are dropped. Consecutive messages of one role are joined the same way into the
    turn's ``input``/``output`` (what a prompt template renders), and the turn keeps
    them as written in ``messages`` (what a chat template gets)::

        >>> turn, = turns_from_messages([('user', 'Q1', True), ('user', 'Q2', True), ('assistant', 'A', True)])
        >>> turn['input'], [m['content'] for m in json.loads(turn['messages'])]
        ('Q1\\n\\nQ2', ['Q1', 'Q2', 'A'])

    Each change is appended to ``notes`` once per row (the pipeline counts them).
    ``loss_flags`` gives every turn ``output_with_loss`` (False only when
    every message joined into its answer said so) and each kept assistant message its ``loss``.
    """
    runs = _merge_runs([m for m in messages if m[0] != "system"], notes)
    systems = [text for role, text, _ in messages if role == "system"]
    if runs and runs[0][0][0] == "assistant":
        runs.pop(0)
        _note(notes, NOTE_LEADING_ASSISTANT)
    if runs and runs[-1][0][0] == "user":
        runs.pop()
        _note(notes, NOTE_UNANSWERED)
    conversation = []
    for questions, answers in zip(runs[0::2], runs[1::2]):
        turn = {"system": JOIN.join(systems)} if systems and not conversation else {}
        turn.update(input=JOIN.join(text for _, text, _ in questions),
                    output=JOIN.join(text for _, text, _ in answers))
        if loss_flags:
            turn["output_with_loss"] = any(trained for _, _, trained in answers)
        if len(questions) > 1 or len(answers) > 1:
            turn["messages"] = json.dumps([_message(m, loss_flags) for m in questions + answers], ensure_ascii=False)
        conversation.append(turn)
    return conversation


def prompt_turns(messages: list[dict], row: int | None = None, source: str | None = None,
                 expected: str = "") -> list[dict]:
    """A prompt's messages (system messages first, then user/assistant turns ending with a user message) ->
    standard turns for a prompt template, the last one without output; earlier answers are context
    (``output_with_loss=False``). Messages of one role are joined as ``turns_from_messages`` joins them.
    Anything else is an error naming the message, followed by ``expected``.

    >>> prompt_turns([{'role': 'system', 'content': 'S'}, {'role': 'user', 'content': 'Q'}])
    [{'system': 'S', 'input': 'Q'}]
    """
    turns: list[dict] = []
    systems: list[str] = []
    current: dict = {}
    for i, message in enumerate(messages):
        role, content = message["role"], message["content"]
        if role == "system" and not turns and "input" not in current:
            systems.append(content)
        elif role == "user":
            current["input"] = current["input"] + JOIN + content if "input" in current else content
        elif role == "assistant" and "input" in current:
            turns.append(dict(current, output=content, output_with_loss=False))
            current = {}
        else:
            raise DatasetError(f"{where(row, source, f'prompt[{i}]')}: unexpected {role!r} message here{expected}")
    turns.append(current)
    if systems:
        turns[0] = {"system": JOIN.join(systems), **turns[0]}
    return turns


def _message(message: tuple[str, str, bool], loss_flags: bool) -> dict:
    role, text, trained = message
    out = {"role": role, "content": text}
    if loss_flags and role == "assistant":
        out["loss"] = trained
    return out


def _merge_runs(messages: list[tuple[str, str, bool]], notes: list[str] | None) -> list[list[tuple[str, str, bool]]]:
    """Messages grouped into runs of one role, each change noted."""
    runs: list[list[tuple[str, str, bool]]] = []
    for message in messages:
        if runs and runs[-1][0][0] == message[0]:
            _note(notes, NOTE_TWO_USERS if message[0] == "user" else NOTE_TWO_ASSISTANTS)
            runs[-1].append(message)
        else:
            runs.append([message])
    return runs


def _note(notes: list[str] | None, note: str) -> None:
    if notes is not None and note not in notes:
        notes.append(note)
