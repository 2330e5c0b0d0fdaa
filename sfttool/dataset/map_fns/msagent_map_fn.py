"""MSAgent-Bench rows (XTuner's ``msagent_react_map_fn`` data) as real tool calls.

A row is ``{"conversations": [{from: system|user|assistant, value}, ...]}`` (or that list as text). The system
message lists the APIs as JSON objects (``name``, ``description``, ``paths[0].parameters``); an assistant
message calls one as ``<|startofthink|>```JSON {"api_name": ..., "parameters": {...}}```<|endofthink|>`` and
holds its result as ``<|startofexec|>```JSON {...}```<|endofexec|>``, then the answer.

XTuner rewrites these into ReAct text (``Thought:``/``Action:``/``Response:``) for its prompt templates;
here they become OpenAI messages (a tool call, a ``tool`` message with the result, the answer) and the APIs
become the row's ``tools``, so the model learns its own chat template's tool-call format (HF chat-template
mode) and is trained on the call and the answer, never on the tool's result.
"""
from __future__ import annotations

import ast
import json
import re
from typing import Any

from sfttool.registry import MAP_FUNC

from sfttool.dataset.chat_messages import MessageError, tool_turns

from .errors import MapFnError

THINK = re.compile(r"<\|startofthink\|>(.*?)<\|endofthink\|>", re.DOTALL)
EXEC = re.compile(r"<\|startofexec\|>(.*?)<\|endofexec\|>", re.DOTALL)
ROLES = {"system": "system", "user": "user", "assistant": "assistant"}


def _json_block(text: str) -> Any:
    return json.loads(text.replace("```JSON", "").replace("```", "").strip())


def api_tools(system: str) -> list[dict]:
    """The API objects written in a system message, as tool schemas (string parameters)."""
    decoder, tools, pos = json.JSONDecoder(), [], 0
    while (start := system.find("{", pos)) >= 0:
        try:
            api, length = decoder.raw_decode(system[start:])
        except ValueError:
            pos = start + 1
            continue
        pos = start + (length if isinstance(api, dict) and "name" in api else 1)
        if isinstance(api, dict) and "name" in api and "description" in api:
            params = (api.get("paths") or [{}])[0].get("parameters") or []
            properties = {p["name"]: {"type": "string", "description": p.get("description", "")} for p in params}
            required = [p["name"] for p in params if p.get("required")]
            tools.append({"type": "function", "function": {
                "name": api["name"], "description": api["description"],
                "parameters": {"type": "object", "properties": properties, "required": required}}})
    return tools


def assistant_messages(text: str) -> list[dict]:
    """One assistant message of MSAgent-Bench -> a tool call, its result and the answer (when it calls)."""
    think = THINK.search(text)
    if think is None:
        return [{"role": "assistant", "content": text.strip()}]
    call = _json_block(think.group(1))
    messages = [{"role": "assistant", "content": text[:think.start()].strip(), "tool_calls": [
        {"type": "function", "function": {"name": call["api_name"], "arguments": call.get("parameters", {})}}]}]
    rest = text[think.end():]
    result = EXEC.search(rest)
    if result is not None:
        messages.append({"role": "tool", "content": result.group(1).replace("```JSON", "").replace("```", "").strip()})
        answer = rest[result.end():].strip()
        if answer:
            messages.append({"role": "assistant", "content": answer})
    return messages


@MAP_FUNC.register_module()
def msagent_map_fn(example: dict, notes: list[str] | None = None) -> dict:
    """MSAgent-Bench conversations -> turns with tool calls (see the module doc).

    >>> row = {'conversations': [{'from': 'user', 'value': 'Weather?'}, {'from': 'assistant', 'value':
    ...     'Checking.<|startofthink|>```JSON\\n{"api_name": "weather", "parameters": {"city": "Oslo"}}\\n```'
    ...     '<|endofthink|>\\n\\n<|startofexec|>```JSON\\n{"temp": 12}\\n```<|endofexec|>\\nIt is 12 C.'}]}
    >>> [(t['input'], t['output']) for t in msagent_map_fn(row)['conversation']]
    [('Weather?', 'Checking.'), ('', 'It is 12 C.')]
    """
    conversations = example.get("conversations")
    if isinstance(conversations, str):  # the published files hold the list as Python/JSON text
        conversations = ast.literal_eval(conversations)
    if not isinstance(conversations, list):
        raise MapFnError(f"msagent_map_fn: field 'conversations' must be a list of messages, got {conversations!r:.80}")
    messages, tools = [], []
    try:
        for index, message in enumerate(conversations):
            role, text = ROLES.get(message.get("from")), message.get("value")
            if role is None or not isinstance(text, str):
                raise MessageError(f"conversations[{index}] must have from system/user/assistant and a text value")
            if role == "system":
                tools += api_tools(text)
            messages += assistant_messages(text) if role == "assistant" else [{"role": role, "content": text}]
        return {"conversation": tool_turns(messages, tools, notes)}
    except (MessageError, ValueError, KeyError, TypeError) as exc:
        raise MapFnError(f"msagent_map_fn: {type(exc).__name__}: {exc}") from None
