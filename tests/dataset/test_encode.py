"""Encoding: XTuner 0.2 semantics token for token, HF chat-template mode, encode_prompt."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from sfttool import assets
from sfttool.dataset.encode import encode_batch, encode_prompt, template_pieces
from sfttool.dataset.errors import DatasetError
from sfttool.dataset.map_fns import template_map_fn_factory
from sfttool.utils import PROMPT_TEMPLATE

IGNORE = -100
REPO = Path(__file__).resolve().parents[2]


def _xtuner_reference():
    spec = importlib.util.spec_from_file_location("xtuner_reference", REPO / "benchmarks" / "xtuner_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.xtuner_encode_fn


def encode_one(conversation, tokenizer, max_length=4096, hf=False, **kw):
    out = encode_batch({"conversation": [conversation]}, [0], tokenizer, max_length, hf_chat_template=hf, **kw)
    return {k: v[0] for k, v in out.items()}


def templated(conversation, template):
    return template_map_fn_factory(template)({"conversation": conversation})["conversation"]


def ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


TWO_TURNS = [{"system": "You are a helpful assistant.", "input": "hello world", "output": "good day."},
             {"input": "one two?", "output": "three."}]


# ---------------------------------------------------------------------------
# Template mode, hand-checked.

def test_hand_checked_eos_template_with_bos(tiny_tokenizer_bos):
    """need_eos_token=True: BOS before every turn, EOS trained, sep masked."""
    tok = tiny_tokenizer_bos
    conv = [{"input": "Q1", "output": "A1", "need_eos_token": True, "sep": "\n"},
            {"input": "Q2", "output": "A2", "need_eos_token": True, "sep": "\n"}]
    bos, eos = tok.bos_token_id, tok.eos_token_id
    assert (bos, eos) == (3, 2)
    q1, a1, q2, a2, nl = (ids(tok, t) for t in ("Q1", "A1", "Q2", "A2", "\n"))
    out = encode_one(conv, tok)
    assert out["input_ids"] == [bos, *q1, *a1, eos, *nl, bos, *q2, *a2, eos, *nl]
    assert out["labels"] == ([IGNORE] * (1 + len(q1)) + a1 + [eos] + [IGNORE] * len(nl)
                             + [IGNORE] * (1 + len(q2)) + a2 + [eos] + [IGNORE] * len(nl))
    assert out["num_trained"] == len(a1) + len(a2) + 2


def test_hand_checked_literal_ids(tiny_tokenizer_bos):
    """Pinned ids for one tiny example (the tiny tokenizer is trained deterministically)."""
    conv = [{"input": "hello", "output": "world", "need_eos_token": True, "sep": ""}]
    out = encode_one(conv, tiny_tokenizer_bos)
    hello, world = ids(tiny_tokenizer_bos, "hello"), ids(tiny_tokenizer_bos, "world")
    assert out["input_ids"] == [3, *hello, *world, 2]
    assert out["labels"] == [-100] * (1 + len(hello)) + world + [2]


def test_qwen_chat_suffix_as_eos(tiny_tokenizer_bos):
    """SUFFIX_AS_EOS: BOS only before the first turn; <|im_end|> is trained as part of the output."""
    tok = tiny_tokenizer_bos
    conv = templated(TWO_TURNS, PROMPT_TEMPLATE.qwen_chat)
    out = encode_one(conv, tok)
    in1, out1, in2, out2, nl = (ids(tok, t) for t in (conv[0]["input"], conv[0]["output"], conv[1]["input"],
                                                       conv[1]["output"], "\n"))
    assert conv[0]["output"] == "good day.<|im_end|>"
    assert out["input_ids"] == [3, *in1, *out1, *nl, *in2, *out2, *nl]
    assert out["labels"] == [IGNORE] * (1 + len(in1)) + out1 + [IGNORE] * (len(nl) + len(in2)) + out2 + [IGNORE]
    assert out1[-1] == tok.convert_tokens_to_ids("<|im_end|>")


def test_no_bos_tokenizer_does_not_crash(tiny_tokenizer):
    conv = [{"input": "Q", "output": "A", "need_eos_token": True, "sep": ""}]
    out = encode_one(conv, tiny_tokenizer)
    assert out["input_ids"] == ids(tiny_tokenizer, "Q") + ids(tiny_tokenizer, "A") + [tiny_tokenizer.eos_token_id]


def test_output_with_loss_false_masks_turn_and_eos(tiny_tokenizer_bos):
    conv = [{"input": "Q1", "output": "A1", "need_eos_token": True, "output_with_loss": False},
            {"input": "Q2", "output": "A2", "need_eos_token": True}]
    out = encode_one(conv, tiny_tokenizer_bos)
    a2 = ids(tiny_tokenizer_bos, "A2")
    assert [x for x in out["labels"] if x != IGNORE] == a2 + [2]


def test_none_fields_mean_defaults(tiny_tokenizer_bos):
    """Arrow fills a field other rows have with None: it must mean "not set"."""
    conv = [{"input": "Q", "output": "A", "need_eos_token": None, "output_with_loss": None, "sep": None,
             "system": None}]
    assert encode_one(conv, tiny_tokenizer_bos)["labels"][-1] == 2


def test_truncation_counted(tiny_tokenizer_bos):
    conv = [{"input": "hello world " * 10, "output": "the answer " * 10, "need_eos_token": True}]
    full = encode_one(conv, tiny_tokenizer_bos)
    cut = encode_one(conv, tiny_tokenizer_bos, max_length=7)
    assert cut["num_tokens"] == len(full["input_ids"]) > 7
    assert cut["input_ids"] == full["input_ids"][:7] and cut["labels"] == full["labels"][:7]


@pytest.mark.parametrize("name", ["default", "qwen_chat", "llama2_chat", "internlm2_chat", "llama3_chat",
                                  "mistral", "gemma", "phi3_chat", "vicuna", "zephyr"])
@pytest.mark.parametrize("bos", [True, False])
def test_equals_xtuner_encode_fn(name, bos, tiny_tokenizer, tiny_tokenizer_bos):
    """Token for token XTuner 0.2's encode_fn, on 40 multi-turn rows, batched."""
    tok = tiny_tokenizer_bos if bos else tiny_tokenizer
    reference = _xtuner_reference()
    rows = [{"conversation": templated(r["conversation"], PROMPT_TEMPLATE[name])}
            for r in assets.tiny_conversations(40, seed=1)]
    batch = encode_batch({"conversation": [r["conversation"] for r in rows]}, range(40), tok, 96)
    for i, row in enumerate(rows):
        ref = reference(row, tok, 96)
        assert batch["input_ids"][i] == ref["input_ids"]
        assert batch["labels"][i] == ref["labels"]


