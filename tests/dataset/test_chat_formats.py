"""The built-in chat formats (PROMPT_TEMPLATE.qwen3, qwen3_no_think, qwen2_5, llama3_1) against the
official chat templates in tests/assets/templates: every render (each prefix of the conversation, with
and without the generation prompt) is the official text, and on a tokenizer without any chat template
the samples, input_ids and labels equal the HF chat-template mode's, which test_chat_targets checks
against what each model produces at inference. Where a format cannot be equal, a test shows how."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from sfttool import assets
from sfttool.dataset.chat_format import ChatFormat
from sfttool.dataset.encode import encode_batch, encode_prompt
from sfttool.dataset.errors import DatasetError
from sfttool.dataset.map_fns import openai_map_fn
from sfttool.utils.templates import PROMPT_TEMPLATE, chat_template_options

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_chat_targets import (CASES, LLAMA31_ROW, PLAIN_ROW, QWEN3_ROW, QWEN25_ROW, RUNS_ROW, TEMPLATES,  # noqa: E402
                               as_dataset, call, encode_row, inference_targets, template_messages, trained_runs)

IGNORE = -100
FORMAT_OF = {"qwen3": "qwen3", "qwen2.5": "qwen2_5", "llama3.1": "llama3_1", "qwen3 inline": "qwen3"}
SYSTEM_PLAIN = {"tools": [], "messages": [{"role": "system", "content": "Be brief."}, *PLAIN_ROW["messages"]]}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """Per case: (the tokenizer with the official template, the same tokenizer without any template)."""
    from transformers import AutoTokenizer
    out = {}
    for name, (jinja, family, *_rest) in CASES.items():
        folder = tmp_path_factory.mktemp(name.replace(" ", "_"))
        official = AutoTokenizer.from_pretrained(
            assets.build_chat_tokenizer(folder / "official", family, (TEMPLATES / jinja).read_text()))
        bare = AutoTokenizer.from_pretrained(folder / "official")
        bare.chat_template = None
        out[name] = official, bare
    return out


def chat_format(name: str) -> ChatFormat:
    return ChatFormat(chat_template_options(PROMPT_TEMPLATE[FORMAT_OF[name]])["chat_format"])


def encode_with(tokenizer, row, template=None, **options):
    """Encode ``row`` in chat-template mode: the tokenizer's jinja, or ``template``'s CHAT_FORMAT."""
    if template is None:
        return encode_row(tokenizer, row, **options)
    conversation = openai_map_fn(row)["conversation"]
    return encode_batch({"conversation": [conversation]}, [7], tokenizer, 10**6, hf_chat_template=True,
                        chat_options={**chat_template_options(PROMPT_TEMPLATE[template]), **options})


ROWS = [(name, row) for name in CASES for row in (CASES[name][3], PLAIN_ROW, SYSTEM_PLAIN, RUNS_ROW)]


@pytest.mark.parametrize("name,row", ROWS, ids=[f"{n}-{i % 4}" for i, (n, _) in enumerate(ROWS)])
def test_every_render_is_the_official_text(tokenizers, name, row):
    official, _ = tokenizers[name]
    messages, tools = template_messages(row), row.get("tools") or None
    thinking = [{}, {"enable_thinking": False}] if name.startswith("qwen3") else [{}]
    renders = 0
    for k in range(1, len(messages) + 1):
        for prompt in (False, True):
            for kw in thinking:
                if messages[k - 1]["role"] == "system":
                    continue  # Llama 3.1 refuses tools without a user message; nothing renders a system alone
                ours = chat_format(name).apply_chat_template(messages[:k], tools, add_generation_prompt=prompt, **kw)
                assert ours == official.apply_chat_template(messages[:k], tools=tools, tokenize=False,
                                                            add_generation_prompt=prompt, **kw)
                renders += 1
    assert renders == sum(m["role"] != "system" for m in messages) * 2 * len(thinking)


@pytest.mark.parametrize("name", list(CASES))
def test_ids_and_labels_equal_the_hf_mode_without_a_chat_template_on_the_tokenizer(tokenizers, name):
    official, bare = tokenizers[name]
    row = CASES[name][3]
    ours, theirs = encode_with(bare, row, FORMAT_OF[name]), encode_with(official, row)
    assert ours["input_ids"] == theirs["input_ids"] and ours["labels"] == theirs["labels"]
    assert ours["_sfttool_row"] == [7] * CASES[name][4]  # split into the same samples (Qwen3: 3)
    runs = [run for ids, labels in zip(ours["input_ids"], ours["labels"]) for run in trained_runs(ids, labels)]
    assert runs == inference_targets(official, row, CASES[name][2])


@pytest.mark.parametrize("options", [dict(train_on_reasoning=False), dict(enable_thinking=False)])
def test_qwen3_settings_act_as_in_the_hf_mode(tokenizers, options):
    official, bare = tokenizers["qwen3"]
    for row in (QWEN3_ROW, PLAIN_ROW):
        ours, theirs = encode_with(bare, row, "qwen3", **options), encode_with(official, row, **options)
        assert ours["input_ids"] == theirs["input_ids"] and ours["labels"] == theirs["labels"]


def test_qwen3_no_think_is_qwen3_with_thinking_off(tokenizers):
    """Plain answers follow the empty think block of the prompt (trained without it); rows with
    reasoning keep it, as Qwen3's template renders them whatever enable_thinking says."""
    official, bare = tokenizers["qwen3"]
    plain = encode_with(bare, PLAIN_ROW, "qwen3_no_think")
    assert plain["input_ids"] == encode_with(official, PLAIN_ROW, enable_thinking=False)["input_ids"]
    trained = [bare.decode([t for t in labels if t != IGNORE]) for labels in plain["labels"]]
    assert trained == ["A1<|im_end|>", "A2<|im_end|>"]
    reasoning = encode_with(bare, QWEN3_ROW, "qwen3_no_think")
    assert reasoning["labels"] == encode_with(official, QWEN3_ROW)["labels"]
    prompt = encode_prompt([{"input": "Hi"}], bare, PROMPT_TEMPLATE.qwen3_no_think)
    assert bare.decode(prompt) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_the_inference_prompt_with_tools_is_the_official_one(tokenizers):
    official, bare = tokenizers["qwen2.5"]
    tools = json.dumps([row for row in QWEN25_ROW["tools"]])
    prompt = encode_prompt([{"tools": tools, "input": "Weather in Oslo?"}], bare, PROMPT_TEMPLATE.qwen2_5)
    expected = official.apply_chat_template([{"role": "user", "content": "Weather in Oslo?"}],
                                            tools=QWEN25_ROW["tools"], add_generation_prompt=True, tokenize=True)
    assert prompt == list(expected["input_ids"])


