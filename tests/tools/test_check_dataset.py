"""`sfttool check-custom-dataset`: output and exit codes on good and bad data and configs."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from sfttool import assets
from sfttool.cli.main import cli

CONFIG = """
from datasets import load_dataset
from transformers import AutoTokenizer
from sfttool.dataset import process_hf_dataset
from sfttool.dataset.map_fns import template_map_fn_factory, alpaca_map_fn
from sfttool.utils import PROMPT_TEMPLATE

tokenizer = dict(type=AutoTokenizer.from_pretrained, pretrained_model_name_or_path={tok!r})
train_dataset = dict(
    type=process_hf_dataset,
    dataset=dict(type=load_dataset, path='json', data_files={data!r}),
    tokenizer=tokenizer, max_length=128, dataset_map_fn={map_fn},
    template_map_fn=dict(type=template_map_fn_factory, template={template}),
    remove_unused_columns=True, pack_to_max_length=True)
train_dataloader = dict(batch_size=2, dataset=train_dataset)
"""


def make_config(tmp_path, tok_dir, rows=None, lines=None, map_fn="None", template="PROMPT_TEMPLATE.qwen_chat"):
    data = tmp_path / "data.jsonl"
    if lines is not None:
        data.write_text("\n".join(lines) + "\n", encoding="utf-8")
    else:
        assets.write_jsonl(data, rows if rows is not None else assets.tiny_conversations(20))
    cfg = tmp_path / "cfg.py"
    cfg.write_text(CONFIG.format(tok=str(tok_dir), data=str(data), map_fn=map_fn, template=template))
    return cfg


def check(cfg, *extra):
    result = CliRunner().invoke(cli, ["check-custom-dataset", str(cfg), "--no-color", *extra])
    return result.exit_code, result.output


def test_good_dataset(tmp_path, tiny_tokenizer_dir):
    code, out = check(make_config(tmp_path, tiny_tokenizer_dir))
    assert code == 0, out
    assert f"Config: {tmp_path / 'cfg.py'}" in out
    for header in ("== raw row (row 0) ==", "== after template_map_fn (row 0) ==", "== input_ids (row 0) ==",
                   "== labels (row 0) ==", "== trained vs masked", "== final row 0:", "== statistics =="):
        assert header in out
    assert "[MASKED:<|im_start|>user\n" in out and "<|im_end|>[MASKED:\n<|im_start|>user" in out
    for stat in ("rows in: 20", "sample length (tokens): min", "truncated at max_length=128",
                 "trained tokens:", "packing (bfd): 20 samples ->", "tokens per epoch:", "iterations per epoch"):
        assert stat in out
    assert "OK: 0 errors, 0 warnings" in out


def test_every_row_validated_with_file_row_field(tmp_path, tiny_tokenizer_dir):
    rows = assets.tiny_conversations(30)
    for i in (4, 17, 25):
        rows[i]["conversation"][0]["output"] = None
    rows[9]["conversation"] = []
    code, out = check(make_config(tmp_path, tiny_tokenizer_dir, rows=rows), "--max-errors", "3")
    assert code == 1
    data = tmp_path / "data.jsonl"
    assert f"ERROR: {data}, row 4, field 'conversation[0].output': expected a string, got missing" in out
    assert f"ERROR: {data}, row 9: empty conversation (this row would be dropped)" in out
    assert f"{data}, row 17, field 'conversation[0].output'" in out
    assert "... and 1 more rows with errors" in out
    assert "FAILED: 4 errors" in out


def test_malformed_jsonl_names_line(tmp_path, tiny_tokenizer_dir):
    good = json.dumps({"conversation": [{"input": "q", "output": "a"}]})
    code, out = check(make_config(tmp_path, tiny_tokenizer_dir, lines=[good, good, "{broken"]))
    assert code == 1
    assert f"ERROR: {tmp_path / 'data.jsonl'}, line 3: invalid JSON" in out


def test_malformed_jsonl_read_through_data_path_names_line(tmp_path, tiny_tokenizer_dir):
    good = json.dumps({"conversation": [{"input": "q", "output": "a"}]})
    cfg = make_config(tmp_path, tiny_tokenizer_dir, lines=[good, "{broken"])
    text = cfg.read_text().replace("dataset=dict(type=load_dataset, path='json', data_files=",
                                   "dataset=dict(type=load_data_path, path=")
    cfg.write_text("from sfttool.dataset.data_path import load_data_path\n" + text)
    code, out = check(cfg)
    assert code == 1
    assert f"Checking every line of {tmp_path / 'data.jsonl'}" in out
    assert f"ERROR: {tmp_path / 'data.jsonl'}, line 2: invalid JSON" in out


def test_raw_data_without_map_fn(tmp_path, tiny_tokenizer_dir):
    rows = [{"instruction": "Say hi", "input": "", "output": "hi"}]
    code, out = check(make_config(tmp_path, tiny_tokenizer_dir, rows=rows))
    assert code == 1
    assert (f"ERROR: {tmp_path / 'data.jsonl'}, row 0: no `conversation` (fields: instruction, input, output); data "
            "that is not in the standard "
            "format needs a dataset_map_fn (set dataset_map_fn=alpaca_map_fn), or convert the data to "
            "{'conversation': [...]}") in out
    code, out = check(make_config(tmp_path, tiny_tokenizer_dir, rows=rows, map_fn="alpaca_map_fn"))
    assert code == 0, out
    assert "== after dataset_map_fn (row 0) ==" in out


def test_standard_data_with_map_fn(tmp_path, tiny_tokenizer_dir):
    code, out = check(make_config(tmp_path, tiny_tokenizer_dir, map_fn="alpaca_map_fn"))
    assert code == 1 and "set dataset_map_fn=None" in out


def test_map_fn_error_reports_row(tmp_path, tiny_tokenizer_dir):
    rows = [{"instruction": "a", "input": "", "output": "b"}, {"instruction": "a", "input": ""}]
    code, out = check(make_config(tmp_path, tiny_tokenizer_dir, rows=rows, map_fn="alpaca_map_fn"))
    assert code == 1
    assert "row 1: dataset_map_fn alpaca_map_fn failed" in out


def test_split_marker_warning(tmp_path, tiny_tokenizer_dir):
    template = ("dict(SYSTEM='<|System|>:{system}\\n', INSTRUCTION='<|User|>:{input}\\n<|Bot|>:', "
                "SUFFIX='<eoa>', SUFFIX_AS_EOS=False, SEP='\\n')")
    code, out = check(make_config(tmp_path, tiny_tokenizer_dir, template=template))
    assert code == 0, out
    assert "WARNING: template marker '<|User|>' is" in out and "tokens for this tokenizer" in out


def test_template_disagrees_with_chat_template(tmp_path, tiny_tokenizer_dir):
    code, out = check(make_config(tmp_path, tiny_tokenizer_dir, template="PROMPT_TEMPLATE.llama2_chat"))
    assert code == 0, out
    assert "renders differently from the tokenizer's chat_template" in out
    assert "PROMPT_TEMPLATE.hf_chat_template" in out


def test_hf_chat_template_mode(tmp_path, tiny_tokenizer_dir):
    code, out = check(make_config(tmp_path, tiny_tokenizer_dir, template="PROMPT_TEMPLATE.hf_chat_template"))
    assert code == 0, out
    assert "OK: 0 errors, 0 warnings" in out


def test_config_without_dataset(tmp_path):
    cfg = tmp_path / "cfg.py"
    cfg.write_text("x = 1\n")
    code, out = check(cfg)
    assert code == 1
    assert "no `train_dataloader.dataset`" in out and "Traceback" not in out


@pytest.mark.parametrize("missing", ["nope.py"])
def test_missing_config(missing):
    code, out = check(missing)
    assert code == 1 and "Error:" in out and "Traceback" not in out


MIX_CONFIG = CONFIG + """
from sfttool.dataset import mix_datasets
second = dict(train_dataset, dataset=dict(type=load_dataset, path='json', data_files={data2!r}))
train_dataloader = dict(batch_size=2, dataset=dict(type=mix_datasets, datasets=[train_dataset, second],
                                                   ratios=[1.0, 0.5]))
