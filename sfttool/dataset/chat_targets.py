"""HF chat-template mode: each answer trained in the exact form the model produces at inference.

For the answer at message ``k`` the model is prompted with ``render(messages[:k],
add_generation_prompt=True)`` and produces what ``render(messages[:k + 1])`` adds to that
prompt, up to and including its end-of-turn token. A sample is one render of the
conversation up to some answer; it trains answer ``k`` only when it starts with that
prompt followed by that answer. Most templates render every shorter conversation as a
prefix of the longer ones, and one sample (the whole conversation) trains every answer.
Qwen3's template drops the reasoning of answers before the last user message, so a
later render no longer holds an earlier answer as it was produced: the conversation is
split into as few samples as needed (greedily, in order), each training the answers
whose form it holds::

    Qwen3, [user Q1, assistant (R1) A1, user Q2, assistant (R2) A2] -> 2 samples:
      ...Q1 | <think>\\nR1\\n</think>\\n\\nA1<|im_end|>            (trained)
      ...Q1, A1 (reasoning dropped), Q2 | <think>\\nR2\\n</think>\\n\\nA2<|im_end|>

A trained answer whose render leaves out its tool calls, or is empty while the row gives it text or
reasoning, is never trained: ``unrendered.Unrendered`` says what is missing (the encoder refuses the row,
or drops it with ``skip_bad_rows``).

Options (``PROMPT_TEMPLATE.hf_chat_template`` fields): ``TRAIN_ON_REASONING`` (default
True: the ``<think>`` block is trained), ``ENABLE_THINKING`` (passed to the template for rows
without reasoning). An assistant message's ``loss`` (true/false) overrides both for its turn.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable

from sfttool import compat
from sfttool.dataset.conversation import content_text, flag, row_tools, to_messages
from sfttool.dataset.errors import DatasetError, where
from sfttool.dataset.unrendered import TOOL_CALLS, Unrendered, unrendered_text

THINK_END = "</think>"


@dataclass
class Answer:
    prompt: str   # the render up to the answer, with the generation prompt
    own: str      # the render ending with the answer
    end: int      # end of the trained text in ``own`` (through the end-of-turn token)
    skip: int     # characters after the prompt left untrained (the reasoning, when not trained)

    def exact_in(self, text: str) -> bool:
        return text.startswith(self.own[:self.end])


def render(tokenizer, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None,
           row: int | None = None, **kwargs: Any) -> str:
    """``apply_chat_template`` as text; a jinja error is a DatasetError naming the row."""
    return _rendering(row, lambda: tokenizer.apply_chat_template(
        messages, tools=tools or None, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs))


def prefix_renders(tokenizer, messages: list[dict], tools: list[dict] | None = None, row: int | None = None,
                   **kwargs: Any) -> Callable[[int, bool], str]:
    """``rendered(k, add_generation_prompt)`` = ``render(tokenizer, messages[:k], add_generation_prompt, ...)``,
    each prefix rendered once (the whole conversation is the last answer's own render) and, for a jinja
    template, with the messages prepared once for every prefix (``compat.chat_prefix_renderer``)."""
    fast = _rendering(row, lambda: compat.chat_prefix_renderer(tokenizer, messages, tools or None, **kwargs))
    done: dict[tuple[int, bool], str] = {}

    def rendered(k: int, add_generation_prompt: bool) -> str:
        key = (k, add_generation_prompt)
        if key not in done:
            done[key] = (_rendering(row, lambda: fast(k, add_generation_prompt)) if fast is not None else
                         render(tokenizer, messages[:k], add_generation_prompt, tools, row, **kwargs))
        return done[key]
    return rendered


def _rendering(row: int | None, call: Callable[[], Any]) -> Any:
    """``call()``, a jinja error (or a ``CHAT_FORMAT``'s own) a DatasetError naming the row."""
    try:
        return call()
    except DatasetError as exc:  # a template's built-in CHAT_FORMAT says itself what it cannot render
        raise DatasetError(f"{where(row)}: {exc}") from None
    except Exception as exc:  # jinja raises its own types (e.g. "System role not supported")
        raise DatasetError(f"{where(row)}: the tokenizer's chat_template failed: {type(exc).__name__}: {exc}; "
                           "fix the conversation (e.g. drop the system prompt) or use a built-in "
                           "PROMPT_TEMPLATE") from None


def unstable(row: int | None) -> DatasetError:
    return DatasetError(
        f"{where(row)}: the tokenizer's chat_template renders earlier turns differently once the answer is "
        "added (e.g. it moves the system prompt to the last message: the prompt before an answer is not the "
        "start of the render with it), so the answer cannot be trained in the form the model produces; use a "
        "built-in PROMPT_TEMPLATE for this model")


def _trained_end(text: str, start: int, end: int, anchors: list[str], specials: list[str]) -> int:
    """Through the first special token after the answer's own text (reasoning, content, tool names
    found in order), else the whole turn."""
    position = start
    for anchor in (a.strip() for a in anchors):
        found = text.find(anchor, position, end) if anchor else -1
        if found >= 0:
            position = found + len(anchor)
    hits = [(pos, -len(s)) for s in specials if (pos := text.find(s, position, end)) >= 0]
    if not hits:
        return end
    pos, minus_length = min(hits)  # the earliest; at one position, the longest token
    return pos - minus_length


def _reasoning_length(body: str, message: dict) -> int:
    """Characters at the start of an answer's text that are its reasoning (through ``</think>`` and the
    blank line after it, or the ``reasoning_content`` text where a template writes no tags)."""
    if THINK_END in body:
        stop = body.index(THINK_END) + len(THINK_END)
        return len(body) - len(body[stop:].lstrip("\n"))
    reasoning = (message.get("reasoning_content") or "").strip()
    found = body.find(reasoning) if reasoning else -1
    return found + len(reasoning) if found >= 0 else 0


def _anchors(message: dict) -> list[str]:
    calls = [c.get("function", c).get("name") or "" for c in message.get("tool_calls") or []]
    return [message.get("reasoning_content") or "", content_text(message.get("content"))] + calls


def has_reasoning(messages: list[dict]) -> bool:
    return any(m.get("reasoning_content") or THINK_END in content_text(m.get("content"))
               for m in messages if m.get("role") == "assistant")


def template_kwargs(messages: list[dict], options: dict) -> dict:
    """``enable_thinking`` for rows without reasoning, when set."""
    if options.get("enable_thinking") is not None and not has_reasoning(messages):
        return {"enable_thinking": options["enable_thinking"]}
    return {}


def _answer(rendered: Callable[[int, bool], str], tokenizer, messages: list[dict], k: int, tools, kwargs: dict,
            specials: list[str], train_reasoning: bool, row: int | None) -> Answer:
    prompt, own = rendered(k, True), rendered(k + 1, False)
    if not own.startswith(prompt):
        raise unstable(row)
    end = _trained_end(own, len(prompt), len(own), _anchors(messages[k]), specials)
    if messages[k].get("tool_calls"):  # the calls are rendered when the render without them differs
        without = {key: value for key, value in messages[k].items() if key != "tool_calls"}
        if render(tokenizer, messages[:k] + [without], False, tools, row, **kwargs) == own:
            raise Unrendered(TOOL_CALLS, own[len(prompt):end])
    missing = unrendered_text(messages[k], own[len(prompt):end], specials)
    if missing:
        raise Unrendered(missing, own[len(prompt):end])
    skip = 0 if train_reasoning else _reasoning_length(own[len(prompt):end], messages[k])
    return Answer(prompt, own, end, skip)


def _groups(answers: list[Answer]) -> list[list[Answer]]:
    """Answers in order, grouped greedily: each group's last render holds every answer of the group."""
    groups: list[list[Answer]] = []
    for answer in answers:
        if groups and all(a.exact_in(answer.own) for a in groups[-1]):
            groups[-1].append(answer)
        else:
            groups.append([answer])
    return groups


def chat_template_samples(conversation: list[dict], tokenizer, specials: list[str], options: dict | None = None,
                          row: int | None = None) -> list[tuple[str, list[tuple[int, int]]]]:
    """``(text, trained character spans)`` per sample of one conversation (see the module doc).

    ChatML, ``[{'input': 'Q', 'output': 'A'}]`` ->
    ``[('<|im_start|>user\\nQ<|im_end|>\\n<|im_start|>assistant\\nA<|im_end|>\\n', [(44, 54)])]``
    """
    options = options or {}
    owners: list[int] = []
    messages = to_messages(conversation, owners=owners)
    tools = row_tools(conversation)
    kwargs = template_kwargs(messages, options)
    plain = [{k: v for k, v in m.items() if k != "loss"} for m in messages]
    rendered = prefix_renders(tokenizer, plain, tools, row, **kwargs)
    answers = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        # An answer's own ``loss`` overrides the flag of the turn that holds it.
        trained = message["loss"] if "loss" in message else flag(conversation[owners[k]], "output_with_loss")
        if trained:
            train_reasoning = message.get("loss") is True or options.get("train_on_reasoning", True)
            answers.append(_answer(rendered, tokenizer, plain, k, tools, kwargs, specials, train_reasoning, row))
    full = rendered(len(plain), False)
    groups = _groups(answers) or [[]]
    samples = []
    for i, group in enumerate(groups):
        last = i == len(groups) - 1
        text = full if last and all(a.exact_in(full) for a in group) else group[-1].own
        samples.append((text, [(len(a.prompt) + a.skip, a.end) for a in group if a.end > len(a.prompt) + a.skip]))
    return samples


# ---------------------------------------------------------------------------
# Which fields a chat template renders: probed once per template with marker texts.

PROBES = {
    "reasoning_content": [{"role": "user", "content": "q"},
                          {"role": "assistant", "content": "a", "reasoning_content": "MARK"}],
    "tool_calls": [{"role": "user", "content": "q"},
                   {"role": "assistant", "content": "", "tool_calls": [
                       {"type": "function", "function": {"name": "MARK", "arguments": {}}}]}],
    "tool messages": [{"role": "user", "content": "q"},
                      {"role": "assistant", "content": "", "tool_calls": [
                          {"type": "function", "function": {"name": "f", "arguments": {}}}]},
                      {"role": "tool", "content": "MARK"}, {"role": "assistant", "content": "a"}],
}
TOOLS_PROBE = [{"type": "function", "function": {"name": "MARK", "description": "d", "parameters": {}}}]


def ignored_fields(tokenizer) -> tuple[str, ...]:
    """Fields of the data the tokenizer's chat template leaves out of its text (``tools`` too)."""
    return _ignored(tokenizer.chat_template or "", tokenizer)


@lru_cache(maxsize=8)
def _ignored(chat_template: str, tokenizer) -> tuple[str, ...]:
    ignored = []
    for field, probe in [*PROBES.items(), ("tools", [{"role": "user", "content": "q"}])]:
        tools = TOOLS_PROBE if field == "tools" else None
        try:
            text = tokenizer.apply_chat_template(probe, tools=tools, tokenize=False)
        except Exception:  # a template that refuses the field says so itself, per row
            continue
        if "MARK" not in text:
            ignored.append(field)
    return tuple(ignored)


def fields_of(conversation: list[dict]) -> set[str]:
    """The probed fields a conversation uses."""
    found = {"tools"} if row_tools(conversation) else set()
    for message in to_messages(conversation):
        if message.get("reasoning_content"):
            found.add("reasoning_content")
        if message.get("tool_calls"):
            found.add("tool_calls")
        if message.get("role") == "tool":
            found.add("tool messages")
    return found


def describe(messages: list[dict]) -> str:
    """A row's kind for counts: 'tool calls', 'reasoning' or 'plain'."""
    if any(m.get("tool_calls") or m.get("role") == "tool" for m in messages):
        return "tool calls"
    return "reasoning" if has_reasoning(messages) else "plain"
