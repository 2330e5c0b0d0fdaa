"""Rows whose trained answers the template cannot render are never trained: a template without tool support
(the tiny tokenizer's ChatML, as SmolLM2's) renders a call-only answer as nothing but its end-of-turn token.
Such rows stop the pipeline and the stream with one line naming the file, the row, what the template
leaves out and the fix; with skip_bad_rows they are dropped, counted."""
from __future__ import annotations

import json

import pytest
from datasets import load_dataset

from sfttool import assets
from sfttool.dataset import DatasetError, process_hf_dataset
from sfttool.dataset.map_fns import template_map_fn_factory
from sfttool.dataset.pipeline import run_pipeline
from sfttool.utils import PROMPT_TEMPLATE

IGNORE = -100


def call(name, arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                            "parameters": {"type": "object", "properties": {}}}}
PLAIN = {"messages": [{"role": "user", "content": "one two?"}, {"role": "assistant", "content": "three."}]}
CALL_ONLY = {"tools": [WEATHER], "messages": [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": "", "tool_calls": [call("get_weather", {"city": "Oslo"})]},
    {"role": "tool", "content": "12 C"}, {"role": "assistant", "content": "12 C in Oslo."}]}
TEXT_AND_CALL = {"tools": [WEATHER], "messages": [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": "Let me check.", "tool_calls": [call("get_weather", {"city": "Oslo"})]},
    {"role": "tool", "content": "12 C"}, {"role": "assistant", "content": "12 C in Oslo."}]}
REASONING_ONLY = {"messages": [{"role": "user", "content": "two plus two?"},
                               {"role": "assistant", "content": "", "reasoning_content": "Add them."}]}
CALL_AS_CONTEXT = {"tools": [WEATHER], "messages": [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": "", "loss": False, "tool_calls": [call("get_weather", {"city": "Oslo"})]},
    {"role": "tool", "content": "12 C"}, {"role": "assistant", "content": "12 C in Oslo."}]}

CHAT = dict(type=template_map_fn_factory, template=PROMPT_TEMPLATE.hf_chat_template)
QWEN = dict(type=template_map_fn_factory, template=PROMPT_TEMPLATE.qwen_chat)


def data_file(tmp_path, rows):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def process(path, tokenizer, template=CHAT, max_length=256, **kw):
    return process_hf_dataset(dict(type=load_dataset, path="json", data_files=str(path)), tokenizer, max_length,
                              dataset_map_fn="openai_map_fn", template_map_fn=template, map_num_proc=1, **kw)


@pytest.mark.parametrize("row, what, trained_as", [
    (CALL_ONLY, "tool calls", "<|im_end|>"),
    (TEXT_AND_CALL, "tool calls", "Let me check.<|im_end|>"),
    (REASONING_ONLY, "reasoning_content", "<|im_end|>"),
])
def test_a_chat_template_that_leaves_the_answer_out_stops_with_file_row_and_feature(tmp_path, tiny_tokenizer,
                                                                                      row, what, trained_as):
    path = data_file(tmp_path, [PLAIN, PLAIN, row, PLAIN])
    with pytest.raises(DatasetError) as err:
        process(path, tiny_tokenizer)
    assert str(err.value) == (
        f"{path}, row 2: the tokenizer's chat template does not render {what}, so an answer of this row would be "
        f"trained as {trained_as!r}; use a chat format that renders {'them' if what == 'tool calls' else 'it'} "
        f"(PROMPT_TEMPLATE.{'qwen2_5, qwen3, llama3_1' if what == 'tool calls' else 'qwen3'}) or "
        f"hf_chat_template with a tokenizer whose chat template renders {'them' if what == 'tool calls' else 'it'}, "
        "or --skip-bad-rows to drop such rows (counted)")


def test_a_prompt_template_names_itself(tmp_path, tiny_tokenizer):
    path = data_file(tmp_path, [PLAIN, CALL_ONLY])
    with pytest.raises(DatasetError, match=rf"^{path}, row 1: the prompt template does not render tool calls, so "
                                           r"an answer of this row would be trained as '<\|im_end\|>'; use "):
        process(path, tiny_tokenizer, QWEN)


def test_a_chat_format_without_reasoning_names_itself(tmp_path, tiny_tokenizer):
    path = data_file(tmp_path, [REASONING_ONLY])
    qwen2_5 = dict(type=template_map_fn_factory, template=PROMPT_TEMPLATE.qwen2_5)
    with pytest.raises(DatasetError, match=rf"^{path}, row 0: the template's CHAT_FORMAT does not render "
                                           "reasoning_content, so"):
        process(path, tiny_tokenizer, qwen2_5)


@pytest.mark.parametrize("template", [CHAT, QWEN], ids=["chat_template", "prompt_template"])
def test_skipped_rows_are_dropped_counted_and_the_rest_trained_as_without_them(tmp_path, tiny_tokenizer, template):
    rows = [PLAIN, CALL_ONLY, REASONING_ONLY, TEXT_AND_CALL, PLAIN]
    dataset, report = run_pipeline(dict(type=load_dataset, path="json", data_files=str(data_file(tmp_path, rows))),
                                   tiny_tokenizer, 256, dataset_map_fn="openai_map_fn", template_map_fn=template,
                                   map_num_proc=1, pack_to_max_length=False, skip_bad_rows=True)
    tools = "the template does not render its tool calls (--skip-bad-rows)"
    reasoning = "the template does not render its reasoning_content (--skip-bad-rows)"
    assert report.dropped == {tools: 2, reasoning: 1}
    assert report.drop_examples == {tools: ["row 1", "row 3"], reasoning: ["row 2"]}
    assert report.rows_out == 2
    kept, _ = run_pipeline(dict(type=load_dataset, path="json", data_files=str(data_file(tmp_path, [PLAIN, PLAIN]))),
                           tiny_tokenizer, 256, dataset_map_fn="openai_map_fn", template_map_fn=template,
                           map_num_proc=1, pack_to_max_length=False)
    assert dataset["input_ids"] == kept["input_ids"] and dataset["labels"] == kept["labels"]