"""


def test_mix_datasets_checked_one_by_one(tmp_path, tiny_tokenizer_dir):
    data = assets.write_jsonl(tmp_path / "data.jsonl", assets.tiny_conversations(10))
    bad = assets.tiny_conversations(10, seed=1)
    bad[3]["conversation"][0]["input"] = None
    bad[3]["conversation"][0]["output"] = None
    data2 = assets.write_jsonl(tmp_path / "data2.jsonl", bad)
    cfg = tmp_path / "mix.py"
    cfg.write_text(MIX_CONFIG.format(tok=str(tiny_tokenizer_dir), data=str(data), map_fn="None",
                                     template="PROMPT_TEMPLATE.qwen_chat", data2=str(data2)))
    code, out = check(cfg)
    assert code == 1
    assert "mix_datasets: dataset 1 of 2" in out and "mix_datasets: dataset 2 of 2" in out
    assert out.count("== statistics ==") == 1  # the first is fine, the second stops at its error
    assert f"ERROR: {data2}, row 3, field 'conversation[0].output'" in out


def test_stage_views_show_the_converted_conversation_whole(tmp_path, tiny_tokenizer_dir):
    # A long raw field used to cut the view at ~600 characters before `conversation` appeared.
    answer = "word " * 20
    rows = [{"source": "x" * 1000, "instruction": "Say it", "input": "", "output": answer}]
    code, out = check(make_config(tmp_path, tiny_tokenizer_dir, rows=rows, map_fn="alpaca_map_fn"))
    assert code == 0, out
    view = out.split("== after dataset_map_fn (row 0) ==\n")[1].split("\n\n")[0].splitlines()
    assert view[0] == f"source: {'x' * 1000!r}"[:608] + "... (1002 chars)"
    assert view[-2:] == ["conversation:", f"  [0] {{'system': '', 'tools': '', 'input': 'Say it\\n', 'messages': '', 'output': {answer!r}, "
                                          "'output_with_loss': True}"]


def test_drops_are_listed_by_cause_with_their_rows(tmp_path, tiny_tokenizer_dir):
    rows = assets.tiny_conversations(6)
    rows[2]["conversation"] = [{"input": "hello " * 200, "output": "a"}]
    rows[4]["conversation"][0]["output_with_loss"] = False
    rows[4]["conversation"] = rows[4]["conversation"][:1]
    code, out = check(make_config(tmp_path, tiny_tokenizer_dir, rows=rows))
    assert code == 0, out
    lines = out.splitlines()
    prompt = next(line for line in lines if line.startswith("dropped 1 rows: prompt"))
    assert prompt.startswith("dropped 1 rows: prompt longer than max_length=128 (the answer was cut away) "
                             "(row 2 (prompt of ")
    assert "dropped 1 rows: answer masked away (output_with_loss=False on every turn) (row 4)" in lines


def test_a_lazily_encoded_config_is_checked_with_the_eager_pipeline(tmp_path, tiny_tokenizer_dir):
    """lazy_encode=True and its settings: the same stages, drops and statistics as the eager config."""
    rows = assets.tiny_conversations(6)
    rows[2]["conversation"] = [{"input": "hello " * 200, "output": "a"}]
    cfg = make_config(tmp_path, tiny_tokenizer_dir, rows=rows)
    check(cfg)  # the first run also converts the JSON file (its progress lines)
    code, eager = check(cfg)
    text = cfg.read_text()
    cfg.write_text(text.replace("pack_to_max_length=True)", "pack_to_max_length=True, lazy_encode=True, "
                                                             "buffer_size=4, seed=0)"))
    code, out = check(cfg)
    assert code == 0, out
    note = ("lazy_encode=True: checked here with the eager pipeline (the same stages, every row at once); "
            "training encodes each row as the loader reads it")
    assert out.splitlines()[1] == note
    assert out.replace(note + "\n", "") == eager
    assert "dropped 1 rows: prompt longer than max_length=128" in out and "packing (bfd): 5 samples ->" in out


def test_rows_a_map_fn_changed_are_warnings_and_repeated_keys_an_error(tmp_path, tiny_tokenizer_dir):
    convs = [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}]
    lines = [json.dumps({"conversations": convs}),
             json.dumps({"conversations": [{"from": "gpt", "value": "Hi!"}] + convs})]
    code, out = check(make_config(tmp_path, tiny_tokenizer_dir, lines=lines, map_fn="'sharegpt_map_fn'"))
    assert code == 0, out
    assert ("WARNING: changed 1 rows: conversation starts with an assistant message (dropped: nothing asked it) "
            "(row 1)") in out
    assert "OK: 0 errors, 1 warnings" in out
    lines.append('{"conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A", "value": "B"}]}')
    code, out = check(make_config(tmp_path, tiny_tokenizer_dir, lines=lines, map_fn="'sharegpt_map_fn'"))
    assert code == 1
    assert (f"ERROR: {tmp_path / 'data.jsonl'}: 1 rows have an object with a repeated key, which the JSON reader "
            "refuses: line 3 (row 2) ('value'); keep one value per key") in out


def test_no_false_template_difference_for_a_chatml_tokenizer_whose_bos_starts_every_turn(tmp_path,
                                                                                           tiny_tokenizer_dir):
    # SmolLM2: BOS is <|im_start|>; the encoder does not write it twice, so the check must not either.
    from transformers import AutoTokenizer

    from sfttool.dataset.template_check import template_mismatch
    from sfttool.utils import PROMPT_TEMPLATE
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    tok.bos_token = "<|im_start|>"
    assert template_mismatch(PROMPT_TEMPLATE.qwen_chat, tok) is None
    assert template_mismatch(PROMPT_TEMPLATE.llama2_chat, tok).startswith(
        "the configured template renders differently from the tokenizer's chat_template (first difference at ")
    saved = tmp_path / "smollm2_like"
    tok.save_pretrained(saved)
    code, out = check(make_config(tmp_path, saved))
    assert code == 0, out
    assert "OK: 0 errors, 0 warnings" in out


def test_tool_calling_and_reasoning_rows_are_shown_and_counted(tmp_path):
    from pathlib import Path
    templates = Path(__file__).resolve().parents[1] / "assets" / "templates"
    tok_dir = assets.build_chat_tokenizer(tmp_path / "tok", "qwen", (templates / "Qwen-Qwen3-0.6B.jinja").read_text())
    call = {"type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    rows = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]},
            {"messages": [{"role": "user", "content": "1+1?"},
                          {"role": "assistant", "content": "2.", "reasoning_content": "One and one."}]},
            {"messages": [{"role": "user", "content": "Add 1."}, {"role": "assistant", "content": "", "tool_calls": [call]},
                          {"role": "tool", "content": "2"}, {"role": "assistant", "content": "It is 2."}]}]
    cfg = make_config(tmp_path, tok_dir, rows=rows, map_fn="'openai_map_fn'", template="PROMPT_TEMPLATE.hf_chat_template")
    code, out = check(cfg)
    assert code == 0, out
    assert "== rows by kind ==\nplain: 1   reasoning: 1   tool calls: 1" in out
    # Qwen3 writes the empty think block before the last answer only: the tool call and the answer after
    # the tool's result are produced in forms no single render holds.
    assert "rows in: 3   rows out: 2\n1 conversations became 2 samples each (the chat template renders" in out
    assert ("== a tool calls row (row 2), trained vs masked ==\n[MASKED:<|im_start|>user\nAdd 1.<|im_end|>\n"
            "<|im_start|>assistant\n]<think>\n\n</think>\n\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1}}\n"
            "</tool_call><|im_end|>[MASKED:\n]") in out
    assert ("== a reasoning row (row 1), trained vs masked ==\n[MASKED:<|im_start|>user\n1+1?<|im_end|>\n"
            "<|im_start|>assistant\n]<think>\nOne and one.\n</think>\n\n2.<|im_end|>[MASKED:\n]") in out


def test_turns_without_an_end_token_and_ignored_fields_are_warnings(tmp_path, tiny_tokenizer_dir):
    rows = [{"messages": [{"role": "user", "content": "1+1?"},
                          {"role": "assistant", "content": "2.", "reasoning_content": "One and one."}]}]
    # The tiny ChatML template renders no reasoning; a template without an end token trains none.
    cfg = make_config(tmp_path, tiny_tokenizer_dir, rows=rows, map_fn="'openai_map_fn'",
                      template="PROMPT_TEMPLATE.hf_chat_template")
    code, out = check(cfg)
    assert "WARNING: changed 1 rows: reasoning_content ignored by the tokenizer's chat template: not in the " \
           "trained text (row 0)" in out, out
    cfg = make_config(tmp_path, tiny_tokenizer_dir, rows=rows * 2, map_fn="'openai_map_fn'",
                      template="dict(INSTRUCTION='Q: {input}\\nA: ', SUFFIX_AS_EOS=True)")
    code, out = check(cfg)
    assert "WARNING: 2 trained turns do not end with an end-of-turn token (rows 0, 1): the model will not learn " \
           "to stop there" in out, out


SOURCES_CONFIG = """
from transformers import AutoTokenizer
from sfttool.dataset import process_data_sources
from sfttool.dataset.map_fns import template_map_fn_factory, alpaca_map_fn
from sfttool.utils import PROMPT_TEMPLATE