def test_template_pieces_order():
    pieces = template_pieces([{"input": "Q", "output": "A", "need_eos_token": False, "sep": "\n"},
                              {"input": "Q2", "output": "A2", "need_eos_token": False}])
    assert pieces == [("bos", "", False), ("text", "Q", False), ("text", "A", True), ("text", "\n", False),
                      ("text", "Q2", False), ("text", "A2", True)]


# ---------------------------------------------------------------------------
# Bad rows.

@pytest.mark.parametrize("conv, message", [
    ([{"input": "Q"}], "row 0, field 'conversation[0].output': expected a string, got missing"),
    ([{"input": "Q", "output": 3}], "field 'conversation[0].output': expected a string, got an int"),
    ([{"input": ["Q"], "output": "A"}], "field 'conversation[0].input': expected a string, got a list"),
    ([{"role": "user", "content": "Q"}], "no `input`/`output` (keys: content, role)"),
    ("hello", "expected a list of turns"),
    ([{"input": "Q", "output": "A"}, {"system": "S", "input": "Q", "output": "A"}],
     "`system` is only allowed on the first turn"),
])
def test_bad_rows_raise_with_row_and_field(conv, message, tiny_tokenizer):
    with pytest.raises(DatasetError, match=None) as err:
        encode_one(conv, tiny_tokenizer)
    assert message in str(err.value)


# ---------------------------------------------------------------------------
# HF chat-template mode.

