"""Token-level helpers of the encoders: a batch of texts to ids (with offsets, or the trained tokens of
character spans), BOS/EOS ids and the special tokens' texts."""
from __future__ import annotations

import unicodedata
from typing import Iterator

from sfttool.dataset.encode_columns import FlatSamples, byte_span_samples, span_samples
from sfttool.dataset.token_bytes import byte_lengths, needs_nfc


def bos_eos_ids(tokenizer) -> tuple[list[int], list[int]]:
    """``([bos] or [], [eos] or [])`` of ``tokenizer``."""
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    return ([bos] if bos is not None else []), ([eos] if eos is not None else [])


def special_token_texts(tokenizer) -> list[str]:
    """Texts of the special tokens (EOS, end-of-turn markers, ...), longest first."""
    texts = set(tokenizer.all_special_tokens)
    for added in getattr(tokenizer, "added_tokens_decoder", {}).values():
        if added.special:
            texts.add(added.content)
    return sorted((t for t in texts if t), key=len, reverse=True)


# Characters per call of the tokenizer's backend. One call over a whole map batch (1,000 conversations,
# about 3 M characters) cost 10-15 % more CPU per token than calls over 0.25-1 M characters, with one thread
# and with two (the encodings of a call are all alive until their ids are read): benchmarks/tokenizer_limit.py.
CHUNK_CHARACTERS = 1_000_000


def text_chunks(texts: list[str], characters: int = CHUNK_CHARACTERS) -> Iterator[list[str]]:
    """``texts`` in consecutive slices of about ``characters`` characters (a longer text alone).

    >>> [len(chunk) for chunk in text_chunks(['ab', 'cd', 'e', 'fgh'], characters=3)]
    [2, 2]
    """
    start, size = 0, 0
    for end, text in enumerate(texts, 1):
        size += len(text)
        if size >= characters:
            yield texts[start:end]
            start, size = end, 0
    if start < len(texts):
        yield texts[start:]


def batch_token_ids(tokenizer, texts: list[str], with_offsets: bool = False) -> list:
    """``tokenizer(texts, add_special_tokens=False)['input_ids']``, faster.

    A fast tokenizer's Rust backend is called directly: it encodes the batch
    on several threads and skips building Python encodings, which cost about
    as much as the tokenization itself; a long batch goes in ``text_chunks``.
    Same ids. ``with_offsets`` returns ``(ids, character offsets)`` per text.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    encode = getattr(backend, "encode_batch" if with_offsets else "encode_batch_fast", None)
    # A backend with stored truncation/padding (from tokenizer.json) would apply it here; transformers' call
    # resets those per call, so use that path then.
    if (encode is None or backend.truncation is not None or backend.padding is not None
            or getattr(tokenizer, "split_special_tokens", False)):
        enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=with_offsets)
        return list(zip(enc["input_ids"], enc["offset_mapping"])) if with_offsets else enc["input_ids"]
    out: list = []
    for chunk in text_chunks(texts, CHUNK_CHARACTERS):
        # A slice's encodings are freed before the next slice is encoded (no name holds them): held across
        # the next call, the tokenizer took 9-11 % more CPU per token (benchmarks/tokenizer_limit.py's limit
        # beside the pipeline's calls on the same texts, in turn).
        if with_offsets:
            out += [(e.ids, e.offsets) for e in encode(chunk, add_special_tokens=False)]
        else:
            out += [e.ids for e in encode(chunk, add_special_tokens=False)]
    return out


def trained_spans(tokenizer, texts: list[str], spans: list[list[tuple[int, int]]]) -> FlatSamples:
    """``span_samples`` of ``texts`` tokenized whole; from the ids alone where the tokenizer's tokens have
    known byte lengths (``token_bytes``), else with the offsets the tokenizer computes."""
    lengths = byte_lengths(tokenizer)
    if lengths is not None and (not needs_nfc(tokenizer) or all(unicodedata.is_normalized("NFC", t) for t in texts)):
        flat = byte_span_samples(batch_token_ids(tokenizer, texts), texts, spans, lengths)
        if flat is not None:
            return flat
    return span_samples(batch_token_ids(tokenizer, texts, with_offsets=True), texts, spans)
