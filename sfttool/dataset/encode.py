"""Encode standard conversation rows into ``input_ids`` and ``labels``.

One encoder serves every reader (the map-style pipeline, the stream, preference
pairs) in both modes below: all texts of a batch are tokenized in one
fast-tokenizer call, every token is read once into flat numpy arrays, and the
columns (cut at ``max_length``, counted) are computed over the whole batch
(``encode_columns``). ``encode_batch`` returns them as Python lists,
``encode_batch_arrays`` in the form ``datasets.map`` writes as it is.

* **Template mode** (XTuner 0.2's ``encode_fn``, token for token): the rows
  were formatted by ``template_map_fn`` (``input`` holds system + instruction,
  ``output`` holds answer + SUFFIX, plus ``need_eos_token`` and ``sep``).
  Per turn: BOS when the previous turn ended with EOS (and before the first),
  input (masked), output (trained unless ``output_with_loss=False``), EOS when
  ``need_eos_token`` (labelled like the output), sep (masked). A conversation
  becomes a list of *pieces* (text or BOS/EOS, each trained or masked).
* **HF chat-template mode** (``PROMPT_TEMPLATE.hf_chat_template``): the
  conversation is rendered with the tokenizer's own jinja ``chat_template``
  and tokenized whole, so the ids are exactly ``apply_chat_template``'s; each
  answer is trained in the form the model produces it at inference (what the
  render ending with it adds to the render of its prompt, through its
  end-of-turn token), and a conversation whose later renders change earlier
  answers (Qwen3's reasoning) becomes several samples (``chat_targets``).
  The built-in chat formats (``PROMPT_TEMPLATE.qwen3``, ``qwen2_5``, ``llama3_1``, ...)
  take this mode with their ``CHAT_FORMAT`` in place of the tokenizer's jinja
  (``chat_format``), so they need no chat template on the tokenizer.

Deliberate differences from XTuner 0.2:

1. BOS is not doubled when the text after it already starts with the BOS
   token (SmolLM2's BOS is ``<|im_start|>``, which ChatML turns begin with;
   XTuner emits it twice). A tokenizer without a BOS token gets no BOS
   (XTuner crashes with ``TypeError: 'NoneType' object is not iterable``).
   No class-name sniffing: XTuner special-cases ``Qwen2TokenizerFast`` by
   name (its BOS is None anyway) and ChatGLM's hard-coded prefix ids, which
   we do not reproduce.
2. Bad rows raise :class:`DatasetError` naming the row and field instead of a
   ``KeyError``/``AssertionError``; an ``input`` of ``None`` counts as ``''``.
3. Truncation and rows without trained tokens are counted (helper columns
   ``num_tokens``/``num_trained``) so the pipeline can log them.
4. Texts are tokenized in batches (same ids as XTuner's per-text ``encode``).
5. A trained answer whose tool calls the template does not render, or that renders empty while the
   row gives it reasoning or text, is refused (``unrendered``): XTuner would train an empty turn.
"""
from __future__ import annotations

import unicodedata
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Iterable, Sequence

import numpy as np

from sfttool.dataset.chat_format import ChatFormat, renderer
from sfttool.dataset.chat_targets import chat_template_samples, render, template_kwargs
from sfttool.dataset.conversation import check_conversation, flag, row_tools, to_messages
from sfttool.dataset.encode_columns import (FlatSamples, arrow_columns, byte_span_samples, flat_columns, list_columns,
                                            numpy_columns, piece_samples, span_samples)
from sfttool.dataset.errors import ROW_COLUMN, DatasetError, where
from sfttool.dataset.image_rows import IMAGES_COLUMN, SIZES_COLUMN, refuse_unbound_images
from sfttool.dataset.image_tokens import (expand_placeholders, image_limits, image_token, image_token_counts,
                                          image_token_id, with_special_tokens)
from sfttool.dataset.token_bytes import byte_lengths, needs_nfc
from sfttool.dataset.unrendered import Unrendered, refuse, unrendered_turn
from sfttool.utils.constants import IGNORE_INDEX
from sfttool.utils.templates import chat_template_options, is_hf_chat_template

# ``first_trained`` when no token of a sample is trained: why not (and ``unrendered.REFUSED``).
UNTRAINED_MASKED = -1  # every answer has output_with_loss=False
UNTRAINED_EMPTY = -2   # the answers render to nothing trainable

# A piece is (kind, text, trained); kind is 'text', 'bos' or 'eos'.
Piece = tuple[str, str, bool]