def test_skipped_rows_are_dropped_by_the_stream_and_counted(tiny_tokenizer):
    from sfttool.dataset.streaming import StreamingPackedDataset
    rows = [PLAIN, CALL_ONLY, PLAIN]
    stream = StreamingPackedDataset(rows, tiny_tokenizer, 256, dataset_map_fn="openai_map_fn", template_map_fn=CHAT,
                                    pack_to_max_length=False, source="data.jsonl")
    with pytest.raises(DatasetError, match=r"^data.jsonl, row 1: the tokenizer's chat template does not render "
                                           "tool calls"):
        list(stream)
    stream = StreamingPackedDataset(rows, tiny_tokenizer, 256, dataset_map_fn="openai_map_fn", template_map_fn=CHAT,
                                    pack_to_max_length=False, skip_bad_rows=True)
    assert len(list(stream)) == 2
    assert stream.pass_stats.dropped == {"the template does not render its tool calls (--skip-bad-rows)": 1}


def test_untrained_answers_and_answers_with_text_are_not_refused(tiny_tokenizer):
    """A call the row does not train (loss false) stays context; an answer whose reasoning is left out but whose
    text is rendered trains that text (the ignored field is counted)."""
    from datasets import Dataset
    with_text = {"messages": [{"role": "user", "content": "Q"},
                              {"role": "assistant", "content": "A.", "reasoning_content": "R"}]}
    rows = [CALL_AS_CONTEXT, with_text]
    out, report = run_pipeline(Dataset.from_list(json.loads(json.dumps(rows))), tiny_tokenizer, 256,
                               dataset_map_fn="openai_map_fn", template_map_fn=CHAT, map_num_proc=1,
                               pack_to_max_length=False)
    assert report.dropped == {} and report.rows_out == 2
    trained = [tiny_tokenizer.decode([t for t in labels if t != IGNORE]) for labels in out["labels"]]
    assert trained == ["12 C in Oslo.<|im_end|>", "A.<|im_end|>"]
    assert report.changed["reasoning_content ignored by the tokenizer's chat template: not in the trained text"] == 1


def test_templates_that_render_the_calls_train_them(tmp_path):
    """The official Qwen2.5 template renders tool calls: nothing is refused and the call is trained."""
    from pathlib import Path

    from transformers import AutoTokenizer
    jinja = (Path(__file__).resolve().parents[1] / "assets" / "templates" / "Qwen-Qwen2.5-7B-Instruct.jinja")
    tok = AutoTokenizer.from_pretrained(assets.build_chat_tokenizer(tmp_path / "qwen", "qwen", jinja.read_text()))
    dataset = process(data_file(tmp_path, [CALL_ONLY, TEXT_AND_CALL]), tok, max_length=4096, pack_to_max_length=False)
    trained = [tok.decode([t for t in labels if t != IGNORE]) for labels in dataset["labels"]]
    assert trained == ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>'
                       '12 C in Oslo.<|im_end|>',
                       'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
                       '</tool_call><|im_end|>12 C in Oslo.<|im_end|>']


def test_the_flag_reaches_every_dataset_of_a_config():
    from mmengine.config import ConfigDict

    from sfttool.dataset.mix import mix_datasets
    from sfttool.dataset.resolve import skip_bad_rows_in
    from sfttool.dataset.streaming import StreamingPackedDataset
    part = dict(type=process_hf_dataset, dataset=dict(type="list", rows=[]), max_length=8)
    cfg = ConfigDict(train_dataloader=dict(dataset=dict(type=mix_datasets, datasets=[part, dict(part)])),
                     val_dataloader=dict(dataset=dict(type=StreamingPackedDataset, dataset=[])),
                     model=dict(type="dict", lora=None))
    assert skip_bad_rows_in(cfg) == 3
    assert [p["skip_bad_rows"] for p in cfg.train_dataloader.dataset.datasets] == [True, True]
    assert cfg.val_dataloader.dataset.skip_bad_rows is True
    assert "skip_bad_rows" not in cfg.train_dataloader.dataset and "skip_bad_rows" not in cfg.model
    with pytest.raises(DatasetError, match="--skip-bad-rows: no dataset of this config can skip rows"):
        skip_bad_rows_in(ConfigDict(train_dataloader=dict(dataset=dict(type="dict"))))


def test_process_hf_dataset_caches_skipped_and_refused_runs_apart(tmp_path, tiny_tokenizer):
    """The flag changes the rows: a cached run without it is not reused with it."""
    path = data_file(tmp_path, [PLAIN, CALL_ONLY])
    cache = tmp_path / "cache"
    out = process(path, tiny_tokenizer, cache_dir=str(cache), skip_bad_rows=True)
    assert len(out) == 1
    with pytest.raises(DatasetError, match="does not render tool calls"):
        process(path, tiny_tokenizer, cache_dir=str(cache))


@pytest.mark.real_asset
def test_smollm2s_chat_template_is_refused_on_tool_rows(tmp_path, smollm2_dir):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    with pytest.raises(DatasetError, match=r"row 0: the tokenizer's chat template does not render tool calls, "
                                           r"so an answer of this row would be trained as '<\|im_end\|>'"):
        process(data_file(tmp_path, [CALL_ONLY]), tok)
