"""Image-text rows -> one form: each turn's chat messages with content parts, and the row's images.

Three ways to give a row its images, after the dataset map fn:

* OpenAI-style content parts in a turn's ``messages``: ``{"type": "image", "image": PATH}`` (or ``url`` /
  ``path``), ``{"type": "image_url", "image_url": {"url": PATH or a data: URI}}``, with ``{"type": "text"}``;
* LLaVA/XTuner rows (``llava_map_fn``): an ``image`` field and ``<image>`` in the first human turn;
* an ``images`` column, with ``<image>`` placeholders in the text or bare ``{"type": "image"}`` parts.

Each becomes the turn's ``messages`` (JSON text) whose image parts are ``{"type": "image", "image": ABS}``
and the row's ``images`` (absolute paths, or data URIs, in placeholder order) with ``image_sizes``
(``[height, width]`` as the processor sees them, read from the file's header: no pixel is decoded)::

    >>> bind_row([{'input': '<image>\\nWhat is it?', 'output': 'A cat.'}], ['cat.png'], '/data')  # doctest: +SKIP
    ([{'input': '<image>\\nWhat is it?', 'output': 'A cat.', 'messages': '[{"role": "user", "content":
       [{"type": "image", "image": "/data/cat.png"}, {"type": "text", "text": "\\nWhat is it?"}]}, ...]'}],
     ['/data/cat.png'], [[32, 48]])

Relative paths are read from ``image_folder`` when set (XTuner configs' name), else from the folder of
the data file the row came from. A data URI stays in the row as it is (self-contained: nothing is
written to disk); it is decoded like a file, lazily. A missing, unreadable or corrupt image, or a count
of placeholders that differs from the images given, is an ``ImageRowError`` naming the image, the data
file and the row (with ``skip_bad_rows``, a counted drop).
"""
from __future__ import annotations

import base64
import binascii
import io
import json
import os
from typing import Any, Sequence

from sfttool.dataset.conversation import json_list
from sfttool.dataset.errors import DatasetError, where

PLACEHOLDER = "<image>"
IMAGES_COLUMN = "images"          # the row's images, absolute, in placeholder order
SIZES_COLUMN = "image_sizes"      # [[height, width], ...] of each image, from its header
LLAVA_COLUMN = "image"            # XTuner's LLaVA rows: one path (or a list)

# Why a row is dropped with skip_bad_rows (``PipelineReport.dropped`` keys).
DROP_MISSING = "image not found (--skip-bad-rows)"
DROP_UNREADABLE = "image unreadable or corrupt (--skip-bad-rows)"
DROP_COUNT = "<image> placeholders differ from the images given (--skip-bad-rows)"


class ImageRowError(DatasetError):
    """A bad image or placeholder count; ``cause`` is the drop reason under skip_bad_rows."""

    def __init__(self, message: str, cause: str):
        super().__init__(message)
        self.cause = cause


# ---------------------------------------------------------------------------
# References: what each message says about its images, in order.

def _part_reference(part: dict) -> Any:
    """The path / URI an image part names, or None for a bare ``{"type": "image"}`` (filled from the
    row's images)."""
    if part.get("type") == "image_url":
        url = part.get("image_url")
        return url.get("url") if isinstance(url, dict) else url
    for key in ("image", "url", "path"):
        if part.get(key):
            return part[key]
    return None


def _is_image_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in ("image", "image_url")


def _text_parts(text: str) -> list[dict]:
    """``'<image>\\nQ'`` -> ``[{'type': 'image'}, {'type': 'text', 'text': '\\nQ'}]``."""
    parts: list[dict] = []
    for i, piece in enumerate(text.split(PLACEHOLDER)):
        if i:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts


def _turn_messages(turn: dict) -> list[dict]:
    """A turn's chat messages: its ``messages``, else its question and answer as two messages."""
    own = json_list(turn.get("messages"))
    if own:
        return own
    messages = [{"role": "user", "content": turn["input"]}] if turn.get("input") else []
    return messages + [{"role": "assistant", "content": turn.get("output")}]


