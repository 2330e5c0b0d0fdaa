"""Built-in chat formats: a model family's chat template written as format strings.

A ``CHAT_FORMAT`` (a field of a ``PROMPT_TEMPLATE`` entry such as ``qwen3``; its fields are
``sfttool.utils.templates.CHAT_FORMAT_FIELDS``) renders a whole conversation (system prompt,
tool schemas, user turns, answers with reasoning and tool calls, tool results) to text, as
the family's official jinja chat template does, without needing the tokenizer to carry one.
``ChatFormat`` gives it the one method the chat-template encoder calls on a tokenizer,
``apply_chat_template(..., tokenize=False)``, so the exact per-answer targets and the splitting
of ``chat_targets`` apply unchanged::

    >>> fmt = ChatFormat(dict(SYSTEM='<|im_start|>system\\n{system}<|im_end|>\\n',
    ...                       USER='<|im_start|>user\\n{content}<|im_end|>\\n',
    ...                       ASSISTANT='<|im_start|>assistant\\n', SUFFIX='<|im_end|>', SEP='\\n'))
    >>> fmt.apply_chat_template([{'role': 'user', 'content': 'Q'}], add_generation_prompt=True)
    '<|im_start|>user\\nQ<|im_end|>\\n<|im_start|>assistant\\n'

Placeholders are filled in one pass (``{system}``, ``{content}``, ``{tools}``, ``{tool}``,
``{name}``, ``{arguments}``, ``{results}``, ``{reasoning}``, ``{environment}``), so literal
braces need no escaping. ``REASONING`` follows Qwen3's rule: an answer after the last user
question shows its reasoning (the last message always, empty or not); earlier answers show
only their content, and reasoning written inline (``<think>...</think>`` in the content) is
read as reasoning.
"""
from __future__ import annotations

import json
import re
from typing import Any, Mapping

from sfttool.dataset.chat_targets import THINK_END
from sfttool.dataset.errors import DatasetError
from sfttool.utils.templates import CHAT_FORMAT_FIELDS

THINK_START = "<think>"  # closed by chat_targets.THINK_END, which the trained-span rules read too
_PLACEHOLDER = re.compile(r"\{(system|content|tools|tool|name|arguments|results|reasoning|environment)\}")


def fill(text: str, **values: str) -> str:
    """``text`` with each ``{name}`` of ``values`` replaced, in one pass (other braces kept).

    >>> fill('{"name": "{name}"}', name='f')
    '{"name": "f"}'
    """
    return _PLACEHOLDER.sub(lambda m: values.get(m.group(1), m.group(0)), text)


class ChatFormat:
    """A ``CHAT_FORMAT`` behind a tokenizer's ``apply_chat_template`` (text only)."""

    def __init__(self, fields: Mapping[str, Any]):
        self.fields = {**CHAT_FORMAT_FIELDS, **dict(fields)}
        # What the probes of ``chat_targets.ignored_fields`` are cached by, as for a jinja template.
        self.chat_template = json.dumps(self.fields, sort_keys=True)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ChatFormat) and other.chat_template == self.chat_template

    def __hash__(self) -> int:
        return hash(self.chat_template)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None, tokenize: bool = False,
                            add_generation_prompt: bool = False, enable_thinking: bool | None = None,
                            **_: Any) -> str:
        if tokenize:
            raise TypeError("ChatFormat renders text only: tokenize the text with the tokenizer")
        return render_format(self.fields, messages, tools or [], add_generation_prompt, enable_thinking)


def renderer(tokenizer, chat_options: dict | None):
    """What renders conversations in chat-template mode: ``ChatFormat`` of the template's ``CHAT_FORMAT``
    (in ``chat_options``, see ``chat_template_options``), else the tokenizer (its jinja template)."""
    chat_format = (chat_options or {}).get("chat_format")
    return ChatFormat(chat_format) if chat_format else tokenizer


