"""The one encoder (flat numpy arrays over a batch) against the plain reference written from the spec
(``reference_encoder.py``), on every mode: XTuner-style templates, the HF chat template (official Qwen3,
Qwen2.5 and Llama-3.1 templates, and the built-in chat formats), the stream's chunk encoder and
preference pairs; in every output form (lists, one numpy array per row, one Arrow table)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from sfttool import assets
from sfttool.dataset.encode import encode_batch, encode_batch_arrays
from sfttool.dataset.errors import ROW_COLUMN
from sfttool.dataset.map_fns import openai_map_fn, template_map_fn_factory
from sfttool.utils.templates import PROMPT_TEMPLATE, chat_template_options

sys.path.insert(0, str(Path(__file__).resolve().parent))
import reference_encoder as reference  # noqa: E402
from test_chat_targets import (CASES, LLAMA31_ROW, PLAIN_ROW, QWEN3_INLINE_ROW, QWEN3_ROW,  # noqa: E402
                               QWEN25_ROW, RUNS_ROW, call)
from test_chat_targets import tokenizers as official  # noqa: E402, F401  (the official templates' tokenizers)

LENGTHS = [1, 16, 64, 4096]


def edge_conversations() -> list[list[dict]]:
    """Generated conversations and one of each kind the columns count differently."""
    long = " ".join(["word"] * 90)
    return [row["conversation"] for row in assets.tiny_conversations(24, seed=5)] + [
        [{"input": "q", "output": "a", "output_with_loss": False}],
        [{"input": long + "?", "output": "cut away."}],
        [{"input": "short?", "output": long + "."}],
        [{"input": "", "output": "no question."}],
        [{"input": "empty answer?", "output": ""}],
        [{"system": "Be brief.", "input": "one?", "output": "1."},
         {"input": "two?", "output": "2.", "output_with_loss": False}, {"input": "three?", "output": "3."}],
        [{"input": "Q", "output": "A", "need_eos_token": None, "output_with_loss": None, "sep": None,
          "system": None}],
    ]


def chat_conversations() -> list[list[dict]]:
    """``edge_conversations`` a chat template renders (transformers refuses to render the prompt of an
    answer nothing asked: no messages)."""
    return [c for c in edge_conversations() if c[0]["input"]]


def lists(columns: dict) -> dict:
    """Columns of numpy arrays or lists as plain lists (what datasets writes either way)."""
    return {name: [v.tolist() if hasattr(v, "tolist") else v for v in values] for name, values in columns.items()}


def assert_every_form(batch, rows, tokenizer, max_length, expected, **kw):
    """``encode_batch`` (lists) and both forms of ``encode_batch_arrays`` equal the reference's columns."""
    assert encode_batch(batch, rows, tokenizer, max_length, **kw) == expected
    assert lists(encode_batch_arrays(batch, rows, tokenizer, max_length, **kw)) == expected
    table = encode_batch_arrays(batch, rows, tokenizer, max_length, carry=[ROW_COLUMN], **kw)
    assert table.to_pydict() == expected
    assert str(table.schema.field("labels").type) == "list<item: int32>"


# ---------------------------------------------------------------------------
# Template mode.

@pytest.mark.parametrize("max_length", LENGTHS)
@pytest.mark.parametrize("template", ["qwen_chat", "llama2_chat", "default", "llama3_chat", "zephyr"])
@pytest.mark.parametrize("bos", [False, True], ids=["no_bos", "bos"])
def test_template_mode_equals_the_reference(tiny_tokenizer, tiny_tokenizer_bos, template, bos, max_length):
    tok = tiny_tokenizer_bos if bos else tiny_tokenizer
    fn = template_map_fn_factory(template)
    conversations = [fn({"conversation": c})["conversation"] for c in edge_conversations()]
    rows = list(range(100, 100 + len(conversations)))
    expected = reference.encode_rows(conversations, rows, tok, max_length)
    assert len(set(expected["first_trained"])) > 3  # trained, masked and cut samples are all there
    assert_every_form({"conversation": conversations, ROW_COLUMN: rows}, [], tok, max_length, expected)


def test_template_mode_without_outputs_equals_the_reference(tiny_tokenizer_bos):
    fn = template_map_fn_factory("qwen_chat")
    conversations = [fn({"conversation": c[:1]})["conversation"] for c in edge_conversations()]
    rows = list(range(len(conversations)))
    expected = reference.encode_rows(conversations, rows, tiny_tokenizer_bos, 32, input_ids_with_output=False)
    assert_every_form({"conversation": conversations}, rows, tiny_tokenizer_bos, 32, expected,
                      input_ids_with_output=False)


