"""Reasoning and tool calls in HF chat-template mode, against the official chat templates of Qwen3
(thinking), Qwen2.5 (tools) and Llama-3.1 (tools) (their jinja text in tests/assets/templates, as the
models publish it and llama.cpp keeps it under models/templates/, with tiny tokenizers that have each
family's special tokens): every trained answer equals what the model produces at inference, after
exactly the prompt it sees there, and nothing else is trained."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from sfttool import assets
from sfttool.dataset.encode import encode_batch
from sfttool.dataset.map_fns import openai_map_fn

IGNORE = -100
TEMPLATES = Path(__file__).resolve().parents[1] / "assets" / "templates"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Local time.",
                                         "parameters": {"type": "object", "properties": {}}}}


def call(name, arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


# Reasoning on every answer, a parallel call with arguments as JSON text, a multi-step call, tool results.
QWEN3_ROW = {"tools": [WEATHER, TIME], "messages": [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "reasoning_content": "Two and two make four.", "content": "Four."},
    {"role": "user", "content": "Weather in Oslo, and the time?"},
    {"role": "assistant", "reasoning_content": "I need two tools.", "content": None,
     "tool_calls": [call("get_weather", '{"city": "Oslo"}'), call("get_time", {})]},
    {"role": "tool", "content": "12 C, rain"}, {"role": "tool", "content": "10:00"},
    {"role": "assistant", "reasoning_content": "Now the city again.", "content": "",
     "tool_calls": [call("get_weather", {"city": "Bergen"})]},
    {"role": "tool", "content": "9 C"},
    {"role": "assistant", "reasoning_content": "Report both.", "content": "Oslo 12 C at 10:00; Bergen 9 C."},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "reasoning_content": "Be polite.", "content": "You are welcome."}]}

QWEN25_ROW = {"tools": [WEATHER, TIME], "messages": [
    {"role": "user", "content": "Weather in Oslo, and the time?"},
    {"role": "assistant", "content": None,
     "tool_calls": [call("get_weather", '{"city": "Oslo"}'), call("get_time", "{}")]},
    {"role": "tool", "content": "12 C, rain"}, {"role": "tool", "content": "10:00"},
    {"role": "assistant", "content": "Oslo: 12 C and rain at 10:00."},
    {"role": "user", "content": "And Bergen?"},
    {"role": "assistant", "content": "Let me check.", "tool_calls": [call("get_weather", {"city": "Bergen"})]},
    {"role": "tool", "content": "9 C"},
    {"role": "assistant", "content": "Bergen: 9 C."}]}

LLAMA31_ROW = {"tools": [WEATHER], "messages": [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [call("get_weather", '{"city": "Oslo"}')]},
    {"role": "tool", "content": "12 C, rain"},
    {"role": "assistant", "content": "12 C and rain."},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You are welcome."}]}

# DeepSeek-R1 style: the reasoning inline in the content, which Qwen3's template reads as reasoning.
QWEN3_INLINE_ROW = {"tools": [], "messages": [
    {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n4."},
    {"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "<think>\nAdd again.\n</think>\n\n6."},
    {"role": "user", "content": "Thanks."}, {"role": "assistant", "content": "You are welcome."}]}

CASES = {  # template file, tokenizer family, end-of-turn token, row, samples the row becomes
    "qwen3": ("Qwen-Qwen3-0.6B.jinja", "qwen", "<|im_end|>", QWEN3_ROW, 3),
    "qwen2.5": ("Qwen-Qwen2.5-7B-Instruct.jinja", "qwen", "<|im_end|>", QWEN25_ROW, 1),
    "llama3.1": ("meta-llama-Llama-3.1-8B-Instruct.jinja", "llama3", "<|eot_id|>", LLAMA31_ROW, 1),
    "qwen3 inline": ("Qwen-Qwen3-0.6B.jinja", "qwen", "<|im_end|>", QWEN3_INLINE_ROW, 3),
}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    from transformers import AutoTokenizer
    out = {}
    for name, (jinja, family, *_rest) in CASES.items():
        folder = assets.build_chat_tokenizer(tmp_path_factory.mktemp(name.replace(" ", "_")), family,
                                             (TEMPLATES / jinja).read_text())
        out[name] = AutoTokenizer.from_pretrained(folder)
    return out


def ids_of(tokenizer, messages, tools, **kw):
    out = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, **kw)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def template_messages(row):
    """The row's messages as the template wants them (what the map fn normalises), written out here."""
    messages = []
    for m in row["messages"]:
        m = {k: v for k, v in m.items() if v is not None and k != "loss"}
        m.setdefault("content", "")
        if m.get("tool_calls"):
            m["tool_calls"] = [call(c["function"]["name"], c["function"]["arguments"] if isinstance(
                c["function"]["arguments"], dict) else json.loads(c["function"]["arguments"]))
                for c in m["tool_calls"]]
        messages.append(m)
    return messages


