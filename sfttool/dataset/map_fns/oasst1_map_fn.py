"""OpenAssistant Guanaco (timdettmers/openassistant-guanaco): one ``text`` with ``### Human:`` / ``### Assistant:``."""
from __future__ import annotations

import re

from sfttool.registry import MAP_FUNC

from ._fields import text_field
from .sharegpt_map_fn import JOIN

# Only a speaker marker starts a segment: a `### Heading` in an answer is part of the answer.
# `^` keeps XTuner's reading of a text that starts with `Human:` without the `###`.
_MARKER = re.compile(r"(?:^|###)\s*(Human|Assistant):")


def _segments(text: str) -> list[tuple[str, str]]:
    """[(speaker, text)] in order, consecutive segments of one speaker joined as sharegpt_map_fn joins them."""
    text = text.strip()
    markers = list(_MARKER.finditer(text))  # text before the first marker is ignored (as XTuner)
    ends = [marker.start() for marker in markers[1:]] + [len(text)]
    merged: list[tuple[str, str]] = []
    for marker, end in zip(markers, ends):
        speaker, body = marker.group(1), text[marker.end():end].strip()
        if merged and merged[-1][0] == speaker:
            merged[-1] = (speaker, merged[-1][1] + JOIN + body)
        else:
            merged.append((speaker, body))
    return merged


@MAP_FUNC.register_module()
def oasst1_map_fn(example: dict) -> dict:
    """Pair each ``Human`` segment with the ``Assistant`` segment that follows it.

    >>> oasst1_map_fn({'text': '### Human: Hi?### Assistant: Hello.### Human: Bye?'})
    {'conversation': [{'input': 'Hi?', 'output': 'Hello.'}]}
    >>> oasst1_map_fn({'text': '### Human: How?### Assistant: Like so.\\n### Steps\\n1. a'})
    {'conversation': [{'input': 'How?', 'output': 'Like so.\\n### Steps\\n1. a'}]}

    Segments start only at ``### Human:`` / ``### Assistant:``, so Markdown
    headings inside a message stay in it.

    Same policy as sharegpt_map_fn: consecutive segments of one speaker are
    joined with a blank line, leading Assistant segments are dropped (nothing
    asked them) and so is a final unanswered question (it would train
    nothing). A row without a Human -> Assistant pair becomes an empty
    conversation, which the pipeline drops and counts.
    """
    merged = _segments(text_field(example, "text", "oasst1_map_fn"))
    while merged and merged[0][0] == "Assistant":
        merged.pop(0)
    # Speakers now alternate from Human, so zip pairs each question with its answer.
    return {"conversation": [{"input": question, "output": answer}
                             for (_, question), (_, answer) in zip(merged[0::2], merged[1::2])]}
