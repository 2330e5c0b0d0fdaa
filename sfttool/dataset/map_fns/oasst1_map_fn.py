"""OpenAssistant Guanaco (timdettmers/openassistant-guanaco): one ``text`` with ``### Human:`` / ``### Assistant:``."""
from __future__ import annotations

from sfttool.registry import MAP_FUNC

from ._fields import text_field
from .sharegpt_map_fn import JOIN


def _segments(text: str) -> list[tuple[str, str]]:
    """[(speaker, text)] in order, consecutive segments of one speaker joined as sharegpt_map_fn joins them."""
    merged: list[tuple[str, str]] = []
    for segment in text.strip().split("###"):
        segment = segment.strip()
        if segment.startswith("Human:"):
            speaker, body = "Human", segment[len("Human:"):].strip()
        elif segment.startswith("Assistant:"):
            speaker, body = "Assistant", segment[len("Assistant:"):].strip()
        else:
            continue  # text outside a speaker segment (as XTuner)
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
