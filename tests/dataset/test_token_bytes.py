"""The chat-template encoder finds trained tokens from the ids alone (``token_bytes``, byte-level BPE): the
labels equal those from the tokenizer's own character offsets, on texts with multi-byte characters split
across tokens, special tokens and spans that start or end inside a token; a tokenizer where byte lengths are
not exact, and a text the tokenizer would change, take the offsets path."""
from __future__ import annotations

import random

import numpy as np
import pytest

from sfttool.dataset.tokens import batch_token_ids, trained_spans
from sfttool.dataset.encode_columns import span_samples
from sfttool.dataset.token_bytes import byte_lengths

TEXTS = [
    "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\nIt is 42.<|im_end|>\n",
    "<|im_start|>user\n日本語のテキスト🙂 and ümlauts — ok?<|im_end|>\n<|im_start|>assistant\n🙂🙂 ça va.<|im_end|>\n",
    "  leading spaces\n\n\ttabs\r\nand \u00a0nbsp 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 <|im_end|><|im_start|> x",
    "",
    "a",
]


def spans_of(texts: list[str], seed: int) -> list[list[tuple[int, int]]]:
    """Random sorted, non-overlapping character spans per text (edges anywhere, inside tokens too)."""
    rng = random.Random(seed)
    out = []
    for text in texts:
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, 2 * rng.randint(0, 3))))
        out.append([(a, b) for a, b in zip(cuts[0::2], cuts[1::2]) if a < b])
    return out


def with_backend(tokenizer, change):
    """A copy of ``tokenizer`` whose Rust tokenizer ``change`` edits."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast
    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    change(backend)
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def by_offsets(tokenizer, texts, spans):
    return span_samples(batch_token_ids(tokenizer, texts, with_offsets=True), texts, spans)


@pytest.mark.parametrize("seed", range(5))
def test_labels_from_byte_lengths_equal_labels_from_offsets(tiny_tokenizer, seed):
    assert byte_lengths(tiny_tokenizer) is not None  # the ids-only path is the one under test
    texts = TEXTS * 3
    spans = spans_of(texts, seed)
    fast, reference = trained_spans(tiny_tokenizer, texts, spans), by_offsets(tiny_tokenizer, texts, spans)
    assert np.array_equal(fast.ids, reference.ids) and np.array_equal(fast.lengths, reference.lengths)
    assert np.array_equal(fast.labels, reference.labels)
    assert (fast.labels != -100).any() and (fast.labels == -100).any()


def test_the_real_smollm2_tokenizer_gives_the_same_labels(smollm2_dir):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    assert byte_lengths(tokenizer) is not None
    texts = TEXTS * 2
    spans = spans_of(texts, 7)
    assert np.array_equal(trained_spans(tokenizer, texts, spans).labels, by_offsets(tokenizer, texts, spans).labels)


def test_an_nfc_tokenizer_takes_the_offsets_path_for_a_text_that_is_not_nfc(tiny_tokenizer):
    from tokenizers import normalizers
    tokenizer = with_backend(tiny_tokenizer, lambda b: setattr(b, "normalizer", normalizers.NFC()))
    assert byte_lengths(tokenizer) is not None
    texts = ["caf\u0065\u0301 au lait", "Ångström \u212b", "plain"]  # e + combining accent; the Angstrom sign
    spans = [[(0, 5)], [(3, 12)], [(1, 3)]]
    assert np.array_equal(trained_spans(tokenizer, texts, spans).labels, by_offsets(tokenizer, texts, spans).labels)


def test_byte_lengths_are_refused_where_they_would_not_be_exact(tiny_tokenizer):
    from tokenizers import AddedToken, normalizers, processors
    lowercase = with_backend(tiny_tokenizer, lambda b: setattr(b, "normalizer", normalizers.Lowercase()))
    trimmed = with_backend(tiny_tokenizer, lambda b: setattr(b, "post_processor", processors.ByteLevel(trim_offsets=True)))
    stripping = with_backend(tiny_tokenizer, lambda b: b.add_special_tokens([AddedToken("<mask>", lstrip=True)]))
    for tokenizer in (lowercase, trimmed, stripping):
        assert byte_lengths(tokenizer) is None
        texts = ["Hello <mask> World"]
        spans = [[(2, 9)]]
        assert np.array_equal(trained_spans(tokenizer, texts, spans).labels, by_offsets(tokenizer, texts, spans).labels)