def _with_parts(message: dict, placeholders: bool) -> tuple[dict, list[Any]]:
    """The message with its images as parts, and each image's reference (None: from the row's images).
    A string is split at ``<image>`` only when the row gives images (``placeholders``)."""
    content = message.get("content")
    if isinstance(content, str):
        if not (placeholders and PLACEHOLDER in content):
            return message, []
        content = _text_parts(content)
    if not isinstance(content, list):
        return message, []
    parts, references = [], []
    for part in content:
        if _is_image_part(part):
            references.append(_part_reference(part))
            parts.append({"type": "image"})
        else:  # without Arrow's nulls: a template may test `'image' in part`
            parts.append({k: v for k, v in part.items() if v is not None} if isinstance(part, dict) else part)
    return {**message, "content": parts}, references


def _row_images(given: Any) -> list[Any]:
    """The row's ``images`` / ``image`` value as a list (None: none)."""
    if given is None or given == "":
        return []
    return list(given) if isinstance(given, (list, tuple)) else [given]


# ---------------------------------------------------------------------------
# Files: resolved and checked from their header.

def resolve_path(reference: Any, image_folder: str | None, data_folder: str | None, row: int,
                 source: str | None) -> str:
    """An absolute path (or the data URI as it is) for an image reference."""
    if not isinstance(reference, str) or not reference:
        raise ImageRowError(f"{where(row, source)}: an image reference must be a path or a data: URI, got "
                            f"{reference!r:.60}", DROP_UNREADABLE)
    if reference.startswith("data:"):
        return reference
    if reference.startswith(("http://", "https://")):
        raise ImageRowError(f"{where(row, source)}: image {reference!r:.80} is a URL; images are not fetched: "
                            "download them and give their paths", DROP_MISSING)
    reference = reference.removeprefix("file://")
    if os.path.isabs(reference):
        return reference
    folder = image_folder or data_folder
    if folder is None:
        raise ImageRowError(f"{where(row, source)}: image {reference!r} is a relative path and the data has no "
                            "file folder to read it from: set image_folder", DROP_MISSING)
    return os.path.abspath(os.path.join(folder, reference))


def _open(path: str):
    """PIL's lazy open: the header only."""
    from PIL import Image
    if path.startswith("data:"):
        header, _, payload = path.partition(",")
        if ";base64" not in header:
            raise ValueError("a data: URI image must be base64")
        return Image.open(io.BytesIO(base64.b64decode(payload, validate=True)))
    return Image.open(path)


def image_name(path: str) -> str:
    """A path as messages print it (a data: URI shortened)."""
    return f"{path[:40]}..." if path.startswith("data:") else path


def _orientation(image) -> int | None:
    """The EXIF Orientation from what the header holds. A PNG's ``getexif()`` decodes the whole image to look
    for an eXIf chunk after the pixels, so a PNG's is read only when its eXIf chunk comes first."""
    from PIL import Image
    if image.format != "PNG":
        return image.getexif().get(0x0112)
    if not image.info.get("exif"):
        return None
    exif = Image.Exif()
    exif.load(image.info["exif"])
    return exif.get(0x0112)


def image_size(path: str, row: int, source: str | None) -> list[int]:
    """``[height, width]`` as the processor will see the image (EXIF rotation applied, as transformers'
    ``load_image`` does), from its header."""
    from PIL import UnidentifiedImageError
    if not path.startswith("data:") and not os.path.isfile(path):
        raise ImageRowError(f"{where(row, source)}: image {path} not found", DROP_MISSING)
    try:
        with _open(path) as image:
            width, height = image.size
            rotated = _orientation(image) in (5, 6, 7, 8)  # a quarter turn
    except (UnidentifiedImageError, OSError, ValueError, binascii.Error, SyntaxError) as exc:
        raise ImageRowError(f"{where(row, source)}: image {image_name(path)} cannot be read "
                            f"({type(exc).__name__}: {exc}); replace or remove it", DROP_UNREADABLE) from None
    return [width, height] if rotated else [height, width]