def render_format(f: Mapping[str, Any], messages: list[dict], tools: list[dict], add_generation_prompt: bool,
                  enable_thinking: bool | None = None) -> str:
    """The text of ``messages`` (roles system, user, assistant, tool) in the format ``f``."""
    trim = str.strip if f["TRIM"] else str
    system = trim(messages[0]["content"]) if messages and messages[0]["role"] == "system" else None
    rest = messages[1:] if system is not None else list(messages)
    out = [f["BOS"], _system_block(f, system, tools)]
    if tools and f["TOOLS_IN"] == "user":  # Llama 3.1: the schemas open the first user message
        if not rest:
            raise DatasetError("this chat format puts the tools in the first user message, and there is none")
        out.append(fill(f["USER"], content=_tools_text(f, tools) + trim(rest[0]["content"])))
        rest = rest[1:]
    last_query = _last_query(rest)
    for i, message in enumerate(rest):
        if message["role"] == "user":
            out.append(fill(f["USER"], content=trim(message["content"])))
        elif message["role"] == "assistant":
            shown = i > last_query and bool(f["REASONING"])
            out.append(_assistant(f, message, shown, i == len(rest) - 1, trim))
        elif message["role"] == "tool" and (i == 0 or rest[i - 1]["role"] != "tool"):
            out.append(_tool_results(f, rest, i))
        elif message["role"] == "system":
            raise DatasetError("a system message after the conversation started is not supported by the "
                               "built-in chat formats; move it to the beginning")
    if add_generation_prompt:
        out.append(f["ASSISTANT"] + (f["NO_THINK"] if enable_thinking is False else ""))
    return "".join(out)


def _system_block(f: Mapping[str, Any], system: str | None, tools: list[dict]) -> str:
    text = f["DEFAULT_SYSTEM"] if system is None else system
    if tools and f["TOOLS_IN"] == "system":
        text = (text + "\n\n" if text else "") + _tools_text(f, tools)
    if not text and not f["SYSTEM_ALWAYS"]:
        return ""
    return fill(f["SYSTEM"], system=text, environment=f["ENVIRONMENT"] if tools else "")


def _tools_text(f: Mapping[str, Any], tools: list[dict]) -> str:
    each = "".join(fill(f["TOOL"], tool=json.dumps(tool, ensure_ascii=False, indent=f["TOOL_INDENT"]))
                   for tool in tools)
    return fill(f["TOOLS"], tools=each)


def _last_query(messages: list[dict]) -> int:
    """Index of the last user question (a user message that is not a wrapped tool result), as Qwen3's
    template finds it; ``len - 1`` when there is none."""
    for i in range(len(messages) - 1, -1, -1):
        content = messages[i]["content"] if messages[i]["role"] == "user" else ""
        if messages[i]["role"] == "user" and not (content.startswith("<tool_response>")
                                                  and content.endswith("</tool_response>")):
            return i
    return len(messages) - 1


def split_reasoning(message: dict) -> tuple[str, str]:
    """``(reasoning, content)`` of an answer: its ``reasoning_content``, else ``<think>`` written inline.

    >>> split_reasoning({'content': '<think>\\nAdd.\\n</think>\\n\\n4.'})
    ('Add.', '4.')
    """
    content = message.get("content") or ""
    if message.get("reasoning_content") is not None:
        return message["reasoning_content"], content
    if THINK_END not in content:
        return "", content
    before = content.split(THINK_END)[0].rstrip("\n")
    return before.split(THINK_START)[-1].lstrip("\n"), content.split(THINK_END)[-1].lstrip("\n")


def _assistant(f: Mapping[str, Any], message: dict, after_query: bool, last: bool, trim) -> str:
    reasoning, content = split_reasoning(message) if f["REASONING"] else ("", message.get("content") or "")
    calls = message.get("tool_calls") or []
    if calls and f["CALLS_REPLACE_CONTENT"]:
        content = ""
    if after_query and (last or reasoning):
        text = fill(f["REASONING"], reasoning=reasoning.strip("\n")) + content.lstrip("\n")
    else:
        text = trim(content)
    if f["MAX_TOOL_CALLS"] and len(calls) > f["MAX_TOOL_CALLS"]:
        raise DatasetError(f"an assistant message has {len(calls)} tool calls; this chat format allows "
                           f"{f['MAX_TOOL_CALLS']} per message: split them into consecutive turns")
    rendered = [_tool_call(f, call) for call in calls]
    joined = f["TOOL_CALL_SEP"].join(rendered)
    if rendered and content:
        joined = f["TOOL_CALL_SEP"] + joined
    return f["ASSISTANT"] + text + joined + f["SUFFIX"] + f["SEP"]


def _tool_call(f: Mapping[str, Any], call: dict) -> str:
    function = call.get("function", call)
    arguments = function.get("arguments", {})
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return fill(f["TOOL_CALL"], name=function["name"], arguments=arguments)


def _tool_results(f: Mapping[str, Any], messages: list[dict], start: int) -> str:
    """The run of tool messages from ``start`` (one block: Qwen wraps them in one user message)."""
    results = []
    for message in messages[start:]:
        if message["role"] != "tool":
            break
        content = message["content"]
        if f["TOOL_RESULT_JSON"]:  # Llama 3.1 writes a result as JSON: text becomes a quoted string
            content = json.dumps(content, ensure_ascii=False)
        results.append(fill(f["TOOL_RESULT"], content=content))
    return fill(f["TOOL_RESULTS"], results="".join(results))
