"""The encoder calls the Rust tokenizer's batch encode directly (``batch_token_ids``): the same ids and
offsets as transformers' ``tokenizer(...)`` on special tokens, empty strings, unicode and whitespace."""
from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from sfttool.dataset.tokens import batch_token_ids

TEXTS = ["", "<|im_start|>user\nhello<|im_end|>\n", "<|im_end|><|im_end|>", "héllo wörld 🙂🙂 中文 e\u0301",
         "  leading and trailing  \n\n", "\t", "tab\tand\r\nnewlines", "x" * 3000, "<|im_start|>", "a<|im_end|>b"]


def _same_as_transformers(tok):
    expected = tok(TEXTS, add_special_tokens=False, return_offsets_mapping=True)
    assert batch_token_ids(tok, TEXTS) == expected["input_ids"]
    with_offsets = batch_token_ids(tok, TEXTS, with_offsets=True)
    assert [ids for ids, _ in with_offsets] == expected["input_ids"]
    assert [list(map(tuple, offsets)) for _, offsets in with_offsets] == \
        [list(map(tuple, offsets)) for offsets in expected["offset_mapping"]]
    assert batch_token_ids(tok, [""]) == [[]]


def test_tiny_tokenizer(tiny_tokenizer_dir):
    _same_as_transformers(AutoTokenizer.from_pretrained(tiny_tokenizer_dir))


def test_smollm2_tokenizer(smollm2_dir):
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    _same_as_transformers(tok)
    assert len(batch_token_ids(tok, ["<|im_start|>"])[0]) == 1  # a special token stays one id


def test_a_backend_that_would_pad_goes_through_transformers(tiny_tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    tok.backend_tokenizer.enable_padding(length=64)
    assert batch_token_ids(tok, TEXTS) == tok(TEXTS, add_special_tokens=False)["input_ids"]
    assert all(len(ids) < 64 for ids in batch_token_ids(tok, TEXTS[:3]))


@pytest.mark.parametrize("text", TEXTS)
def test_one_text_at_a_time_equals_the_batch(tiny_tokenizer_dir, text):
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    assert batch_token_ids(tok, [text]) == [batch_token_ids(tok, TEXTS)[TEXTS.index(text)]]


def test_a_batch_longer_than_a_chunk_is_encoded_in_order(tiny_tokenizer_dir, monkeypatch):
    """The backend is called on slices of about ``CHUNK_CHARACTERS`` characters: several calls give the
    ids and offsets of one call, text by text in order."""
    from sfttool.dataset import tokens

    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    texts = TEXTS * 7
    whole = batch_token_ids(tok, texts), batch_token_ids(tok, texts, with_offsets=True)
    monkeypatch.setattr(tokens, "CHUNK_CHARACTERS", 100)
    chunks = list(tokens.text_chunks(texts, 100))
    assert len(chunks) > 7 and [t for chunk in chunks for t in chunk] == texts
    # each slice ends at the text that takes it to 100 characters (a longer text is a slice of its own)
    assert all(sum(map(len, c)) >= 100 > sum(map(len, c[:-1])) for c in chunks[:-1])
    assert (tokens.batch_token_ids(tok, texts), tokens.batch_token_ids(tok, texts, with_offsets=True)) == whole


def test_repeated_texts_are_tokenized_once_with_the_same_ids(tiny_tokenizer_dir, monkeypatch):
    """Template mode's pieces repeat texts (the SEP after every turn): each distinct text is tokenized once."""
    from sfttool.dataset import encode

    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    texts = ["\n", "<|im_start|>user\nhello<|im_end|>\n", "\n", "héllo", "\n", "héllo", "tab\tand"]
    tokenized = []
    monkeypatch.setattr(encode, "batch_token_ids", lambda t, batch: tokenized.append(list(batch)) or
                        batch_token_ids(t, batch))
    assert encode.distinct_token_ids(tok, texts) == batch_token_ids(tok, texts)
    assert tokenized == [["\n", "<|im_start|>user\nhello<|im_end|>\n", "héllo", "tab\tand"]]
    tokenized.clear()
    assert encode.distinct_token_ids(tok, TEXTS[1:4]) == batch_token_ids(tok, TEXTS[1:4])
    assert tokenized == [TEXTS[1:4]]  # nothing repeated: the list as it is