def decode_image(path: str, row: int, source: str | None) -> None:
    """Decode the whole image (``check-custom-dataset --decode-images``): a file whose header reads but whose
    pixels do not (a download cut short) is an ``ImageRowError`` here rather than when its row is read."""
    try:
        with _open(path) as image:
            image.load()
    except (OSError, ValueError, binascii.Error, SyntaxError) as exc:
        raise ImageRowError(f"{where(row, source)}: image {image_name(path)} cannot be decoded "
                            f"({type(exc).__name__}: {exc}); replace or remove it", DROP_UNREADABLE) from None


# ---------------------------------------------------------------------------
# A row.

def bind_row(conversation: list[dict], given: Any, image_folder: str | None, data_folder: str | None,
             row: int = 0, source: str | None = None) -> tuple[list[dict], list[str], list[list[int]]]:
    """``(conversation, images, sizes)``: every image of the row bound to its message (see the module
    doc); a row without images comes back as it is."""
    row_images = _row_images(given)
    turns, references = [], []
    for turn in conversation:
        messages = _turn_messages(turn) if turn.get("messages") or row_images else None
        if messages is None:
            turns.append((turn, None))
            continue
        bound = [_with_parts(m, bool(row_images)) for m in messages]
        wrong = next((m.get("role") for m, refs in bound if refs and m.get("role") != "user"), None)
        if wrong is not None:
            raise DatasetError(f"{where(row, source)}: an image in a message of role {wrong!r}; images go in user "
                               "messages (the model reads them, it is not trained to produce them)")
        references += [ref for _, refs in bound for ref in refs]
        turns.append((turn, [m for m, _ in bound]))
    references = _fill(references, row_images, row, source)
    if not references:
        return conversation, [], []
    paths = [resolve_path(ref, image_folder, data_folder, row, source) for ref in references]
    sizes = [image_size(path, row, source) for path in paths]
    filled = iter(paths)
    out = []
    for turn, messages in turns:
        if messages is not None:
            messages = [_bound(m, filled) for m in messages]
            turn = {**turn, "messages": json.dumps(messages, ensure_ascii=False)}
        out.append(turn)
    return out, paths, sizes


def _fill(references: list[Any], row_images: list[Any], row: int, source: str | None) -> list[Any]:
    """Bare placeholders take the row's images in order; the counts must agree."""
    bare = sum(ref is None for ref in references)
    if bare != len(row_images):
        raise ImageRowError(f"{where(row, source)}: {bare} {PLACEHOLDER} placeholders (or bare image parts) but "
                            f"{len(row_images)} images given; give one image per placeholder", DROP_COUNT)
    given = iter(row_images)
    return [next(given) if ref is None else ref for ref in references]


def _bound(message: dict, paths) -> dict:
    content = message.get("content")
    if not isinstance(content, list):
        return message
    return {**message, "content": [{"type": "image", "image": next(paths)} if p.get("type") == "image" else p
                                   for p in content]}


def refuse_unbound_images(conversations: Sequence[Any], rows: Sequence[int], source: str | None) -> None:
    """Image parts reaching an encoder without a processor (a stream, a mix of sources): nothing would
    expand them into their tokens or load their pixels, so the row is an error naming it."""
    for conversation, row in zip(conversations, rows):
        for turn in conversation if isinstance(conversation, list) else ():
            messages = turn.get("messages") if isinstance(turn, dict) else None
            if isinstance(messages, str) and ('"type": "image' in messages or '"type":"image' in messages):
                raise DatasetError(f"{where(row, source)}: the row has images, which only process_hf_dataset "
                                   "with processor=... encodes (the model's processor expands each image into "
                                   "its tokens); see docs/multimodal.md")