def bos_eos_ids(tokenizer) -> tuple[list[int], list[int]]:
    """``([bos] or [], [eos] or [])`` of ``tokenizer``."""
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    return ([bos] if bos is not None else []), ([eos] if eos is not None else [])


# ---------------------------------------------------------------------------
# Template mode: XTuner's encode_fn as a list of pieces.

def template_pieces(conversation: list[dict], input_ids_with_output: bool = True,
                    prompt_only_last: bool = False) -> list[Piece]:
    """Pieces of a template-formatted conversation, XTuner 0.2 order.

    >>> template_pieces([{'input': 'Q', 'output': 'A', 'need_eos_token': True, 'sep': '\\n'}])
    [('bos', '', False), ('text', 'Q', False), ('text', 'A', True), ('eos', '', True), ('text', '\\n', False)]

    ``prompt_only_last`` stops after the last turn's input (a prompt to continue).
    """
    pieces: list[Piece] = []
    next_needs_bos = True
    last = len(conversation) - 1
    for i, turn in enumerate(conversation):
        if next_needs_bos:
            pieces.append(("bos", "", False))
        pieces.append(("text", turn.get("input") or "", False))
        if not input_ids_with_output or (prompt_only_last and i == last):
            continue
        trained = flag(turn, "output_with_loss")
        pieces.append(("text", turn["output"], trained))
        next_needs_bos = flag(turn, "need_eos_token")
        if next_needs_bos:
            pieces.append(("eos", "", trained))
        if turn.get("sep"):
            pieces.append(("text", turn["sep"], False))
    return pieces


# ---------------------------------------------------------------------------
# HF chat-template mode (``chat_targets``): the special tokens that end a turn.

def special_token_texts(tokenizer) -> list[str]:
    """Texts of the special tokens (EOS, end-of-turn markers, ...), longest first."""
    texts = set(tokenizer.all_special_tokens)
    for added in getattr(tokenizer, "added_tokens_decoder", {}).values():
        if added.special:
            texts.add(added.content)
    return sorted((t for t in texts if t), key=len, reverse=True)


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


# ---------------------------------------------------------------------------
# Tokenize pieces (batched) and assemble ids + labels.

