"""Image tokens as the processor makes them, without decoding a pixel.

The processor's chat template renders one placeholder per image (Qwen2.5-VL's ``<|image_pad|>``,
LLaVA's ``<image>``, Gemma 3's ``<start_of_image>``); at inference the processor then replaces it by the
image's tokens (``ImageText``): the image token once per token the image becomes (Qwen: one per merged
2 x 2 patch of the resized image; LLaVA, Gemma 3: a fixed count), which Gemma 3 wraps as
``\\n\\n<start_of_image>`` ... ``<end_of_image>\\n\\n``. It then tokenizes the text, adding the
tokenizer's special tokens unless the text starts with BOS. The encoder does the same, with each image's
token count from its size (``image_rows`` reads it from the file's header), so its ids equal
``processor.apply_chat_template(messages, tokenize=True)``::

    >>> expand_placeholders('<im>Q', [(3, 5)], ImageText('<im>', '<im>'), [3])
    ('<im><im><im>Q', [(11, 13)])
    >>> expand_placeholders('<boi>Q', [(5, 6)], ImageText('<boi>', '<t>', '[<boi>', ']'), [2])
    ('[<boi><t><t>]Q', [(13, 14)])

``max_length`` never cuts through an image's tokens: the cut moves back to the image's first token
(``image_limits``), and the sample keeps the images before it.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import numpy as np

from sfttool.dataset.errors import DatasetError, where


def image_token(processor) -> str:
    """The text of the processor's image placeholder (``image_token``), as its chat template renders it."""
    token = getattr(processor, "image_token", None)
    if not isinstance(token, str):
        raise DatasetError(f"processor {type(processor).__name__} has no image_token: image rows need an "
                           "image-text processor (AutoProcessor of a vision-language model)")
    return token


def image_token_id(processor) -> int:
    """The id of the token each image feature replaces: the first id the processor marks as an image token
    (``image_token_ids``, which its ``mm_token_type_ids`` mark 1). For most processors the placeholder's
    own id; Gemma 3's placeholder ``<start_of_image>`` instead begins the run of ``<image_soft_token>``."""
    marked = [i for i in getattr(processor, "image_token_ids", None) or () if i is not None]
    if marked:
        return marked[0]
    token_id = getattr(processor, "image_token_id", None)
    return token_id if token_id is not None else processor.tokenizer.convert_tokens_to_ids(image_token(processor))


@dataclass(frozen=True)
class ImageText:
    """What an image is in the text: the chat template's ``placeholder``, which the processor replaces by
    ``prefix + token * count + suffix``."""
    placeholder: str
    token: str
    prefix: str = ""
    suffix: str = ""

    def expanded(self, count: int) -> str:
        return self.prefix + self.token * count + self.suffix


def image_text(processor) -> ImageText:
    """The processor's ``ImageText``: its placeholder repeated; or, for a processor that wraps the image
    tokens (Gemma 3's ``full_image_sequence``), the text around its run of image tokens."""
    placeholder = image_token(processor)
    full = getattr(processor, "full_image_sequence", None)
    if not isinstance(full, str):
        return ImageText(placeholder, placeholder)
    token = processor.tokenizer.convert_ids_to_tokens(image_token_id(processor))
    first, last = full.find(token), full.rfind(token)
    if first < 0:
        raise DatasetError(f"processor {type(processor).__name__}: its full_image_sequence {full!r:.80} holds no "
                           f"image token {token!r}; its images cannot be encoded without decoding them")
    return ImageText(placeholder, token, full[:first], full[last + len(token):])


def image_token_counts(processor, sizes: Sequence[Sequence[int]]) -> list[int]:
    """Tokens per image of ``sizes`` (``[height, width]`` each), as the processor expands them."""
    if not len(sizes):
        return []
    count = getattr(processor, "_get_num_multimodal_tokens", None)
    if count is None:
        raise DatasetError(f"processor {type(processor).__name__} cannot say how many tokens an image becomes "
                           "(no _get_num_multimodal_tokens); its images cannot be encoded without decoding them")
    return [int(n) for n in count(image_sizes=[list(s) for s in sizes])["num_image_tokens"]]


