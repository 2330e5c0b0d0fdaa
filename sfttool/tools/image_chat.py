"""Prompts with images, for ``sfttool chat --image`` and the sample generations during training
(``EvaluateChatHook(evaluation_images=...)``): the conversation as OpenAI-style content parts, rendered
and tokenized by the model's processor (``apply_chat_template``), which expands each image into its
placeholder tokens exactly as the training rows were encoded.

    >>> image_messages([], 'What is it?', ['cat.png'], system='Be brief.')
    [{'role': 'system', 'content': [{'type': 'text', 'text': 'Be brief.'}]}, {'role': 'user', 'content': [{'type': 'image', 'image': 'cat.png'}, {'type': 'text', 'text': 'What is it?'}]}]
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from sfttool.errors import SfttoolError


class ImageChatError(SfttoolError):
    """An image prompt that cannot be made: the message names the file."""


def image_messages(history: list[dict], text: str, images: list[str] = (), system: str = "") -> list[dict]:
    """``history`` (earlier messages) plus a user turn: its images first, then its text (as LLaVA's and
    Qwen2-VL's examples put them); a system message opens a conversation without history."""
    opening = [{"role": "system", "content": [{"type": "text", "text": system}]}] if system and not history else []
    content = [{"type": "image", "image": str(path)} for path in images] + [{"type": "text", "text": text}]
    return opening + list(history) + [{"role": "user", "content": content}]


def answer_message(text: str) -> dict:
    return {"role": "assistant", "content": [{"type": "text", "text": text}]}


def check_images(paths: list[str]) -> list[str]:
    """Each path names a readable image file; else one line naming it."""
    from PIL import Image, UnidentifiedImageError

    for path in paths:
        try:
            with Image.open(path) as image:
                image.verify()
        except (OSError, UnidentifiedImageError) as exc:
            raise ImageChatError(f"--image {path}: not a readable image ({exc})") from None
    return [str(Path(path)) for path in paths]


def prompt_inputs(processor: Any, messages: list[dict], device: Any = None) -> dict:
    """The model's inputs for ``messages`` ready for the answer: ``input_ids`` [1, prompt],
    ``attention_mask``, the images' ``pixel_values`` (and Qwen2-VL's ``image_grid_thw`` and
    ``mm_token_type_ids``), as the processor makes them at inference."""
    inputs = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                           return_tensors="pt")
    return {key: value.to(device) if device is not None else value for key, value in inputs.items()}