def batch_token_ids(tokenizer, texts: list[str], with_offsets: bool = False) -> list:
    """``tokenizer(texts, add_special_tokens=False)['input_ids']``, faster.

    A fast tokenizer's Rust backend is called directly: it encodes the batch
    on several threads and skips building Python encodings, which cost about
    as much as the tokenization itself. Same ids. ``with_offsets`` returns
    ``(ids, character offsets)`` per text.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    encode = getattr(backend, "encode_batch" if with_offsets else "encode_batch_fast", None)
    # A backend with stored truncation/padding (from tokenizer.json) would apply it here; transformers' call
    # resets those per call, so use that path then.
    if (encode is None or backend.truncation is not None or backend.padding is not None
            or getattr(tokenizer, "split_special_tokens", False)):
        enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=with_offsets)
        return list(zip(enc["input_ids"], enc["offset_mapping"])) if with_offsets else enc["input_ids"]
    encodings = encode(texts, add_special_tokens=False)
    return [(e.ids, e.offsets) for e in encodings] if with_offsets else [e.ids for e in encodings]


def piece_ids(rows: list[list[Piece]], tokenizer) -> list[list[tuple[list[int], bool]]]:
    """Each row's pieces as ``(token ids, trained)``, every text piece of every row tokenized in one call.
    A BOS piece before a text that starts with the BOS token is left out (the template already starts
    with it: keep one)."""
    bos, eos = bos_eos_ids(tokenizer)
    texts = [text for pieces in rows for kind, text, _ in pieces if kind == "text" and text]
    encoded = iter(batch_token_ids(tokenizer, texts) if texts else [])
    out = []
    for pieces in rows:
        parts: list[tuple[list[int], bool]] = []
        after_bos = False
        for kind, text, trained in pieces:
            if kind == "text":
                ids = next(encoded) if text else []
                if after_bos and ids[:1] == bos:
                    parts.pop()
            elif kind == "bos":
                ids = bos
            else:
                ids = eos
                if not eos:
                    raise DatasetError("the tokenizer has no EOS token but the template needs one "
                                       "(need_eos_token): set tokenizer.eos_token")
            parts.append((ids, trained))
            after_bos = kind == "bos" and bool(bos)
        out.append(parts)
    return out


def pieces_text(pieces: list[Piece], tokenizer) -> str:
    """The text the encoder tokenizes for ``pieces``: BOS/EOS written as their token text, with the same BOS
    rule (no BOS before a text that starts with the BOS token: the encoder keeps one of the two).

    >>> pieces_text([('bos', '', False), ('text', '<|im_start|>user', False)], smollm2_tokenizer)  # doctest: +SKIP
    '<|im_start|>user'
    """
    bos, eos = tokenizer.bos_token or "", tokenizer.eos_token or ""
    texts = []
    for i, (kind, text, _) in enumerate(pieces):
        if kind == "bos":
            following = pieces[i + 1][1] if i + 1 < len(pieces) and pieces[i + 1][0] == "text" else ""
            texts.append("" if following.startswith(bos) else bos)
        else:
            texts.append(text if kind == "text" else eos)
    return "".join(texts)


# ---------------------------------------------------------------------------
# The encoder: one implementation for every mode (template, chat template) and every reader (the
# map-style pipeline, the stream, preference pairs). Each mode lays its samples out as flat numpy arrays
# (``encode_columns``); the columns are computed over the whole batch at once.

@dataclass
class Encoded:
    """A batch's samples, uncut, and where each came from."""
    flat: FlatSamples
    rows: list[int]               # [samples] the row number of each sample
    counts: list[int]             # [conversations] the samples each conversation became
    conversations: list           # [conversations]
    refused: dict[int, int] = field(default_factory=dict)  # sample -> REFUSED code (skip_bad_rows)
    images: list | None = None    # [samples] each sample's images, in order (image rows: ``image_tokens``)
    image_counts: list | None = None  # [samples] tokens per image of each sample
    image_token_id: int | None = None

    def cut(self, max_length: int) -> tuple[Any, dict[str, list]]:
        """Where to cut each sample (``max_length``, or before an image it would split) and, for image rows,
        the ``images`` column (the images each sample keeps whole)."""
        if self.images is None:
            return max_length, {}
        limits, whole = image_limits(self.flat.ids, self.flat.lengths, self.image_token_id, self.image_counts,
                                     max_length)
        return limits, {"images": [list(images[:n]) for images, n in zip(self.images, whole.tolist())]}

    @cached_property
    def owners(self) -> list[int]:
        """[samples] the conversation of each sample."""
        return _repeat(range(len(self.counts)), self.counts)

    def why_untrained(self, sample: int) -> int:
        """``first_trained`` of a sample without a trained token: why not (a negative code)."""
        if sample in self.refused:
            return self.refused[sample]
        return why_untrained(self.conversations[self.owners[sample]])

    def carried(self, batch: dict[str, list], carry: Sequence[str]) -> dict[str, list]:
        """The ``carry`` columns repeated for each sample of their row (``datasets`` needs every kept column
        at the new length when a conversation became several samples)."""
        if len(self.rows) == len(self.counts):
            return {}
        return {name: _repeat(batch[name], self.counts) for name in carry if name != ROW_COLUMN}


def encode_batch(batch: dict[str, list], indices: Iterable[int], tokenizer, max_length: int,
                 input_ids_with_output: bool = True, hf_chat_template: bool = False,
                 source: str | None = None, chat_options: dict | None = None,
                 carry: Sequence[str] = (), skip_bad_rows: bool = False, processor: Any = None) -> dict[str, list]:
    """Batched ``datasets.map`` function: conversations -> samples of ids, labels and counts, as lists.

    >>> encode_batch({'conversation': [[{'input': 'Q', 'output': 'A', 'need_eos_token': True}]]},
    ...              [0], tok, 8)   # doctest: +SKIP
    {'input_ids': [[bos, q, a, eos]], 'labels': [[-100, -100, a, eos]], 'length': [4],
     'num_tokens': [4], 'num_trained': [2], 'first_trained': [2], '_sfttool_row': [0]}

    ``num_tokens`` is the length before right truncation at ``max_length``
    (``length``: after it), ``num_trained`` the tokens with a label, ``first_trained``
    the prompt's length, or why no token is trained (``UNTRAINED_*``, ``unrendered.REFUSED``).
    A conversation is one sample, except in HF chat-template mode where a template that renders
    earlier turns differently later splits it (``chat_targets``); ``ROW_COLUMN`` names each sample's
    row, and the ``carry`` columns are repeated for each sample of their row. A row whose trained answer
    the template cannot render (``unrendered``) is an error, or with ``skip_bad_rows`` one sample without
    tokens whose ``first_trained`` says why (the pipeline drops it, counted).
    """
    encoded = encode_samples(batch, indices, tokenizer, input_ids_with_output, hf_chat_template, source,
                             chat_options, skip_bad_rows, processor)
    limits, images = encoded.cut(max_length)
    out = list_columns(flat_columns(encoded.flat, limits, encoded.why_untrained))
    return {**out, ROW_COLUMN: encoded.rows, **encoded.carried(batch, carry), **images}


