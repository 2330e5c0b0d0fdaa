"""Loading local JSON/JSONL: every malformed row is reported by file and line."""
from __future__ import annotations

import json

import pytest
from datasets import load_dataset

from sfttool.dataset import DatasetError, process_hf_dataset
from sfttool.dataset.load import check_json_file, data_file_list, load_json_dataset
from sfttool.dataset.map_fns import template_map_fn_factory

GOOD = {"conversation": [{"input": "q", "output": "a"}]}


def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_good_jsonl_loads(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", [json.dumps(GOOD)] * 3 + [""])
    assert check_json_file(path) == 3
    assert len(load_json_dataset(str(path))) == 3


@pytest.mark.parametrize("lines, message", [
    ([json.dumps(GOOD), '{"conversation": [', json.dumps(GOOD)], r"d.jsonl, line 2: invalid JSON"),
    ([json.dumps(GOOD), "[1, 2]"], r"d.jsonl, line 2: expected a JSON object, got list"),
    ([json.dumps({"a": "x"}), json.dumps({"a": 3})],
     r"d.jsonl, line 2, field 'a': a number here but a string at line 1"),
    ([json.dumps(GOOD), json.dumps({"conversation": [{"input": "q", "output": 5}]})],
     r"d.jsonl, line 2, field 'conversation\[0\].output': expected a string, got an int"),
    ([json.dumps({"conversation": [{"input": "q"}]})],
     r"d.jsonl, line 1, field 'conversation\[0\].output': expected a string, got missing"),
    ([json.dumps({"conversation": [{"from": "human", "value": "q"}]})],
     r"line 1, field 'conversation\[0\]': no `input`/`output` \(keys: from, value\)"),
])
def test_bad_jsonl_names_file_and_line(tmp_path, lines, message):
    path = write_lines(tmp_path / "d.jsonl", lines)
    with pytest.raises(DatasetError, match=message):
        check_json_file(path)


def test_bad_json_array(tmp_path):
    path = tmp_path / "d.json"
    path.write_text('[\n  {"conversation": []},\n  {"conversation": \n]', encoding="utf-8")
    with pytest.raises(DatasetError, match=r"d.json, line 4: invalid JSON"):
        check_json_file(path)
    path.write_text('{"conversation": []}', encoding="utf-8")
    with pytest.raises(DatasetError, match="expected a JSON array of rows"):
        check_json_file(path)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        check_json_file(tmp_path / "nope.jsonl")


def test_data_file_list():
    assert data_file_list({"train": ["a", "b"], "test": "c"}) == ["a", "b", "c"]
    assert data_file_list("a") == ["a"] and data_file_list(None) == []


def test_pipeline_validates_json_config_first(tmp_path, tiny_tokenizer):
    """An XTuner-style config with a malformed line: a DatasetError with file and line, not Arrow's traceback."""
    path = write_lines(tmp_path / "d.jsonl", [json.dumps(GOOD), "{oops}"])
    with pytest.raises(DatasetError, match=r"d.jsonl, line 2: invalid JSON"):
        process_hf_dataset(dict(type=load_dataset, path="json", data_files=str(path)), tiny_tokenizer,
                           max_length=32, template_map_fn=template_map_fn_factory("qwen_chat"))