def test_an_empty_batch(tiny_tokenizer):
    expected = reference.encode_rows([], [], tiny_tokenizer, 8)
    assert_every_form({"conversation": [], ROW_COLUMN: []}, [], tiny_tokenizer, 8, expected)


# ---------------------------------------------------------------------------
# HF chat-template mode: the official templates, the built-in chat formats, the tiny ChatML template.

FORMAT_OF = {"qwen3": "qwen3", "qwen2.5": "qwen2_5", "llama3.1": "llama3_1", "qwen3 inline": "qwen3"}
# The rows each template renders (Llama-3.1 allows one call per answer; Qwen2.5 has no reasoning; Qwen3
# moves an answer's place when two follow each other).
QWEN3_ROWS = [QWEN3_ROW, QWEN3_INLINE_ROW, PLAIN_ROW, LLAMA31_ROW]
ROWS_OF = {"qwen3": QWEN3_ROWS, "qwen3 inline": QWEN3_ROWS, "llama3.1": [LLAMA31_ROW, PLAIN_ROW, RUNS_ROW],
           "qwen2.5": [QWEN25_ROW, PLAIN_ROW, RUNS_ROW]}


def chat_rows(name: str) -> list[list[dict]]:
    return [openai_map_fn(row)["conversation"] for row in ROWS_OF[name]]


@pytest.mark.parametrize("max_length", [24, 4096])
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("options", [{}, {"train_on_reasoning": False}], ids=["default", "no_reasoning_trained"])
def test_official_chat_templates_equal_the_reference(official, name, options, max_length):
    tok = official[name]
    conversations = chat_rows(name)
    rows = [7 + i for i in range(len(conversations))]
    expected = reference.encode_rows(conversations, rows, tok, max_length, hf_chat_template=True,
                                     chat_options=options)
    if name.startswith("qwen3"):
        assert len(expected["input_ids"]) > len(rows)  # conversations split into several samples
    assert_every_form({"conversation": conversations, ROW_COLUMN: rows}, [], tok, max_length, expected,
                      hf_chat_template=True, chat_options=options)


@pytest.mark.parametrize("name", ["qwen3", "qwen2.5", "llama3.1"])
def test_chat_formats_equal_the_reference(official, name):
    from transformers import AutoTokenizer
    bare = AutoTokenizer.from_pretrained(official[name].name_or_path)
    bare.chat_template = None
    options = chat_template_options(PROMPT_TEMPLATE[FORMAT_OF[name]])
    conversations = chat_rows(name)
    rows = list(range(len(conversations)))
    expected = reference.encode_rows(conversations, rows, bare, 4096, hf_chat_template=True, chat_options=options)
    assert_every_form({"conversation": conversations}, rows, bare, 4096, expected, hf_chat_template=True,
                      chat_options=options)


@pytest.mark.parametrize("max_length", LENGTHS)
def test_the_tiny_chatml_template_equals_the_reference(tiny_tokenizer, tiny_tokenizer_bos, max_length):
    conversations = chat_conversations()
    for tok in (tiny_tokenizer, tiny_tokenizer_bos):
        rows = list(range(len(conversations)))
        expected = reference.encode_rows(conversations, rows, tok, max_length, hf_chat_template=True)
        assert_every_form({"conversation": conversations}, rows, tok, max_length, expected, hf_chat_template=True)


def test_kept_columns_are_repeated_for_each_sample_of_their_row(official):
    tok = official["qwen3"]
    conversations = chat_rows("qwen3")[:2]
    batch = {"conversation": conversations, ROW_COLUMN: [3, 4], "id": ["a", "b"]}
    expected = reference.encode_rows(conversations, [3, 4], tok, 4096, hf_chat_template=True)
    expected["id"] = ["a" if row == 3 else "b" for row in expected[ROW_COLUMN]]
    assert expected["id"].count("a") == 3
    for encode in (encode_batch, encode_batch_arrays):
        assert lists(encode(batch, [], tok, 4096, hf_chat_template=True, carry=[ROW_COLUMN, "id"])) == expected


# ---------------------------------------------------------------------------
# Rows the template cannot render, dropped with skip_bad_rows: the same codes as the reference's.

TOOL_ROW = {"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}], "messages": [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": "", "tool_calls": [call("get_weather", {"city": "Oslo"})]},
    {"role": "tool", "content": "12 C"}, {"role": "assistant", "content": "12 C."}]}
REASONING_ONLY_ROW = {"messages": [{"role": "user", "content": "Q"},
                                   {"role": "assistant", "content": "", "reasoning_content": "Thinking."}]}