def encode_batch_arrays(batch: dict[str, list], indices: Iterable[int], tokenizer, max_length: int,
                        input_ids_with_output: bool = True, hf_chat_template: bool = False,
                        source: str | None = None, chat_options: dict | None = None,
                        carry: Sequence[str] = (), skip_bad_rows: bool = False, processor: Any = None):
    """``encode_batch``'s columns in the form ``datasets.map`` writes as it is: one Arrow table over the flat
    tokens when the only input column kept is ``ROW_COLUMN`` (packing), else one numpy array per sample."""
    encoded = encode_samples(batch, indices, tokenizer, input_ids_with_output, hf_chat_template, source,
                             chat_options, skip_bad_rows, processor)
    limits, images = encoded.cut(max_length)
    columns = flat_columns(encoded.flat, limits, encoded.why_untrained)
    if list(carry) == [ROW_COLUMN]:
        return arrow_columns(columns, {ROW_COLUMN: np.asarray(encoded.rows, np.int64), **images})
    return {**numpy_columns(columns), ROW_COLUMN: encoded.rows, **encoded.carried(batch, carry), **images}


def encode_samples(batch: dict[str, list], indices: Iterable[int], tokenizer, input_ids_with_output: bool,
                   hf_chat_template: bool, source: str | None, chat_options: dict | None,
                   skip_bad_rows: bool, processor: Any = None) -> Encoded:
    """The batch's conversations checked and encoded, uncut (through ``processor``, for image rows)."""
    conversations = batch["conversation"]
    rows = list(batch[ROW_COLUMN] if ROW_COLUMN in batch else indices)  # rows as loaded, when numbered
    check_batch(conversations, rows, source, input_ids_with_output)
    if processor is not None:
        if not input_ids_with_output:
            raise DatasetError("with processor=..., rows are encoded with their answers: "
                               "set input_ids_with_output=True")
        return _processor_samples(batch, rows, processor, source, chat_options, skip_bad_rows)
    refuse_unbound_images(conversations, rows, source)
    if hf_chat_template:
        return _chat_template_samples(conversations, rows, tokenizer, input_ids_with_output, source, chat_options,
                                      skip_bad_rows)
    return _template_samples(conversations, rows, tokenizer, input_ids_with_output, source, skip_bad_rows)


def _template_samples(conversations: list, rows: list[int], tokenizer, input_ids_with_output: bool,
                      source: str | None, skip_bad_rows: bool) -> Encoded:
    refused, pieces = {}, []
    for i, (conversation, row) in enumerate(zip(conversations, rows)):
        missing = unrendered_turn(conversation) if input_ids_with_output else None
        if missing:
            refused[i] = refuse(*missing, row, source, renderer_name(None, False), skip_bad_rows)
        pieces.append([] if missing else template_pieces(conversation, input_ids_with_output))
    return Encoded(piece_samples(piece_ids(pieces, tokenizer)), rows, [1] * len(rows), conversations, refused)


def _chat_template_samples(conversations: list, rows: list[int], tokenizer, input_ids_with_output: bool,
                           source: str | None, chat_options: dict | None, skip_bad_rows: bool) -> Encoded:
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
    return Encoded(flat, _repeat(rows, counts), counts, conversations, refused)


def trained_spans(tokenizer, texts: list[str], spans: list[list[tuple[int, int]]]) -> FlatSamples:
    """``span_samples`` of ``texts`` tokenized whole; from the ids alone where the tokenizer's tokens have
    known byte lengths (``token_bytes``), else with the offsets the tokenizer computes."""
    lengths = byte_lengths(tokenizer)
    if lengths is not None and (not needs_nfc(tokenizer) or all(unicodedata.is_normalized("NFC", t) for t in texts)):
        flat = byte_span_samples(batch_token_ids(tokenizer, texts), texts, spans, lengths)
        if flat is not None:
            return flat
    return span_samples(batch_token_ids(tokenizer, texts, with_offsets=True), texts, spans)


