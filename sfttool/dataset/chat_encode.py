"""HF chat-template mode: conversations rendered by a chat template (the tokenizer's jinja, a built-in
``CHAT_FORMAT``, or an image-text processor's), tokenized whole, each answer trained in the form the model
produces it (``chat_targets``)."""
from __future__ import annotations

from typing import Any, Sequence

from sfttool.dataset.chat_format import ChatFormat, renderer
from sfttool.dataset.chat_targets import chat_template_samples
from sfttool.dataset.encode_columns import span_samples
from sfttool.dataset.errors import DatasetError, where
from sfttool.dataset.image_rows import IMAGES_COLUMN, SIZES_COLUMN
from sfttool.dataset.image_tokens import (expand_placeholders, image_text, image_token_counts, image_token_id,
                                          with_special_tokens)
from sfttool.dataset.tokens import batch_token_ids, special_token_texts, trained_spans
from sfttool.dataset.unrendered import Unrendered, refuse
from sfttool.utils.constants import IGNORE_INDEX


def _require_chat_template(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise DatasetError("template hf_chat_template needs a tokenizer with a `chat_template`; "
                           "this tokenizer has none: choose a built-in PROMPT_TEMPLATE instead")


def chat_renderer(tokenizer, chat_options: dict | None):
    """What renders a conversation in chat-template mode: the template's ``CHAT_FORMAT`` (a built-in
    format such as ``qwen3``), else the tokenizer's own jinja ``chat_template``."""
    chosen = renderer(tokenizer, chat_options)
    if chosen is tokenizer:
        _require_chat_template(tokenizer)
    return chosen


def chat_template_encoded(conversations: list, rows: list[int], tokenizer, input_ids_with_output: bool,
                          source: str | None, chat_options: dict | None, skip_bad_rows: bool) -> dict:
    """Text rows through the chat template (``chat_targets``): ``Encoded``'s fields but the conversations."""
    if not input_ids_with_output:
        raise DatasetError("template hf_chat_template needs input_ids_with_output=True")
    render_with = chat_renderer(tokenizer, chat_options)
    specials = special_token_texts(tokenizer)
    samples: list[tuple[str, list[tuple[int, int]]]] = []
    counts, refused = [], {}
    for conversation, row in zip(conversations, rows):
        try:
            own = chat_template_samples(conversation, render_with, specials, chat_options, row)
        except Unrendered as exc:
            refused[len(samples)] = refuse(exc.feature, exc.trained_as, row, source,
                                           renderer_name(render_with, True), skip_bad_rows)
            own = [("", [])]
        samples += own
        counts.append(len(own))
    # The whole rendered text is tokenized at once, as apply_chat_template does: pieces tokenized
    # apart would differ at their edges (SentencePiece's dummy "▁" prefix, BPE merges).
    texts = [text for text, _ in samples]
    flat = trained_spans(tokenizer, texts, [s for _, s in samples])
    return dict(flat=flat, rows=repeat(rows, counts), counts=counts, refused=refused)


def processor_encoded(batch: dict[str, list], rows: list[int], processor: Any, source: str | None,
                      chat_options: dict | None, skip_bad_rows: bool) -> dict:
    """Image rows through the model's processor (HF chat-template mode with images): the processor's chat
    template renders each sample (``chat_targets``, answers trained exactly as for text), each image
    placeholder becomes the text of the tokens the processor makes of that image (``image_tokens``), and the
    text is tokenized whole with the special tokens the processor's call adds, so the ids equal
    ``processor.apply_chat_template(messages, tokenize=True)``. Image tokens are never trained. ``Encoded``'s
    fields but the conversations."""
    tokenizer = processor.tokenizer
    specials = special_token_texts(tokenizer)
    image = image_text(processor)
    token = image.placeholder
    conversations = batch["conversation"]
    row_images = batch.get(IMAGES_COLUMN) or [[]] * len(rows)
    row_sizes = batch.get(SIZES_COLUMN) or [[]] * len(rows)
    texts, spans, images, counts, per_row, refused = [], [], [], [], [], {}
    for conversation, own_images, sizes, row in zip(conversations, row_images, row_sizes, rows):
        own_images, own_counts = own_images or [], image_token_counts(processor, sizes or [])
        try:
            samples = chat_template_samples(conversation, processor, specials, chat_options, row)
        except Unrendered as exc:
            refused[len(texts)] = refuse(exc.feature, exc.trained_as, row, source, "the processor's chat template",
                                         skip_bad_rows)
            samples = [("", [])]
        rendered = [text.count(token) for text, _ in samples]  # a sample renders the conversation's first images
        if max(rendered) != len(own_images) and len(texts) not in refused:
            raise DatasetError(f"{where(row, source)}: the chat template rendered {max(rendered)} image "
                               f"placeholders {token!r} for {len(own_images)} images (a template that leaves an "
                               f"image out, or {token!r} written in the text); fix the row or the template")
        for (text, own_spans), n in zip(samples, rendered):
            text, own_spans = expand_placeholders(text, own_spans, image, own_counts[:n], row, source)
            texts.append(text)
            spans.append(own_spans)
            images.append(own_images[:n])
            counts.append(own_counts[:n])
        per_row.append(len(samples))
    encoded = with_special_tokens(tokenizer, texts, batch_token_ids(tokenizer, texts, with_offsets=True))
    flat = span_samples(encoded, texts, spans)
    flat.labels[flat.ids == image_token_id(processor)] = IGNORE_INDEX  # images are read, never produced
    return dict(flat=flat, rows=repeat(rows, per_row), counts=per_row, refused=refused, images=images,
                image_counts=counts, image_token_id=image_token_id(processor))


def renderer_name(renderer: Any, hf_chat_template: bool) -> str:
    """What renders the conversations, as messages name it."""
    if not hf_chat_template:
        return "the prompt template"
    return "the template's CHAT_FORMAT" if isinstance(renderer, ChatFormat) else "the tokenizer's chat template"


def repeat(values: Sequence, counts: Sequence[int]) -> list:
    """Each value ``count`` times, in order."""
    return [value for value, count in zip(values, counts) for _ in range(count)]
