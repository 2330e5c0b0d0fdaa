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

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Iterable, Sequence

import numpy as np

from sfttool.dataset.chat_encode import chat_renderer, chat_template_encoded, processor_encoded, renderer_name, repeat
from sfttool.dataset.chat_targets import render, template_kwargs
from sfttool.dataset.conversation import check_conversation, flag, row_tools, to_messages
from sfttool.dataset.encode_columns import (FlatSamples, arrow_columns, flat_columns, list_columns, numpy_columns,
                                            piece_samples)
from sfttool.dataset.errors import ROW_COLUMN, DatasetError, where
from sfttool.dataset.image_rows import refuse_unbound_images
from sfttool.dataset.image_tokens import image_limits
from sfttool.dataset.tokens import batch_token_ids, bos_eos_ids
from sfttool.dataset.unrendered import refuse, unrendered_turn
from sfttool.utils.templates import chat_template_options, is_hf_chat_template

# ``first_trained`` when no token of a sample is trained: why not (and ``unrendered.REFUSED``).
UNTRAINED_MASKED = -1  # every answer has output_with_loss=False
UNTRAINED_EMPTY = -2   # the answers render to nothing trainable

# A piece is (kind, text, trained); kind is 'text', 'bos' or 'eos'.
Piece = tuple[str, str, bool]


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
# Tokenize pieces (batched) and assemble ids + labels.

def piece_ids(rows: list[list[Piece]], tokenizer) -> list[list[tuple[list[int], bool]]]:
    """Each row's pieces as ``(token ids, trained)``, every text piece of every row tokenized in one call.
    A BOS piece before a text that starts with the BOS token is left out (the template already starts
    with it: keep one)."""
    bos, eos = bos_eos_ids(tokenizer)
    texts = [text for pieces in rows for kind, text, _ in pieces if kind == "text" and text]
    encoded = iter(distinct_token_ids(tokenizer, texts) if texts else [])
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


def distinct_token_ids(tokenizer, texts: list[str]) -> list[list[int]]:
    """``batch_token_ids`` of ``texts``, each distinct text tokenized once: every turn of a template with a
    SEP brings the same separator (``qwen_chat``'s ``"\\n"``, a third of a batch's texts), and the
    tokenizer's cost per text (about 7 microseconds for one character) is paid for each. A text's ids do not
    depend on the texts around it, so the ids are the same; repeated texts share one list (read, never
    changed)."""
    distinct = dict.fromkeys(texts)
    if len(distinct) == len(texts):
        return batch_token_ids(tokenizer, texts)
    ids = dict(zip(distinct, batch_token_ids(tokenizer, list(distinct))))
    return [ids[text] for text in texts]


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
        return repeat(range(len(self.counts)), self.counts)

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
        return {name: repeat(batch[name], self.counts) for name in carry if name != ROW_COLUMN}


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
        return Encoded(conversations=conversations,
                       **processor_encoded(batch, rows, processor, source, chat_options, skip_bad_rows))
    refuse_unbound_images(conversations, rows, source)
    if hf_chat_template:
        return Encoded(conversations=conversations, **chat_template_encoded(
            conversations, rows, tokenizer, input_ids_with_output, source, chat_options, skip_bad_rows))
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


def check_batch(conversations: list, row_numbers: list[int], source: str | None, input_ids_with_output: bool) -> None:
    """Each conversation is well formed (``check_conversation``), and single-turn when no output is encoded."""
    for conversation, row in zip(conversations, row_numbers):
        check_conversation(conversation, row, source, need_output=input_ids_with_output)
        if len(conversation) > 1 and not input_ids_with_output:
            raise DatasetError(f"{where(row, source)}: input_ids_with_output=False only supports "
                               "single-turn conversations")


def why_untrained(conversation: list[dict]) -> int:
    """Why a sample of ``conversation`` has no trained token: ``UNTRAINED_MASKED`` (every answer has
    output_with_loss=False) or ``UNTRAINED_EMPTY`` (its answers render to nothing trainable)."""
    return UNTRAINED_EMPTY if any(flag(turn, "output_with_loss") for turn in conversation) else UNTRAINED_MASKED


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