def expand_placeholders(text: str, spans: list[tuple[int, int]], image: ImageText, counts: Sequence[int],
                        row: int | None = None, source: str | None = None) -> tuple[str, list[tuple[int, int]]]:
    """Each placeholder of ``text`` replaced by the text of its image's ``counts[i]`` tokens, the trained
    character spans moved with the text."""
    token = image.placeholder
    starts = []
    position = text.find(token)
    while position >= 0:
        starts.append(position)
        position = text.find(token, position + len(token))
    if len(starts) != len(counts):
        raise DatasetError(f"{where(row, source)}: the chat template rendered {len(starts)} image placeholders "
                           f"{token!r} for {len(counts)} images (a template that leaves an image out, or "
                           f"{token!r} written in the text); fix the row or the template")
    if not starts:
        return text, spans
    pieces, last = [], 0
    for start, count in zip(starts, counts):
        pieces += [text[last:start], image.expanded(count)]
        last = start + len(token)
    pieces.append(text[last:])
    grown = np.cumsum([len(image.expanded(count)) - len(token) for count in counts])  # [images] growth once past each

    def moved(p: int) -> int:
        passed = int(np.searchsorted(starts, p, side="left"))  # placeholders that start before p
        return p + (int(grown[passed - 1]) if passed else 0)
    return "".join(pieces), [(moved(a), moved(b)) for a, b in spans]


# ---------------------------------------------------------------------------
# The tokenizer's special tokens, as the processor's call adds them.

@lru_cache(maxsize=8)
def _added(tokenizer) -> tuple[tuple[int, ...], tuple[int, ...]]:
    plain = tokenizer("x", add_special_tokens=False)["input_ids"]
    full = tokenizer("x", add_special_tokens=True)["input_ids"]
    for i in range(len(full) - len(plain) + 1):
        if full[i:i + len(plain)] == plain:
            return tuple(full[:i]), tuple(full[i + len(plain):])
    return (), ()


def with_special_tokens(tokenizer, texts: Sequence[str], encoded: list) -> list:
    """``(ids, offsets)`` per text with what ``tokenizer(text)`` adds around it (BOS, ...), as the
    processor's ``apply_chat_template`` tokenizes: with special tokens unless the text starts with BOS.
    The added tokens have empty offsets (never trained)."""
    prefix, suffix = _added(tokenizer)
    if not prefix and not suffix:
        return encoded
    bos = tokenizer.bos_token
    out = []
    for text, (ids, offsets) in zip(texts, encoded):
        if bos is not None and text.startswith(bos):
            out.append((ids, offsets))
            continue
        end = len(text)
        out.append((list(prefix) + list(ids) + list(suffix),
                    [(0, 0)] * len(prefix) + list(offsets) + [(end, end)] * len(suffix)))
    return out


# ---------------------------------------------------------------------------
# max_length and images.

def image_limits(ids: np.ndarray, lengths: np.ndarray, token_id: int, counts: Sequence[Sequence[int]],
                 max_length: int) -> tuple[np.ndarray, np.ndarray]:
    """``(limits, whole)`` per sample: where to cut it (``max_length``, or the first token of an image that
    the cut would split) and how many of its images the kept part holds whole. ``counts``: each sample's
    tokens per image, in order (the image tokens of a sample are its images' runs, one after another).

    >>> image_limits(np.array([7, 9, 9, 9, 7, 9]), np.array([6]), 9, [[3, 1]], 3)
    (array([1]), array([0]))
    """
    limits = np.minimum(lengths, max_length).astype(np.int64)
    whole = np.zeros(len(lengths), np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    for i, own_counts in enumerate(counts):
        if not len(own_counts):
            continue
        positions = np.flatnonzero(ids[offsets[i]:offsets[i + 1]] == token_id)  # [image tokens]
        bounds = np.concatenate([[0], np.cumsum(own_counts)]).astype(np.int64)
        starts, ends = positions[bounds[:-1]], positions[bounds[1:] - 1] + 1  # [images]
        split = (starts < limits[i]) & (ends > limits[i])
        if split.any():
            limits[i] = starts[split][0]
        whole[i] = int((ends <= limits[i]).sum())
    return limits, whole