# ---------------------------------------------------------------------------
# Where a format is not the official template, by design.

def test_llama3_1_writes_the_official_default_date_not_todays(tokenizers):
    """Llama-3.1's template writes `Today Date: 26 Jul 2024` unless it is given a `date_string`
    (Llama 3.2/3.3's write today's date): the format is that default, so it differs from a render
    with another date in that line only."""
    official, _ = tokenizers["llama3.1"]
    messages = template_messages(LLAMA31_ROW)
    ours = chat_format("llama3.1").apply_chat_template(messages, LLAMA31_ROW["tools"])
    dated = official.apply_chat_template(messages, tools=LLAMA31_ROW["tools"], tokenize=False,
                                         date_string="01 Dec 2026")
    assert "Today Date: 26 Jul 2024\n" in ours
    assert ours.replace("26 Jul 2024", "01 Dec 2026") == dated


def test_llama3_1_refuses_parallel_calls_as_its_template_does(tokenizers):
    official, bare = tokenizers["llama3.1"]
    row = json.loads(json.dumps(LLAMA31_ROW))
    row["messages"][2]["tool_calls"].append(call("get_weather", {"city": "Bergen"}))
    with pytest.raises(DatasetError, match="row 7: an assistant message has 2 tool calls; this chat format "
                                           "allows 1 per message"):
        encode_with(bare, row, "llama3_1")
    with pytest.raises(DatasetError, match="row 7: the tokenizer's chat_template failed: .*single tool-calls"):
        encode_with(official, row)


