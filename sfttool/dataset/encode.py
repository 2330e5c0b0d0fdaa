"""Encode standard conversation rows into ``input_ids`` and ``labels``.

Two modes share one shape: a conversation becomes a list of *pieces*
(text or BOS/EOS, each trained or masked); all texts of a batch are tokenized
in one fast-tokenizer call; the pieces are then concatenated.

* **Template mode** (XTuner 0.2's ``encode_fn``, token for token): the rows
  were formatted by ``template_map_fn`` (``input`` holds system + instruction,
  ``output`` holds answer + SUFFIX, plus ``need_eos_token`` and ``sep``).
  Per turn: BOS when the previous turn ended with EOS (and before the first),
  input (masked), output (trained unless ``output_with_loss=False``), EOS when
  ``need_eos_token`` (labelled like the output), sep (masked).
* **HF chat-template mode** (``PROMPT_TEMPLATE.hf_chat_template``): the
  conversation is rendered with the tokenizer's own jinja ``chat_template``
  and tokenized whole, so the ids are exactly ``apply_chat_template``'s; the
  mask comes from rendering prefixes: the characters an assistant turn adds,
  up to and including its first special (end-of-turn) token, are trained,
  and so is every token that overlaps them.

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
"""
from __future__ import annotations

from typing import Any, Iterable

from sfttool.dataset.conversation import check_conversation, flag, to_messages
from sfttool.dataset.errors import ROW_COLUMN, DatasetError, where
from sfttool.utils.constants import IGNORE_INDEX
from sfttool.utils.templates import is_hf_chat_template

# ``first_trained`` when no token of a sample is trained: why not.
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
# HF chat-template mode: render prefixes to find each answer's span.

def _render(tokenizer, messages: list[dict], add_generation_prompt: bool, row: int | None = None) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # jinja raises its own types (e.g. "System role not supported")
        raise DatasetError(f"{where(row)}: the tokenizer's chat_template failed: {type(exc).__name__}: {exc}; "
                           "fix the conversation (e.g. drop the system prompt) or use a built-in "
                           "PROMPT_TEMPLATE") from None


def special_token_texts(tokenizer) -> list[str]:
    """Texts of the special tokens (EOS, end-of-turn markers, ...), longest first."""
    texts = set(tokenizer.all_special_tokens)
    for added in getattr(tokenizer, "added_tokens_decoder", {}).values():
        if added.special:
            texts.add(added.content)
    return sorted((t for t in texts if t), key=len, reverse=True)


def _trained_end(text: str, start: int, end: int, content: str, specials: list[str]) -> int:
    """End of the trained span of an assistant turn rendered in ``text[start:end]``:
    through the first special token after the content, else the whole turn."""
    anchor = text.find(content.strip(), start, end) if content.strip() else -1
    search_from = anchor + len(content.strip()) if anchor >= 0 else start
    hits = [(pos, -len(s)) for s in specials if (pos := text.find(s, search_from, end)) >= 0]
    if not hits:
        return end
    pos, minus_length = min(hits)  # the earliest; at one position, the longest token
    return pos - minus_length


def _unstable(row: int | None) -> DatasetError:
    return DatasetError(
        f"{where(row)}: the tokenizer's chat_template renders earlier turns differently once later turns "
        "are added (e.g. it moves the system prompt to the last user message, or strips reasoning from "
        "past answers), so answer spans cannot be found by rendering prefixes; use a built-in "
        "PROMPT_TEMPLATE for this model, or a single-turn row")


def chat_template_spans(conversation: list[dict], tokenizer, row: int | None = None,
                        specials: list[str] | None = None) -> tuple[str, list[tuple[int, int]]]:
    """A conversation rendered by ``tokenizer.chat_template``, and the character
    spans of ``text`` to train (each answer through its end-of-turn token).

    ChatML, ``[{'input': 'Q', 'output': 'A'}]`` ->
    ``('<|im_start|>user\\nQ<|im_end|>\\n<|im_start|>assistant\\nA<|im_end|>\\n', [(44, 54)])``

    An answer starts where the rendered prompt before it (with the generation
    prompt) ends; it ends where the rendering up to it stops agreeing with the
    whole conversation, so a template that closes a finished chat with EOS
    (Phi-3) still works.
    """
    _require_chat_template(tokenizer)
    specials = special_token_texts(tokenizer) if specials is None else specials
    messages = to_messages(conversation)
    full = _render(tokenizer, messages, False, row)
    spans = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = _render(tokenizer, messages[:k], True, row)
        start = len(prompt)
        end = _common_prefix_length(_render(tokenizer, messages[:k + 1], False, row), full)
        content = message["content"].strip()
        if not full.startswith(prompt) or end < start or (content and full.find(content, start, end) < 0):
            raise _unstable(row)
        if flag(conversation[_turn_of(messages, k)], "output_with_loss"):
            spans.append((start, _trained_end(full, start, end, message["content"], specials)))
    return full, spans


