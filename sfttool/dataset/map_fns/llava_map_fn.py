"""LLaVA / XTuner image-text rows: ``{"image": PATH, "conversations": [{from: human|gpt, value}, ...]}``
with ``<image>`` in the first human turn (LLaVA-Instruct, ShareGPT4V, XTuner's LLaVA data)."""
from __future__ import annotations

from sfttool.registry import MAP_FUNC

from sfttool.dataset.conversation import turns_from_messages

from .sharegpt_map_fn import _messages, _tagged

IMAGE_TOKEN = "<image>"


def _image_first(text: str) -> str:
    """XTuner's rule: a human message's single ``<image>`` moves to its start, on a line of its own
    (several placeholders stay where they are: each marks its own image)."""
    if text.count(IMAGE_TOKEN) != 1:
        return text
    return (IMAGE_TOKEN + "\n" + text.replace(IMAGE_TOKEN, "").strip()).strip()


@MAP_FUNC.register_module()
def llava_map_fn(example: dict, notes: list[str] | None = None) -> dict:
    """XTuner 0.2's ``llava_map_fn``: each human message with the gpt reply after it is a turn; the image
    placeholder leads its message. The row's ``image`` field is left for the image stage
    (``image_rows``), which binds it to the placeholder, resolves it against ``image_folder`` and
    checks it.

    >>> llava_map_fn({'image': 'coco/1.jpg', 'conversations': [
    ...     {'from': 'human', 'value': 'What is this?\\n<image>'}, {'from': 'gpt', 'value': 'A cat.'}]})
    {'conversation': [{'input': '<image>\\nWhat is this?', 'output': 'A cat.'}]}

    As ``sharegpt_map_fn`` otherwise: leading gpt messages are skipped (XTuner skips them too),
    ``notes`` collects what the conversion changed.
    """
    tagged = [(role, _image_first(text) if role == "user" else text, trained)
              for role, text, trained in _tagged(_messages(example))]
    return {"conversation": turns_from_messages(tagged, notes)}