@pytest.mark.parametrize("hf", [False, True], ids=["prompt_template", "chat_template"])
def test_refused_rows_equal_the_reference(tiny_tokenizer, hf):
    rows_in = [PLAIN_ROW, TOOL_ROW, REASONING_ONLY_ROW, PLAIN_ROW]
    conversations = [openai_map_fn(row)["conversation"] for row in rows_in]
    if not hf:
        conversations = [template_map_fn_factory("qwen_chat")({"conversation": c})["conversation"]
                         for c in conversations]
    expected = reference.encode_rows(conversations, [0, 1, 2, 3], tiny_tokenizer, 64, hf_chat_template=hf,
                                     skip_bad_rows=True)
    assert expected["first_trained"][1:3] == [-3, -4] and expected["num_tokens"][1:3] == [0, 0]
    assert_every_form({"conversation": conversations}, [0, 1, 2, 3], tiny_tokenizer, 64, expected,
                      hf_chat_template=hf, skip_bad_rows=True)


# ---------------------------------------------------------------------------
# The stream's chunk encoder.

def stream_expected(rows, tokenizer, max_length, template, hf=False):
    """The reference's samples of raw rows: template, encode, drop samples without a trained token."""
    fn = template_map_fn_factory(template)
    conversations = [fn({"conversation": row["conversation"]})["conversation"] for row in rows]
    kept = [(c, i) for i, c in enumerate(conversations) if c]
    out = reference.encode_rows([c for c, _ in kept], [i for _, i in kept], tokenizer, max_length,
                                hf_chat_template=hf)
    return [{"input_ids": ids, "labels": labels}
            for ids, labels, trained in zip(out["input_ids"], out["labels"], out["num_trained"]) if trained]


@pytest.mark.parametrize("template", ["qwen_chat", "hf_chat_template"])
@pytest.mark.parametrize("max_length", [16, 4096])
def test_the_stream_encoder_equals_the_reference(tiny_tokenizer_bos, template, max_length):
    from sfttool.dataset.report import PipelineReport
    from sfttool.dataset.streaming import StreamingEncoder
    conversations = chat_conversations() if template == "hf_chat_template" else edge_conversations()
    rows = [{"conversation": c} for c in conversations] + [{"conversation": []}]
    encoder = StreamingEncoder(tiny_tokenizer_bos, max_length,
                               template_map_fn=dict(type=template_map_fn_factory, template=template))
    samples = encoder(list(enumerate(rows)), None, PipelineReport())
    expected = stream_expected(rows, tiny_tokenizer_bos, max_length, template, hf=template == "hf_chat_template")
    assert samples == expected and len(expected) < len(rows) - 1  # some rows were dropped


# ---------------------------------------------------------------------------
# Preference pairs: each side is SFT's encoding of the prompt and that answer.

def pair_rows() -> list[dict]:
    rows = []
    for i, row in enumerate(assets.tiny_conversations(12, seed=8)):
        turns = row["conversation"]
        prompt = [{"role": "system", "content": turns[0]["system"]}] if turns[0].get("system") else []
        for turn in turns[:-1]:
            prompt += [{"role": "user", "content": turn["input"]}, {"role": "assistant", "content": turn["output"]}]
        prompt.append({"role": "user", "content": turns[-1]["input"]})
        rows.append({"prompt": prompt, "chosen": [{"role": "assistant", "content": turns[-1]["output"]}],
                     "rejected": [{"role": "assistant", "content": f"no {i}."}]})
    return rows


@pytest.mark.parametrize("template", ["qwen_chat", "llama2_chat", "hf_chat_template"])
def test_preference_pairs_equal_the_reference(tiny_tokenizer_bos, template):
    from sfttool.dataset.map_fns import template_map_fn
    from sfttool.dataset.preference_encode import encode_pair_batch, pair_conversations
    rows = pair_rows()
    batch = {name: [row[name] for row in rows] for name in ("prompt", "chosen", "rejected")}
    out = encode_pair_batch(batch, range(len(rows)), tiny_tokenizer_bos, 4096, PROMPT_TEMPLATE[template])
    hf = template == "hf_chat_template"
    for k, row in enumerate(rows):
        sides = pair_conversations(row["prompt"], row["chosen"], row["rejected"])
        if not hf:
            sides = [template_map_fn({"conversation": s}, PROMPT_TEMPLATE[template])["conversation"] for s in sides]
        expected = reference.encode_rows(list(sides), [k, k], tiny_tokenizer_bos, 4096, hf_chat_template=hf)
        assert out["chosen_input_ids"][k] == expected["input_ids"][0]
        assert out["chosen_labels"][k] == expected["labels"][0]
        assert out["rejected_input_ids"][k] == expected["input_ids"][1]
        assert out["rejected_labels"][k] == expected["labels"][1]
        assert out["prompt_tokens"][k] == expected["first_trained"][0] == expected["first_trained"][1]
        assert out["drop"][k] == "" and out["note"][k] == ""