def test_qwen2_5_drops_reasoning_as_its_template_does_and_the_pipeline_says_so(tokenizers):
    from sfttool.dataset.map_fns import template_map_fn_factory
    from sfttool.dataset.pipeline import run_pipeline
    official, bare = tokenizers["qwen2.5"]
    row = {"messages": [{"role": "user", "content": "Q"},
                        {"role": "assistant", "content": "A", "reasoning_content": "R"}]}
    assert encode_with(bare, row, "qwen2_5")["input_ids"] == encode_with(official, row)["input_ids"]
    _, report = run_pipeline(as_dataset([row, PLAIN_ROW]), bare, 512, dataset_map_fn=openai_map_fn,
                             template_map_fn=dict(type=template_map_fn_factory, template="qwen2_5"),
                             map_num_proc=1)
    assert report.changed == {"reasoning_content ignored by the template's CHAT_FORMAT: not in the trained text": 1}


def test_the_pipeline_splits_and_packs_as_in_the_hf_mode(tokenizers):
    from sfttool.dataset.map_fns import template_map_fn_factory
    from sfttool.dataset.pipeline import run_pipeline
    official, bare = tokenizers["qwen3"]
    rows = as_dataset([QWEN3_ROW, PLAIN_ROW])
    out = {}
    for key, tok, template in (("ours", bare, "qwen3"), ("theirs", official, "hf_chat_template")):
        out[key] = run_pipeline(rows, tok, 2048, dataset_map_fn=openai_map_fn, map_num_proc=1,
                                template_map_fn=dict(type=template_map_fn_factory, template=template))
    (ours, ours_report), (theirs, theirs_report) = out["ours"], out["theirs"]
    assert ours_report.split == theirs_report.split == {3: 1, 2: 1}
    assert ours["input_ids"] == theirs["input_ids"] and ours["labels"] == theirs["labels"]


def test_preference_pairs_encode_with_the_format_as_with_the_official_template(tokenizers):
    from sfttool.dataset.preference_encode import encode_conversations
    official, bare = tokenizers["qwen3"]
    conversation = openai_map_fn(QWEN3_ROW)["conversation"]
    ours = encode_conversations([conversation], [0], bare, PROMPT_TEMPLATE.qwen3)
    assert ours == encode_conversations([conversation], [0], official, PROMPT_TEMPLATE.hf_chat_template)


def test_a_format_of_another_family_is_warned_about(tokenizers):
    """The format does not come from the tokenizer: its role markers must be the tokenizer's tokens."""
    from sfttool.dataset.template_check import split_markers
    llama, qwen = tokenizers["llama3.1"][1], tokenizers["qwen3"][1]
    assert split_markers(PROMPT_TEMPLATE.qwen3, qwen) == split_markers(PROMPT_TEMPLATE.llama3_1, llama) == []
    warnings = split_markers(PROMPT_TEMPLATE.qwen3, llama)
    assert [w.split(" is ")[0] for w in warnings] == ["template marker '<|im_end|>'", "template marker '<|im_start|>'"]


def test_the_stream_encodes_with_the_format_as_the_pipeline_does(tokenizers):
    from sfttool.dataset.map_fns import template_map_fn_factory
    from sfttool.dataset.report import PipelineReport
    from sfttool.dataset.streaming import StreamingEncoder
    _, bare = tokenizers["qwen3"]
    encoder = StreamingEncoder(bare, 2048, dataset_map_fn=openai_map_fn,
                               template_map_fn=dict(type=template_map_fn_factory, template="qwen3"))
    stats = PipelineReport()
    samples = encoder([(0, QWEN3_ROW), (1, PLAIN_ROW)], None, stats)
    expected = [encode_with(bare, row, "qwen3") for row in (QWEN3_ROW, PLAIN_ROW)]
    assert [s["labels"] for s in samples] == expected[0]["labels"] + expected[1]["labels"]
    assert stats.split == {3: 1, 2: 1}