def test_chat_template_equals_chatml_template(tiny_tokenizer):
    """Same ids and labels as the built-in qwen_chat path on a ChatML tokenizer."""
    for row in assets.tiny_conversations(30, seed=2):
        conv = row["conversation"]
        hf = encode_one(conv, tiny_tokenizer, hf=True)
        builtin = encode_one(templated(conv, PROMPT_TEMPLATE.qwen_chat), tiny_tokenizer)
        assert hf["input_ids"] == builtin["input_ids"]
        assert hf["labels"] == builtin["labels"]


def test_chat_template_text_equals_apply_chat_template(tiny_tokenizer):
    from sfttool.dataset.encode import to_messages
    conv = TWO_TURNS
    out = encode_one(conv, tiny_tokenizer, hf=True)
    text = tiny_tokenizer.apply_chat_template(to_messages(conv), tokenize=False)
    assert tiny_tokenizer.decode(out["input_ids"]) == text
    trained = tiny_tokenizer.decode([t for t in out["labels"] if t != IGNORE])
    assert trained == "good day.<|im_end|>three.<|im_end|>"


def test_chat_template_not_prefix_stable_is_an_error(tiny_tokenizer_dir):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    # Renders only the last answer in full, like templates that strip past reasoning.
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: "
                         "{% if loop.last %}{{ m['content'] }}{% else %}...{% endif %}\n{% endfor %}")
    with pytest.raises(DatasetError, match="renders earlier turns differently"):
        encode_one(TWO_TURNS, tok, hf=True)


def test_chat_template_missing_is_an_error(tiny_tokenizer_dir):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    tok.chat_template = None
    with pytest.raises(DatasetError, match="has none"):
        encode_one(TWO_TURNS, tok, hf=True)


@pytest.mark.real_asset
def test_chat_template_smollm2_equals_chatml(smollm2_dir):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    for row in assets.tiny_conversations(20, seed=3):
        conv = [dict(t) for t in row["conversation"]]
        conv[0]["system"] = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
        hf = encode_one(conv, tok, hf=True)
        builtin = encode_one(templated(conv, PROMPT_TEMPLATE.qwen_chat), tok)
        assert hf["input_ids"] == builtin["input_ids"]
        assert hf["labels"] == builtin["labels"]
        im_end = tok.convert_tokens_to_ids("<|im_end|>")
        assert sum(1 for t in hf["labels"] if t == im_end) == len(conv)  # every end-of-turn trained


MISTRAL_LIKE_JINJA = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] + eos_token }}{% endif %}{% endfor %}")