def answered(row):
    return {filter_body}

tokenizer = dict(type=AutoTokenizer.from_pretrained, pretrained_model_name_or_path={tok!r})
data_sources = [dict(name='chat', data_path={chat!r}),
                dict(name='alpaca', data_path={alpaca!r}, map_fn=alpaca_map_fn, filter_fn=answered, slice=range(6))]
train_dataset = dict(type=process_data_sources, data_sources=data_sources, tokenizer=tokenizer, max_length=128,
                     template_map_fn=dict(type=template_map_fn_factory, template=PROMPT_TEMPLATE.qwen_chat))
train_dataloader = dict(batch_size=2, dataset=train_dataset)
"""


def sources_config(tmp_path, tok_dir, filter_body="bool(row['output'])"):
    chat = assets.write_jsonl(tmp_path / "chat.jsonl", assets.tiny_conversations(5))
    alpaca = assets.write_jsonl(tmp_path / "alpaca.jsonl", [
        {"instruction": "Add.", "input": "1 2", "output": "3"}, {"instruction": "Say nothing.", "input": "", "output": ""},
        {"instruction": "Name a colour.", "input": "", "output": "Red."}])
    cfg = tmp_path / "sources.py"
    cfg.write_text(SOURCES_CONFIG.format(tok=str(tok_dir), chat=str(chat), alpaca=str(alpaca),
                                         filter_body=filter_body))
    return cfg, alpaca


def test_data_sources_are_checked_source_by_source(tmp_path, tiny_tokenizer_dir):
    cfg, _ = sources_config(tmp_path, tiny_tokenizer_dir)
    code, out = check(cfg)
    assert code == 0, out
    assert "######## data_sources[0] (chat): source 1 of 2 ########" in out
    assert "######## data_sources[1] (alpaca): source 2 of 2 ########" in out
    assert out.count("Validating all 5 rows ...") == 1 and out.count("Validating all 3 rows ...") == 1
    # alpaca: rows 0 1 2 0 1 2; the filter drops row 1 (empty answer) both times.
    assert "dropped 2 rows: data_sources[1] (alpaca): filter_fn answered returned False (row 1, row 1)" in out
    assert "data_sources[0] (chat): 5 rows read, 5 after map/filter, 5 samples, 5 used, " in out
    assert "data_sources[1] (alpaca): 3 rows read (6 after slice), 4 after map/filter, 4 samples, 4 used, " in out
    assert "concat share of samples 0.444 (requested 0.444)" in out
    assert "OK: 0 errors, 0 warnings" in out


def test_a_filter_returning_a_non_bool_is_an_error_naming_the_row(tmp_path, tiny_tokenizer_dir):
    cfg, alpaca = sources_config(tmp_path, tiny_tokenizer_dir, filter_body="len(row['output'])")
    code, out = check(cfg)
    assert code == 1, out
    assert (f"ERROR: data_sources[1] (alpaca) {alpaca}, row 0: filter_fn answered returned int 1, not a bool; "
            "return True to keep the row, False to drop it") in out


def test_streamed_data_sources_are_checked_eagerly(tmp_path, tiny_tokenizer_dir):
    cfg, _ = sources_config(tmp_path, tiny_tokenizer_dir)
    text = cfg.read_text().replace("process_data_sources", "StreamingDataSources").replace(
        "from sfttool.dataset import StreamingDataSources",
        "from sfttool.dataset.streaming_sources import StreamingDataSources")
    cfg.write_text(text)
    code, out = check(cfg)
    assert code == 1, out
    assert ("ERROR: train_dataloader.dataset: data_sources[1].slice is not available when streaming: row indices "
            "need the source's length, which a stream does not know; remove it, or use process_data_sources") in out
    cfg.write_text(text.replace(", slice=range(6)", ""))
    code, out = check(cfg)
    assert code == 0, out
    assert "data_sources[1] (alpaca): 3 rows read, 2 after map/filter, 2 samples, 2 used, " in out


def test_a_dataset_builder_it_cannot_check_is_named_with_those_it_can(tmp_path):
    from sfttool.dataset.errors import DatasetError
    from sfttool.tools.check_dataset import check_dataset
    path = tmp_path / "own.py"
    path.write_text("def my_rows(dataset=None):\n    return dataset\n"
                    "train_dataloader = dict(batch_size=1, dataset=dict(type=my_rows, dataset=None))\n")
    with pytest.raises(DatasetError, match=r"train_dataloader.dataset is my_rows; "
                                           r"check-custom-dataset checks process_hf_dataset \(alone or inside "
                                           r"mix_datasets\), process_data_sources, StreamingDataSources, "
                                           r"build_preference_dataset, build_kto_dataset and build_prompt_dataset "
                                           r"datasets, not this one yet"):
        check_dataset(str(path), echo=lambda line: None)