def inference_targets(tokenizer, row, end_token, **kw):
    """Per answer: (the prompt's ids at inference, the ids the model produces through its end token)."""
    messages, out = template_messages(row), []
    end_id = tokenizer.convert_tokens_to_ids(end_token)
    for k, message in enumerate(messages):
        if message["role"] == "assistant":
            prompt = ids_of(tokenizer, messages[:k], row["tools"], add_generation_prompt=True, **kw)
            own = ids_of(tokenizer, messages[:k + 1], row["tools"], **kw)
            assert own[:len(prompt)] == prompt
            produced = own[len(prompt):]
            out.append((prompt, produced[:produced.index(end_id) + 1]))
    return out


def encode_row(tokenizer, row, **options):
    conversation = openai_map_fn(row)["conversation"]
    return encode_batch({"conversation": [conversation]}, [7], tokenizer, 10**6, hf_chat_template=True,
                        chat_options=options)


def trained_runs(input_ids, labels):
    """(prompt ids before the run, the run's ids) for each maximal run of trained tokens."""
    runs, start = [], None
    for i, label in enumerate(labels + [IGNORE]):
        if label != IGNORE and start is None:
            start = i
        elif label == IGNORE and start is not None:
            assert labels[start:i] == input_ids[start:i]
            runs.append((input_ids[:start], input_ids[start:i]))
            start = None
    return runs


@pytest.mark.parametrize("name", list(CASES))
def test_every_answer_is_trained_exactly_as_produced_at_inference(tokenizers, name):
    _, _, end_token, row, samples = CASES[name]
    tok = tokenizers[name]
    out = encode_row(tok, row)
    assert out["_sfttool_row"] == [7] * samples  # the conversation became this many samples, all of row 7
    runs = [run for ids, labels in zip(out["input_ids"], out["labels"]) for run in trained_runs(ids, labels)]
    assert runs == inference_targets(tok, row, end_token)  # each answer once, in order, nothing else trained
    for ids, labels in zip(out["input_ids"], out["labels"]):
        assert labels[-1] != IGNORE or tok.decode(ids[-1:]) == "\n"  # a sample ends with a trained answer


def test_qwen3_split_samples_hold_the_reasoning_each_answer_was_produced_with(tokenizers):
    tok = tokenizers["qwen3"]
    out = encode_row(tok, QWEN3_ROW)
    texts = [tok.decode(ids) for ids in out["input_ids"]]
    assert "<think>\nTwo and two make four.\n</think>" in texts[0] and texts[0].endswith("Four.<|im_end|>\n")
    assert "Two and two make four." not in texts[1]  # dropped by the template once the next question came
    assert "<think>\nI need two tools.\n</think>" in texts[1] and "<think>\nReport both.\n</think>" in texts[1]
    assert "I need two tools." not in texts[2] and texts[2].endswith("You are welcome.<|im_end|>\n")
    trained = [tok.decode([t for t in labels if t != IGNORE]) for labels in out["labels"]]
    assert trained[0] == "<think>\nTwo and two make four.\n</think>\n\nFour.<|im_end|>"
    assert trained[1] == ('<think>\nI need two tools.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
                          '"arguments": {"city": "Oslo"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
                          '"arguments": {}}\n</tool_call><|im_end|><think>\nNow the city again.\n</think>\n\n'
                          '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Bergen"}}\n</tool_call>'
                          '<|im_end|><think>\nReport both.\n</think>\n\nOslo 12 C at 10:00; Bergen 9 C.<|im_end|>')