def _processor_samples(batch: dict[str, list], rows: list[int], processor: Any, source: str | None,
                      chat_options: dict | None, skip_bad_rows: bool) -> Encoded:
    """Image rows through the model's processor (HF chat-template mode with images): the processor's chat
    template renders each sample (``chat_targets``, answers trained exactly as for text), each image
    placeholder becomes the tokens the processor makes of that image (``image_tokens``), and the text is
    tokenized whole with the special tokens the processor's call adds, so the ids equal
    ``processor.apply_chat_template(messages, tokenize=True)``. Image tokens are never trained."""
    tokenizer = processor.tokenizer
    specials = special_token_texts(tokenizer)
    token = image_token(processor)
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
            text, own_spans = expand_placeholders(text, own_spans, token, own_counts[:n], row, source)
            texts.append(text)
            spans.append(own_spans)
            images.append(own_images[:n])
            counts.append(own_counts[:n])
        per_row.append(len(samples))
    encoded = with_special_tokens(tokenizer, texts, batch_token_ids(tokenizer, texts, with_offsets=True))
    flat = span_samples(encoded, texts, spans)
    flat.labels[flat.ids == image_token_id(processor)] = IGNORE_INDEX  # images are read, never produced
    return Encoded(flat, _repeat(rows, per_row), per_row, conversations, refused, images=images,
                   image_counts=counts, image_token_id=image_token_id(processor))


def check_batch(conversations: list, row_numbers: list[int], source: str | None, input_ids_with_output: bool) -> None:
    """Each conversation is well formed (``check_conversation``), and single-turn when no output is encoded."""
    for conversation, row in zip(conversations, row_numbers):
        check_conversation(conversation, row, source, need_output=input_ids_with_output)
        if len(conversation) > 1 and not input_ids_with_output:
            raise DatasetError(f"{where(row, source)}: input_ids_with_output=False only supports "
                               "single-turn conversations")


def _repeat(values: Sequence, counts: Sequence[int]) -> list:
    return [value for value, count in zip(values, counts) for _ in range(count)]


def why_untrained(conversation: list[dict]) -> int:
    """Why a sample of ``conversation`` has no trained token: ``UNTRAINED_MASKED`` (every answer has
    output_with_loss=False) or ``UNTRAINED_EMPTY`` (its answers render to nothing trainable)."""
    return UNTRAINED_EMPTY if any(flag(turn, "output_with_loss") for turn in conversation) else UNTRAINED_MASKED


def renderer_name(renderer: Any, hf_chat_template: bool) -> str:
    """What renders the conversations, as messages name it."""
    if not hf_chat_template:
        return "the prompt template"
    return "the template's CHAT_FORMAT" if isinstance(renderer, ChatFormat) else "the tokenizer's chat template"


def encode_prompt(history: list[dict], tokenizer, template: Any = None) -> list[int]:
    """Ids a model continues from to answer the last turn of ``history``.

    ``history`` is standard turns whose last has no ``output``; ``template`` is a
    PROMPT_TEMPLATE entry, its name, ``hf_chat_template``, or None (raw text).
    The ids equal the training encoding of the same turns up to the answer:

    >>> encode_prompt([{'input': 'hi'}], tok, 'qwen_chat')   # doctest: +SKIP
    ids of '<|im_start|>user\\nhi<|im_end|>\\n<|im_start|>assistant\\n'
    """
    if not history:
        raise DatasetError("encode_prompt needs at least one turn")
    history = [dict(turn) for turn in history]
    history[-1].setdefault("output", "")
    if isinstance(template, str):
        from sfttool.utils.templates import get_template
        template = get_template(template)
    check_conversation(history)
    if is_hf_chat_template(template):
        messages = to_messages(history, with_last_output=False)
        # The template's own settings (ENABLE_THINKING, CHAT_FORMAT), as training applied them.
        options = chat_template_options(template)
        text = render(chat_renderer(tokenizer, options), messages, True, row_tools(history),
                      **template_kwargs(messages, options))
        return batch_token_ids(tokenizer, [text])[0]
    if template is not None:
        from sfttool.dataset.map_fns import template_map_fn_factory
        history = template_map_fn_factory(template)({"conversation": history})["conversation"]
    pieces = template_pieces(history, prompt_only_last=True)
    return [token for ids, _ in piece_ids([pieces], tokenizer)[0] for token in ids]