@pytest.fixture(scope="module")
def sentencepiece_like_tokenizer():
    """Metaspace pre-tokenizer: every encode call puts a "▁" before its first word, as SentencePiece
    tokenizers (Llama 2, Mistral, Phi-3) do, so tokenizing a template piece by piece changes the ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator(assets._corpus() + ["[INST] Good day. [/INST]Three."], trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = MISTRAL_LIKE_JINJA
    return fast


def _apply(tokenizer, messages, **kw):
    out = tokenizer.apply_chat_template(messages, tokenize=True, **kw)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_chat_template_ids_equal_apply_chat_template_on_sentencepiece(sentencepiece_like_tokenizer):
    """Tokenized whole, not piece by piece: no stray "▁" before answers and later turns."""
    from sfttool.dataset.encode import to_messages
    tok = sentencepiece_like_tokenizer
    conv = [{"input": "hello world", "output": "Good day."}, {"input": "one two?", "output": "Three."}]
    out = encode_one(conv, tok, hf=True)
    assert out["input_ids"] == _apply(tok, to_messages(conv))
    trained = [t for t in out["labels"] if t != IGNORE]
    assert not tok.convert_ids_to_tokens(trained)[0].startswith("\u2581")  # the answer follows "]" directly
    assert tok.decode(trained) == "Good day.</s>Three.</s>"
    history = [conv[0], {"input": "one two?"}]
    prompt = encode_prompt(history, tok, PROMPT_TEMPLATE.hf_chat_template)
    assert prompt == _apply(tok, to_messages(history, with_last_output=False), add_generation_prompt=True)
    assert out["input_ids"][:len(prompt)] == prompt and out["labels"][len(prompt)] != IGNORE


def test_labels_from_spans_trains_tokens_that_overlap_an_answer():
    from sfttool.dataset.encode_columns import span_samples
    offsets = [(0, 3), (3, 5), (5, 9), (9, 12), (12, 12), (12, 15)]

    def labels_from_spans(ids, offsets, spans, before=0):
        """The labels of one sample, between ``before`` samples of the same text trained whole and one more."""
        samples = [(ids, offsets)] * (before + 2)
        spans = [[(0, 15)]] * before + [spans, [(0, 15)]]
        return span_samples(samples, ["x" * 15] * (before + 2), spans).labels.tolist()[-2 * len(ids):-len(ids)]
    # The answer is characters 6..12: the token at 5..9 straddles its start and is trained.
    for before in (0, 2):  # another sample's spans never reach into this one
        assert labels_from_spans([1, 2, 3, 4, 5, 6], offsets, [(6, 12)], before) == [IGNORE, IGNORE, 3, 4, IGNORE,
                                                                                    IGNORE]
        assert labels_from_spans([1, 2, 3, 4, 5, 6], offsets, [(0, 3), (12, 15)], before) == [1, IGNORE, IGNORE,
                                                                                             IGNORE, IGNORE, 6]


def test_chat_template_that_ends_a_finished_chat_with_eos(tiny_tokenizer_dir):
    """Phi-3's template appends EOS after the last message unless a generation prompt is asked for,
    so a rendered prefix is not a prefix of the whole conversation; multi-turn rows still encode."""
    from transformers import AutoTokenizer

    from sfttool.dataset.encode import to_messages
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                         "{% else %}<|endoftext|>{% endif %}")
    out = encode_one(TWO_TURNS, tok, hf=True)
    assert out["input_ids"] == _apply(tok, to_messages(TWO_TURNS))
    assert tok.decode([t for t in out["labels"] if t != IGNORE]) == "good day.<|im_end|>three.<|im_end|>"
    prompt = encode_prompt([TWO_TURNS[0], {"input": "one two?"}], tok, PROMPT_TEMPLATE.hf_chat_template)
    assert out["input_ids"][:len(prompt)] == prompt and out["labels"][len(prompt)] != IGNORE


def test_chat_template_that_moves_the_system_prompt(tiny_tokenizer_dir):
    """Mistral v0.3's template puts the system prompt in the last user message: training rows with a
    system prompt and two turns cannot be split into answers (a clear error), but chat prompts work."""
    from transformers import AutoTokenizer

    from sfttool.dataset.encode import to_messages
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    tok.chat_template = (
        "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
        "{% set messages = messages[1:] %}{% endif %}{% for m in messages %}{% if m['role'] == 'user' %}"
        "<|im_start|>{% if loop.last and system is defined %}{{ system }} {% endif %}{{ m['content'] }}<|im_end|>"
        "{% else %}{{ m['content'] }}<|im_end|>{% endif %}{% endfor %}")
    with pytest.raises(DatasetError, match="row 0: .*moves the system prompt"):
        encode_one(TWO_TURNS, tok, hf=True)
    history = [TWO_TURNS[0], {"input": "one two?"}]
    prompt = encode_prompt(history, tok, PROMPT_TEMPLATE.hf_chat_template)
    assert prompt == _apply(tok, to_messages(history, with_last_output=False), add_generation_prompt=True)


def test_chat_template_without_output_ids_is_an_error(tiny_tokenizer):
    with pytest.raises(DatasetError, match="needs input_ids_with_output=True"):
        encode_one([{"input": "hi", "output": "there"}], tiny_tokenizer, hf=True, input_ids_with_output=False)


# ---------------------------------------------------------------------------
# encode_prompt: the inference prompt equals the training encoding up to the answer.

@pytest.mark.parametrize("template", ["qwen_chat", "llama2_chat", "default", "hf_chat_template"])
def test_encode_prompt_is_training_prefix(template, tiny_tokenizer, tiny_tokenizer_bos):
    tok = tiny_tokenizer if template == "hf_chat_template" else tiny_tokenizer_bos
    tpl = PROMPT_TEMPLATE[template]
    hf = template == "hf_chat_template"
    train = encode_one(TWO_TURNS if hf else templated(TWO_TURNS, tpl), tok, hf=hf)
    history = [TWO_TURNS[0], {"input": TWO_TURNS[1]["input"]}]
    prompt = encode_prompt(history, tok, template)
    first_trained_of_turn2 = [i for i, t in enumerate(train["labels"]) if t != IGNORE]
    answer_start = len(prompt)
    assert train["input_ids"][:answer_start] == prompt
    assert train["labels"][answer_start] != IGNORE and answer_start in first_trained_of_turn2
    assert train["labels"][answer_start - 1] == IGNORE


def test_encode_prompt_chat_template_equals_inference(tiny_tokenizer):
    from sfttool.dataset.encode import to_messages
    history = [TWO_TURNS[0], {"input": "one two?"}]
    expected = tiny_tokenizer.apply_chat_template(to_messages(history, with_last_output=False),
                                                  add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert encode_prompt(history, tiny_tokenizer, PROMPT_TEMPLATE.hf_chat_template) == list(expected)


def test_encode_prompt_single_turn_text(tiny_tokenizer):
    prompt = encode_prompt([{"input": "hi"}], tiny_tokenizer, "qwen_chat")
    assert tiny_tokenizer.decode(prompt) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_batch_token_ids_equals_tokenizer_call(tiny_tokenizer_dir):
    """The direct Rust path gives the same ids, and is skipped when the backend would truncate."""
    from transformers import AutoTokenizer

    from sfttool.dataset.tokens import batch_token_ids
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    texts = ["<|im_start|>user\nhello world<|im_end|>", "The answer is 42.", " two  spaces\n\n"] * 5
    assert batch_token_ids(tok, texts) == tok(texts, add_special_tokens=False)["input_ids"]
    tok.backend_tokenizer.enable_truncation(max_length=2)
    assert batch_token_ids(tok, texts) == tok(texts, add_special_tokens=False)["input_ids"]
    assert len(batch_token_ids(tok, texts)[0]) > 2


def test_chat_template_that_raises_is_a_dataset_error(tiny_tokenizer_dir):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                         "{{ raise_exception('System role not supported') }}{% endif %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(DatasetError, match="row 0: the tokenizer's chat_template failed: .*System role not supported"):
        encode_one(TWO_TURNS, tok, hf=True)


def test_chat_template_llama3_like_layout(tiny_tokenizer_bos_dir):
    """A template that writes BOS itself and no newline after the end token: text identical to
    apply_chat_template, BOS once, trained tokens exactly each answer plus its end token."""
    from transformers import AutoTokenizer

    from sfttool.dataset.encode import to_messages
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_bos_dir)
    tok.chat_template = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n\n"
                         "{{ m['content'] | trim }}<|im_end|>{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n\n{% endif %}")
    out = encode_one(TWO_TURNS, tok, hf=True)
    assert tok.decode(out["input_ids"]) == tok.apply_chat_template(to_messages(TWO_TURNS), tokenize=False)
    assert out["input_ids"].count(tok.bos_token_id) == 1 and out["input_ids"][0] == tok.bos_token_id
    trained = [t for t in out["labels"] if t != IGNORE]
    expected = ids(tok, "good day.<|im_end|>") + ids(tok, "three.<|im_end|>")
    assert trained == expected
    prompt = encode_prompt([TWO_TURNS[0], {"input": "one two?"}], tok, PROMPT_TEMPLATE.hf_chat_template)
    assert out["input_ids"][:len(prompt)] == prompt and out["labels"][len(prompt)] != IGNORE


def test_hf_chat_template_mode_passes_turns_as_written_without_empty_user_messages(tiny_tokenizer):
    from sfttool.dataset.encode import to_messages
    conversation = [{"input": "Q", "output": "A"}, {"input": "", "output": "more"}]
    assert to_messages(conversation) == [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"},
                                         {"role": "assistant", "content": "more"}]
    out = encode_batch({"conversation": [conversation]}, [0], tiny_tokenizer, 256, hf_chat_template=True)
    text = tiny_tokenizer.decode(out["input_ids"][0])
    assert text == ("<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n"
                    "<|im_start|>assistant\nmore<|im_end|>\n")
