"""OpenAssistant Guanaco (timdettmers/openassistant-guanaco): one ``text`` with ``### Human:`` / ``### Assistant:``."""
from __future__ import annotations

import re

from sfttool.dataset.conversation import turns_from_messages
from sfttool.registry import MAP_FUNC

from ._fields import text_field

# Only a speaker marker starts a segment: a `### Heading` in an answer is part of the answer.
# `^` keeps XTuner's reading of a text that starts with `Human:` without the `###`.
_MARKER = re.compile(r"(?:^|###)\s*(Human|Assistant):")


def _segments(text: str) -> list[tuple[str, str, bool]]:
    """``[(role, text, True)]`` in order: ``Human`` is the user, ``Assistant`` the assistant."""
    text = text.strip()
    markers = list(_MARKER.finditer(text))  # text before the first marker is ignored (as XTuner)
    ends = [marker.start() for marker in markers[1:]] + [len(text)]
    return [("user" if marker.group(1) == "Human" else "assistant", text[marker.end():end].strip(), True)
            for marker, end in zip(markers, ends)]


@MAP_FUNC.register_module()
def oasst1_map_fn(example: dict, notes: list[str] | None = None) -> dict:
    """Pair each ``Human`` segment with the ``Assistant`` segment that follows it.

    >>> oasst1_map_fn({'text': '### Human: Hi?### Assistant: Hello.### Human: Bye?'})
    {'conversation': [{'input': 'Hi?', 'output': 'Hello.'}]}
    >>> oasst1_map_fn({'text': '### Human: How?### Assistant: Like so.\\n### Steps\\n1. a'})
    {'conversation': [{'input': 'How?', 'output': 'Like so.\\n### Steps\\n1. a'}]}

    Segments start only at ``### Human:`` / ``### Assistant:``, so Markdown
    headings inside a message stay in it.

    Same policy as sharegpt_map_fn (``turns_from_messages``): consecutive
    segments of one speaker are joined with a blank line, leading Assistant
    segments are dropped (nothing asked them) and so is a final unanswered
    question (it would train nothing). A row without a Human -> Assistant pair
    becomes an empty conversation, which the pipeline drops and counts.
    ``notes`` (a list) collects what the conversion changed.
    """
    return {"conversation": turns_from_messages(_segments(text_field(example, "text", "oasst1_map_fn")), notes)}
