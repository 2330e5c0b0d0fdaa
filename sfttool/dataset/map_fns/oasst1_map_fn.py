"""OpenAssistant Guanaco (timdettmers/openassistant-guanaco): one ``text`` with ``### Human:`` / ``### Assistant:``."""
from sfttool.registry import MAP_FUNC

from ._fields import text_field


@MAP_FUNC.register_module()
def oasst1_map_fn(example: dict) -> dict:
    """Split the ``###``-delimited dialogue into turns.

    >>> oasst1_map_fn({'text': '### Human: Hi?### Assistant: Hello.### Human: Bye?'})
    {'conversation': [{'input': 'Hi?', 'output': 'Hello.'}]}

    A trailing question without an answer is dropped (it would train nothing).
    Segments are paired in order, as in the source data, which alternates.
    """
    messages = []
    for segment in text_field(example, "text", "oasst1_map_fn").strip().split("###"):
        segment = segment.strip()
        if segment.startswith("Human:"):
            messages.append(segment[len("Human:"):].strip())
        elif segment.startswith("Assistant:"):
            messages.append(segment[len("Assistant:"):].strip())
    if len(messages) % 2:
        messages.pop()
    return {"conversation": [{"input": messages[i], "output": messages[i + 1]}
                             for i in range(0, len(messages), 2)]}