def test_qwen3_without_training_the_reasoning(tokenizers):
    tok = tokenizers["qwen3"]
    out = encode_row(tok, QWEN3_ROW, train_on_reasoning=False)
    trained = [tok.decode([t for t in labels if t != IGNORE]) for labels in out["labels"]]
    assert trained[0] == "Four.<|im_end|>"
    assert trained[2] == "You are welcome.<|im_end|>"
    assert "<think>" not in "".join(trained) and "tools." not in "".join(trained)
    # The context is unchanged: the same samples, only fewer labels.
    assert out["input_ids"] == encode_row(tok, QWEN3_ROW)["input_ids"]


def test_a_message_loss_flag_overrides_the_rules_for_its_turn(tokenizers):
    tok = tokenizers["qwen3"]
    row = json.loads(json.dumps(QWEN3_ROW))
    row["messages"][2]["loss"] = False  # not trained at all
    row["messages"][-1]["loss"] = True  # reasoning trained although train_on_reasoning=False
    out = encode_row(tok, row, train_on_reasoning=False)
    trained = [tok.decode([t for t in labels if t != IGNORE]) for labels in out["labels"]]
    assert len(trained) == 2  # the first answer is context only: no sample is needed for it
    assert trained[1] == "<think>\nBe polite.\n</think>\n\nYou are welcome.<|im_end|>"


def test_qwen3_enable_thinking_for_rows_without_reasoning(tokenizers):
    tok = tokenizers["qwen3"]
    row = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
    default = encode_row(tok, row)
    off = encode_row(tok, row, enable_thinking=False)
    assert tok.decode([t for t in default["labels"][0] if t != IGNORE]) == "<think>\n\n</think>\n\nHello.<|im_end|>"
    assert tok.decode([t for t in off["labels"][0] if t != IGNORE]) == "Hello.<|im_end|>"
    # With enable_thinking=False the empty block is part of the prompt, as at inference.
    prompt = ids_of(tok, row["messages"][:1], None, add_generation_prompt=True, enable_thinking=False)
    assert off["input_ids"][0][:len(prompt)] == prompt and off["labels"][0][len(prompt) - 1] == IGNORE