def _require_chat_template(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise DatasetError("template hf_chat_template needs a tokenizer with a `chat_template`; "
                           "this tokenizer has none: choose a built-in PROMPT_TEMPLATE instead")


def _common_prefix_length(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    return next(i for i in range(n) if a[i] != b[i])


def _turn_of(messages: list[dict], k: int) -> int:
    """Index of the standard turn that message ``k`` (an assistant message) belongs to."""
    return sum(1 for m in messages[:k] if m["role"] == "assistant")


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


def labels_from_spans(ids: list[int], offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """``ids`` with every token that overlaps no trained character span set to -100.

    A token that straddles a span's edge (a BPE token ``" It"`` whose space
    ends the prompt) is trained: the model has to produce it.
    """
    labels = []
    k = 0
    for token, (start, end) in zip(ids, offsets):
        while k < len(spans) and spans[k][1] <= start:
            k += 1
        inside = k < len(spans) and start < spans[k][1] and end > spans[k][0]
        labels.append(token if inside else IGNORE_INDEX)
    return labels


def tokenize_pieces(rows: list[list[Piece]], tokenizer) -> list[tuple[list[int], list[int]]]:
    """Tokenize every text piece of every row in one call; return (input_ids, labels) per row."""
    bos, eos = bos_eos_ids(tokenizer)
    texts = [text for pieces in rows for kind, text, _ in pieces if kind == "text" and text]
    encoded = iter(batch_token_ids(tokenizer, texts) if texts else [])
    out = []
    for pieces in rows:
        input_ids: list[int] = []
        labels: list[int] = []
        after_bos = False
        for kind, text, trained in pieces:
            if kind == "text":
                ids = next(encoded) if text else []
                if after_bos and ids[:1] == bos:  # the template already starts with BOS: keep one
                    del input_ids[-1], labels[-1]
            elif kind == "bos":
                ids = bos
            else:
                ids = eos
                if not eos:
                    raise DatasetError("the tokenizer has no EOS token but the template needs one "
                                       "(need_eos_token): set tokenizer.eos_token")
            input_ids += ids
            labels += ids if trained else [IGNORE_INDEX] * len(ids)
            after_bos = kind == "bos" and bool(bos)
        out.append((input_ids, labels))
    return out


def pieces_text(pieces: list[Piece], tokenizer) -> str:
    """The text ``tokenize_pieces`` encodes: BOS/EOS written as their token text, with the same BOS
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


def encode_batch(batch: dict[str, list], indices: Iterable[int], tokenizer, max_length: int,
                 input_ids_with_output: bool = True, hf_chat_template: bool = False,
                 source: str | None = None) -> dict[str, list]:
    """Batched ``datasets.map`` function: conversations -> ids, labels and counts.

    >>> encode_batch({'conversation': [[{'input': 'Q', 'output': 'A', 'need_eos_token': True}]]},
    ...              [0], tok, 8)   # doctest: +SKIP
    {'input_ids': [[bos, q, a, eos]], 'labels': [[-100, -100, a, eos]], 'length': [4],
     'num_tokens': [4], 'num_trained': [2], 'first_trained': [2]}

    ``num_tokens`` is the length before right truncation at ``max_length``
    (``length``: after it), ``num_trained`` the tokens with a label, ``first_trained``
    the prompt's length (see ``first_trained``), which explains a row left without labels.
    """
    specials = special_token_texts(tokenizer) if hf_chat_template else None
    rows = []
    row_numbers = batch[ROW_COLUMN] if ROW_COLUMN in batch else indices  # rows as loaded, when numbered
    for conversation, row in zip(batch["conversation"], row_numbers):
        check_conversation(conversation, row, source, need_output=input_ids_with_output)
        if len(conversation) > 1 and not input_ids_with_output:
            raise DatasetError(f"{where(row, source)}: input_ids_with_output=False only supports "
                               "single-turn conversations")
        if hf_chat_template:
            if not input_ids_with_output:
                raise DatasetError("template hf_chat_template needs input_ids_with_output=True")
            rows.append(chat_template_spans(conversation, tokenizer, row=row, specials=specials))
        else:
            rows.append(template_pieces(conversation, input_ids_with_output))
    if hf_chat_template:
        # The whole rendered text is tokenized at once, as apply_chat_template does: pieces tokenized
        # apart would differ at their edges (SentencePiece's dummy "▁" prefix, BPE merges).
        encoded = batch_token_ids(tokenizer, [text for text, _ in rows], with_offsets=True)
        rows_ids = [(ids, labels_from_spans(ids, offsets, spans))
                    for (ids, offsets), (_, spans) in zip(encoded, rows)]
    else:
        rows_ids = tokenize_pieces(rows, tokenizer)
    return _truncated_columns(rows_ids, batch["conversation"], max_length)


def _truncated_columns(rows_ids: list[tuple[list[int], list[int]]], conversations: list[list[dict]],
                       max_length: int) -> dict[str, list]:
    """``encode_batch``'s columns: ids and labels cut at ``max_length``, and the counts around the cut."""
    out: dict[str, list] = {"input_ids": [], "labels": [], "length": [], "num_tokens": [], "num_trained": [],
                            "first_trained": []}
    for (input_ids, labels), conversation in zip(rows_ids, conversations):
        out["num_tokens"].append(len(input_ids))
        out["input_ids"].append(input_ids[:max_length])
        out["labels"].append(labels[:max_length])
        out["length"].append(min(len(input_ids), max_length))
        kept = labels[:max_length]
        out["num_trained"].append(len(kept) - kept.count(IGNORE_INDEX))
        out["first_trained"].append(first_trained(labels, conversation))
    return out


def first_trained(labels: list[int], conversation: list[dict]) -> int:
    """Where the first trained token of a whole (uncut) sample is: the prompt's length; when none is
    trained, why not: ``UNTRAINED_MASKED`` (every answer has output_with_loss=False) or ``UNTRAINED_EMPTY``."""
    position = next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), None)
    if position is not None:
        return position
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
        _require_chat_template(tokenizer)
        text = _render(tokenizer, to_messages(history, with_last_output=False), True)
        return batch_token_ids(tokenizer, [text])[0]
    if template is not None:
        from sfttool.dataset.map_fns import template_map_fn_factory
        history = template_map_fn_factory(template)({"conversation": history})["conversation"]
    pieces = template_pieces(history, prompt_only_last=True)
    return tokenize_pieces([pieces], tokenizer)[0][0]