PLAIN_ROW = {"messages": [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"},
                         {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2"}]}


def test_plain_multi_turn_chat_is_one_sample_where_renders_are_prefixes(tokenizers):
    tok = tokenizers["qwen2.5"]
    out = encode_row(tok, PLAIN_ROW)
    assert len(out["input_ids"]) == 1 and out["input_ids"][0] == ids_of(tok, PLAIN_ROW["messages"], None)
    assert tok.decode([t for t in out["labels"][0] if t != IGNORE]) == "A1<|im_end|>A2<|im_end|>"


def test_plain_multi_turn_chat_under_qwen3_is_two_samples(tokenizers):
    """Qwen3 writes an empty think block only before the last answer: at inference the first answer
    is produced as `<think>\n\n</think>\n\nA1`, which the whole conversation no longer holds."""
    tok = tokenizers["qwen3"]
    out = encode_row(tok, PLAIN_ROW)
    trained = [tok.decode([t for t in labels if t != IGNORE]) for labels in out["labels"]]
    assert trained == ["<think>\n\n</think>\n\nA1<|im_end|>", "<think>\n\n</think>\n\nA2<|im_end|>"]
    assert out["input_ids"][1] == ids_of(tok, PLAIN_ROW["messages"], None)


# Two user and two assistant messages in a row: a prompt template needs them joined into one turn, the
# chat template gets them as written (no empty turn between, no text glued), each answer trained.
RUNS_ROW = {"tools": None, "messages": [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Q1"}, {"role": "user", "content": "More context."},
    {"role": "assistant", "content": "A1"}, {"role": "assistant", "content": "A1, continued."},
    {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2"}]}


@pytest.mark.parametrize("name", ["qwen2.5", "llama3.1"])
def test_runs_of_one_role_reach_the_chat_template_as_written(tokenizers, name):
    _, _, end_token, _, _ = CASES[name]
    tok = tokenizers[name]
    notes = []
    assert [t["input"] for t in openai_map_fn(RUNS_ROW, notes)["conversation"]] == ["Q1\n\nMore context.", "Q2"]
    assert len(notes) == 2  # both runs reported
    out = encode_row(tok, RUNS_ROW)
    assert out["input_ids"] == [ids_of(tok, RUNS_ROW["messages"], None)]  # one sample: the messages as written
    runs = trained_runs(out["input_ids"][0], out["labels"][0])
    assert runs == inference_targets(tok, RUNS_ROW, end_token)  # all three answers, each as produced
    assert len(runs) == 3


def test_an_untrained_answer_in_a_run_keeps_its_own_loss_flag(tokenizers):
    tok = tokenizers["qwen2.5"]
    row = json.loads(json.dumps(RUNS_ROW))
    row["messages"][4]["loss"] = False  # "A1, continued." is context only
    out = encode_row(tok, row)
    trained = tok.decode([t for t in out["labels"][0] if t != IGNORE])
    assert trained == "A1<|im_end|>A2<|im_end|>"
    assert out["input_ids"] == [ids_of(tok, RUNS_ROW["messages"], None)]


def test_sharegpt_runs_of_one_role_encode_as_the_openai_row(tokenizers):
    from sfttool.dataset.map_fns import sharegpt_map_fn
    tok = tokenizers["qwen2.5"]
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    row = {"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in RUNS_ROW["messages"]]}
    conversation = sharegpt_map_fn(row)["conversation"]
    out = encode_batch({"conversation": [conversation]}, [7], tok, 10**6, hf_chat_template=True)
    assert out == encode_row(tok, RUNS_ROW)


# ---------------------------------------------------------------------------
# Through the pipeline and the stream: split samples stay whole and isolated; splits and ignored
# fields are counted.

HF = dict(HF_CHAT_TEMPLATE=True)


def as_dataset(rows):
    """Arrow needs one type per field: tool-call arguments as JSON text throughout (same encoding)."""
    from datasets import Dataset
    rows = json.loads(json.dumps(rows))
    for row in rows:
        for message in row["messages"]:
            for c in message.get("tool_calls") or []:
                if not isinstance(c["function"]["arguments"], str):
                    c["function"]["arguments"] = json.dumps(c["function"]["arguments"])
    return Dataset.from_list(rows)


def _template_fn(template=HF):
    from sfttool.dataset.map_fns import template_map_fn_factory
    return dict(type=template_map_fn_factory, template=template)


def test_packing_keeps_each_split_sample_whole_and_isolated(tokenizers):
    from sfttool.dataset.pipeline import run_pipeline
    tok = tokenizers["qwen3"]
    rows = [QWEN3_ROW, PLAIN_ROW, QWEN3_ROW]
    packed, report = run_pipeline(as_dataset(rows), tok, 2048, dataset_map_fn=openai_map_fn,
                                  template_map_fn=_template_fn(), map_num_proc=1)
    expected = [ids for row in rows for ids in encode_row(tok, row)["input_ids"]]
    assert report.split == {3: 2, 2: 1}  # two conversations became 3 samples, one became 2
    samples = []
    for row in packed:
        start = 0
        for length in row["sample_lengths"]:
            assert row["position_ids"][start:start + length] == list(range(length))  # isolated
            samples.append(row["input_ids"][start:start + length])
            start += length
    assert sorted(samples) == sorted(expected)  # every sample whole, none lost


def test_the_stream_splits_and_counts_as_the_pipeline_does(tokenizers):
    from sfttool.dataset.report import PipelineReport
    from sfttool.dataset.streaming import StreamingEncoder
    tok = tokenizers["qwen3"]
    encoder = StreamingEncoder(tok, 2048, dataset_map_fn=openai_map_fn, template_map_fn=_template_fn())
    stats = PipelineReport()
    samples = encoder([(0, QWEN3_ROW), (1, PLAIN_ROW)], None, stats)
    assert [s["input_ids"] for s in samples] == (encode_row(tok, QWEN3_ROW)["input_ids"]
                                                 + encode_row(tok, PLAIN_ROW)["input_ids"])
    assert stats.split == {3: 1, 2: 1}


def test_a_field_the_chat_template_ignores_is_counted(tokenizers):
    from sfttool.dataset.pipeline import run_pipeline
    reasoning = {"messages": [{"role": "user", "content": "Q"},
                              {"role": "assistant", "content": "A", "reasoning_content": "R"}]}
    _, report = run_pipeline(as_dataset([reasoning, PLAIN_ROW, reasoning]), tokenizers["qwen2.5"], 512,
                             dataset_map_fn=openai_map_fn, template_map_fn=_template_fn(), map_num_proc=1)
    note = "reasoning_content ignored by the tokenizer's chat template: not in the trained text"
    assert report.changed == {note: 2} and report.change_examples[note] == ["row 0", "row 2"]
    # A prompt template renders no tool call: the tool-calling row is dropped (skip_bad_rows; without it
    # the pipeline stops, test_unrendered.py), the fields it ignored counted all the same.
    _, report = run_pipeline(as_dataset([QWEN25_ROW, PLAIN_ROW]), tokenizers["qwen2.5"], 2048,
                             dataset_map_fn=openai_map_fn, template_map_fn=_template_fn("qwen_chat"), map_num_proc=1,
                             skip_bad_rows=True)
    assert sorted(report.changed.values()) == [1, 1, 1]  # tools, tool calls, tool messages: template mode
    assert all("ignored by the prompt template (use hf_chat_template)" in note for note in report.changed)
    assert report.dropped == {"the template does not render its tool calls (--skip-bad-rows)": 1}


def test_the_reasoning_settings_reach_the_encoder_from_the_template(tokenizers):
    from sfttool.dataset.pipeline import run_pipeline
    tok = tokenizers["qwen3"]
    rows = as_dataset([QWEN3_ROW])
    off, _ = run_pipeline(rows, tok, 2048, dataset_map_fn=openai_map_fn, pack_to_max_length=False,
                          template_map_fn=_template_fn(dict(HF, TRAIN_ON_REASONING=False)), map_num_proc=1)
    expected = encode_row(tok, QWEN3_ROW, train_on_reasoning=False)["labels"]
    assert sorted(off["labels"]) == sorted(expected)


# ---------------------------------------------------------------------------
# LLaMA-Factory's ShareGPT tool format and MSAgent-Bench reach the template as the OpenAI form does.

def test_sharegpt_function_call_rows_encode_as_the_openai_row(tokenizers):
    from sfttool.dataset.map_fns import sharegpt_map_fn
    tok = tokenizers["qwen2.5"]
    sharegpt = {"tools": json.dumps([WEATHER["function"], TIME["function"]]), "conversations": [
        {"from": "human", "value": "Weather in Oslo, and the time?"},
        {"from": "function_call", "value": json.dumps([{"name": "get_weather", "arguments": {"city": "Oslo"}},
                                                       {"name": "get_time", "arguments": {}}])},
        {"from": "observation", "value": "12 C, rain"}, {"from": "observation", "value": "10:00"},
        {"from": "gpt", "value": "Oslo: 12 C and rain at 10:00."}]}
    openai = {"tools": [WEATHER, TIME], "messages": QWEN25_ROW["messages"][:5]}
    ours = encode_batch({"conversation": [sharegpt_map_fn(sharegpt)["conversation"]]}, [0], tok, 4096,
                        hf_chat_template=True)
    assert ours["input_ids"] == encode_row(tok, openai)["input_ids"]
    assert ours["labels"] == encode_row(tok, openai)["labels"]


def test_msagent_rows_train_the_call_and_the_answer_not_the_result(tokenizers):
    from sfttool.dataset.map_fns import msagent_map_fn
    tok = tokenizers["qwen2.5"]
    api = {"name": "weather", "description": "Weather of a city.",
           "paths": [{"parameters": [{"name": "city", "description": "the city", "required": True}]}]}
    row = {"conversations": str([
        {"from": "system", "value": "You can use these APIs: " + json.dumps(api)},
        {"from": "user", "value": "Weather in Oslo?"},
        {"from": "assistant", "value": 'Let me check.<|startofthink|>```JSON\n{"api_name": "weather", '
                                       '"parameters": {"city": "Oslo"}}\n```<|endofthink|>\n\n<|startofexec|>'
                                       '```JSON\n{"temp": 12}\n```<|endofexec|>\nIt is 12 C in Oslo.'}])}
    conversation = msagent_map_fn(row)["conversation"]
    assert json.loads(conversation[0]["tools"])[0]["function"]["parameters"] == {
        "type": "object", "properties": {"city": {"type": "string", "description": "the city"}},
        "required": ["city"]}
    out = encode_batch({"conversation": [conversation]}, [0], tok, 4096, hf_chat_template=True)
    trained = tok.decode([t for t in out["labels"][0] if t != IGNORE])
    assert trained == ('Let me check.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
                       '<|im_end|>It is 12 C in Oslo.<|im_end|>')
    assert '<tool_response>\n{"temp": 12}\n</tool_response>' in tok.decode(out["input_ids"][0])


def test_kept_columns_follow_the_samples_of_their_row(tokenizers):
    from sfttool.dataset.pipeline import run_pipeline
    rows = as_dataset([QWEN3_ROW, PLAIN_ROW]).add_column("id", ["a", "b"])
    out, _ = run_pipeline(rows, tokenizers["qwen3"], 2048, dataset_map_fn=openai_map_fn, map_num_proc=1,
                          template_map_fn=_template_fn(), pack_to_max_length=False, remove_unused_columns=False)
    assert out["id"] == ["a", "a", "a", "b", "b"]


def test_standard_rows_may_hold_tools_and_messages_as_lists(tokenizers):
    """A standard-format file written by hand: the lists themselves instead of their JSON text."""
    tok = tokenizers["qwen2.5"]
    conversation = [dict(turn, tools=json.loads(turn["tools"]) if turn.get("tools") else [],
                         messages=json.loads(turn["messages"]))
                    for turn in openai_map_fn(QWEN25_ROW)["conversation"]]
    out = encode_batch({"conversation": [conversation]}, [0], tok, 4096, hf_chat_template=True)
    assert out["input_ids"] == encode_row(tok, QWEN25_ROW)["input_ids"]


def test_the_inference_prompt_follows_the_template_settings_as_training_did(tokenizers):
    """chat and the evaluation hook prompt through encode_prompt: with ENABLE_THINKING=False the prompt
    ends with Qwen3's empty think block, exactly where the trained answer starts."""
    from sfttool.dataset.encode import encode_prompt
    tok = tokenizers["qwen3"]
    template = dict(HF, ENABLE_THINKING=False)
    prompt = encode_prompt([{"input": "Hi"}], tok, template)
    assert tok.decode(prompt) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    row = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
    out = encode_row(tok, row, enable_thinking=False)
    assert out["input_ids"][0][:len(prompt)] == prompt and out["labels"][0][len(prompt)] != IGNORE
    assert tok.decode(encode_prompt([{"input": "Hi"}], tok, HF)).endswith("<|im_start|>assistant\n")
