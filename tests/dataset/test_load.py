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
    ([json.dumps(GOOD), "[1, 2]"], r"d.jsonl, line 2 \(row 1\): expected a JSON object, got list"),
    ([json.dumps({"conversation": [{"input": "q", "output": "a", "score": "x"}]}),
      json.dumps({"conversation": [{"input": "q", "output": "a", "score": 3}]})],
     r"d.jsonl, line 2 \(row 1\), field 'conversation\[\].score': a number here but a string at line 1"),
    ([json.dumps(GOOD), "", json.dumps({"conversation": [{"input": "q", "output": 5}]})],
     r"d.jsonl, line 3 \(row 1\), field 'conversation\[0\].output': expected a string, got an int"),
    ([json.dumps({"conversation": [{"input": "q"}]})],
     r"d.jsonl, line 1 \(row 0\), field 'conversation\[0\].output': expected a string, got missing"),
    ([json.dumps({"conversation": [{"from": "human", "value": "q"}]})],
     r"line 1 \(row 0\), field 'conversation\[0\]': no `input`/`output` \(keys: from, value\)"),
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
    path.write_text('{\n  "conversation": []\n}\n', encoding="utf-8")  # one object over several lines
    with pytest.raises(DatasetError, match="expected a JSON array of rows, got a dict"):
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


# ---------------------------------------------------------------------------
# What datasets reads, we check: content decides the format, compressed files, globs, nested fields.

def test_the_content_decides_the_format_not_the_suffix(tmp_path):
    lines_in_json = write_lines(tmp_path / "lines.json", [json.dumps(GOOD)] * 2)
    array_upper = tmp_path / "array.JSON"
    array_upper.write_text(json.dumps([GOOD] * 3), encoding="utf-8")
    one_object = write_lines(tmp_path / "one.json", [json.dumps(GOOD)])
    assert [check_json_file(p) for p in (lines_in_json, array_upper, one_object)] == [2, 3, 1]
    for path, n in ((lines_in_json, 2), (array_upper, 3)):
        assert len(load_dataset("json", data_files=str(path), split="train")) == n  # datasets agrees


def test_not_utf8_names_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b'\n{"conversation": [{"input": "caf\xe9", "output": "a"}]}\n')
    with pytest.raises(DatasetError, match=r"d.jsonl, line 2: not UTF-8 text \(byte 0xe9 at column 33\)"):
        check_json_file(path)


def test_a_lone_surrogate_is_named(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", [json.dumps(GOOD), '{"conversation": [{"input": "q\\ud83d", '
                                                                '"output": "a"}]}'])
    with pytest.raises(DatasetError, match=r"d.jsonl, line 2: a lone surrogate escape"):
        check_json_file(path)
    write_lines(path, ['{"conversation": [{"input": "q\\ud83d\\ude00", "output": "a"}]}'])  # a whole emoji
    assert check_json_file(path) == 1


def test_gzip_file_is_checked_and_loads(tmp_path, tiny_tokenizer):
    import gzip
    path = tmp_path / "d.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write(json.dumps(GOOD) + "\n{oops}\n")
    with pytest.raises(DatasetError, match=r"d.jsonl.gz, line 2: invalid JSON"):
        process_hf_dataset(dict(type=load_dataset, path="json", data_files=str(path)), tiny_tokenizer,
                           max_length=32, template_map_fn=template_map_fn_factory("qwen_chat"))
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write(json.dumps(GOOD) + "\n")
    out = process_hf_dataset(dict(type=load_dataset, path="json", data_files=str(path)), tiny_tokenizer,
                             max_length=32, template_map_fn=template_map_fn_factory("qwen_chat"))
    assert len(out) == 1


def test_glob_data_files_are_checked(tmp_path):
    from sfttool.dataset.load import local_json_files
    (tmp_path / "parts").mkdir()
    write_lines(tmp_path / "parts" / "a.jsonl", [json.dumps(GOOD)])
    write_lines(tmp_path / "parts" / "b.jsonl", [json.dumps(GOOD), "{oops}"])
    files = local_json_files("json", str(tmp_path / "parts" / "*.jsonl"))
    assert [p.rsplit("/", 1)[-1] for p in files] == ["a.jsonl", "b.jsonl"]
    with pytest.raises(DatasetError, match=r"b.jsonl, line 2: invalid JSON"):
        for path in files:
            check_json_file(path)
    assert local_json_files("json", str(tmp_path / "parts")) == []  # a folder: datasets resolves it
    assert local_json_files("csv", str(tmp_path / "parts" / "a.jsonl")) == []


def test_field_types_must_agree_inside_conversation_only(tmp_path):
    """The stages rewrite `conversation` through Arrow, which needs one type per turn field; other columns
    whose type changes load as datasets' Json and pass through untouched (checked: they train)."""
    rows = [{"conversation": [{"input": "q", "output": "a", "score": 1}]},
            {"conversation": [{"input": "q", "output": "a", "score": "high"}]}]
    path = write_lines(tmp_path / "d.jsonl", [json.dumps(r) for r in rows])
    with pytest.raises(DatasetError, match=r"d.jsonl, line 2 \(row 1\), field 'conversation\[\].score': a string "
                                           r"here but a number at line 1"):
        check_json_file(path)
    loose = [{**GOOD, "meta": 1, "tags": []}, {**GOOD, "meta": "x", "tags": [1, "y"]}]
    write_lines(path, [json.dumps(r) for r in loose])
    assert check_json_file(path) == 2
    assert len(load_dataset("json", data_files=str(path), split="train")) == 2


def test_files_datasets_reads_are_read(tmp_path):
    """A UTF-8 BOM (Windows editors), pretty-printed objects one after another."""
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + (json.dumps(GOOD) + "\n").encode() * 2)
    bom_array = tmp_path / "bom.json"
    bom_array.write_bytes(b"\xef\xbb\xbf" + json.dumps([GOOD] * 3).encode())
    pretty = tmp_path / "pretty.jsonl"
    pretty.write_text(json.dumps(GOOD, indent=2) + "\n" + json.dumps(GOOD, indent=2) + "\n")
    for path, n in ((bom, 2), (bom_array, 3), (pretty, 2)):
        assert check_json_file(path) == n
        assert len(load_dataset("json", data_files=str(path), split="train")) == n  # datasets agrees


def test_an_empty_file_and_an_array_on_the_first_line(tmp_path):
    empty = write_lines(tmp_path / "empty.jsonl", ["", "  "])
    with pytest.raises(DatasetError, match=r"empty.jsonl: the file holds no rows"):
        check_json_file(empty)
    array_first = write_lines(tmp_path / "a.jsonl", ["[1, 2]", json.dumps(GOOD)])
    with pytest.raises(DatasetError, match=r"a.jsonl, line 1 \(row 0\): expected a JSON object, got list"):
        check_json_file(array_first)


@pytest.mark.parametrize("turn, message", [
    ({"system": ["Be nice"], "input": "q", "output": "a"}, r"field 'conversation\[0\].system': expected a string, "
                                                            r"got a list"),
    ({"input": "q", "output": "a", "output_with_loss": "false"},
     r"field 'conversation\[0\].output_with_loss': expected true or false, got 'false'"),
])
def test_turn_fields_other_than_input_and_output_are_checked(tmp_path, turn, message):
    path = write_lines(tmp_path / "d.jsonl", [json.dumps({"conversation": [turn]})])
    with pytest.raises(DatasetError, match=message):
        check_json_file(path)


def test_field_argument_reads_the_rows_under_it(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps({"version": 1, "data": [GOOD, {"conversation": [{"input": 1, "output": "a"}]}]}))
    with pytest.raises(DatasetError, match=r"d.json, row 1, field 'conversation\[0\].input': expected a string"):
        check_json_file(path, field="data")
    with pytest.raises(DatasetError, match=r"no top-level field 'rows'"):
        check_json_file(path, field="rows")


def test_json_errors_read_once_at_column(tmp_path):
    # json's message "Unterminated string starting at" used to read "... starting at at column 16".
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(GOOD) + '\n{"conversation": "unfinished', encoding="utf-8")
    with pytest.raises(DatasetError) as exc:
        check_json_file(path)
    assert str(exc.value) == (f"{path}, line 2: invalid JSON: the line ends before its last object, array or string "
                              "is closed (Unterminated string starting at column 18); it was cut off (a writer "
                              "stopped mid-row?): complete it or remove it")


@pytest.mark.parametrize("suffix", ["jsonl", "json"])
def test_repeated_keys_are_one_error_counting_the_rows_and_naming_the_first(tmp_path, suffix):
    # Arrow's JSON reader refuses them ("Column(/conversation/[]/output) was specified twice in row 1").
    twice = '{"conversation": [{"input": "q", "output": "a", "output": "b"}]}'
    top = '{"conversation": [{"input": "q", "output": "a"}], "id": 1, "id": 2}'
    rows = [json.dumps(GOOD), twice, json.dumps(GOOD), top] + [twice] * 6
    text = "\n".join(rows) if suffix == "jsonl" else "[" + ",\n".join(rows) + "]"
    path = tmp_path / f"d.{suffix}"
    path.write_text(text + "\n", encoding="utf-8")
    first = ["line 2 (row 1) ('output')", "line 4 (row 3) ('id')", "line 5 (row 4) ('output')",
             "line 6 (row 5) ('output')", "line 7 (row 6) ('output')"]
    if suffix == "json":
        first = ["row 1 ('output')", "row 3 ('id')", "row 4 ('output')", "row 5 ('output')", "row 6 ('output')"]
    with pytest.raises(DatasetError) as exc:
        check_json_file(path)
    assert str(exc.value) == (f"{path}: 8 rows have an object with a repeated key, which the JSON reader refuses: "
                              f"{', '.join(first)} and 3 more; keep one value per key")
    assert check_json_file(write_lines(tmp_path / "ok.jsonl", [json.dumps(GOOD)] * 3)) == 3


CUT_OFF = '{"conversation": [{"input": "q", "output": "a"}'  # a writer killed mid-line: no closing ]}


@pytest.mark.parametrize("bad, message", [
    (CUT_OFF, r"invalid JSON: the line ends before its last object, array or string is closed \(Expecting ',' "
              r"delimiter at column 48\); it was cut off"),
    ('{"conversation": [{"input": "q" "output": "a"}]}', r"invalid JSON \(Expecting ',' delimiter at column 33\)"),
    ('see below: ' + json.dumps(GOOD), r"invalid JSON \(Expecting value at column 1\)"),
    (json.dumps(GOOD) + " and more", r"invalid JSON \(Extra data at column 51\)"),
    ("[1, 2]", r"expected a JSON object, got list"),
])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_every_malformed_line_is_one_error_naming_its_line_wherever_it_sits(tmp_path, bad, message, where):
    """Issue: a JSON Lines file whose last line is cut off gave a 100-line traceback from datasets, the useful
    line (`JSON parse error: Missing a comma or ']' after an array element. in row 4`) buried in it."""
    good = json.dumps(GOOD)
    lines = {"first": [bad, good, good], "middle": [good, bad, good], "last": [good, good, bad]}[where]
    number = lines.index(bad) + 1
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines) + ("" if where == "last" else "\n"), encoding="utf-8")
    with pytest.raises(DatasetError, match=rf"^{path}, line {number}( \(row {number - 1}\))?: {message}"):
        check_json_file(path)


def test_windows_line_endings_and_blank_lines_with_spaces_are_read_as_datasets_reads_them(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes((json.dumps(GOOD) + "\r\n   \r\n" + json.dumps(GOOD) + "\r\n").encode())
    assert check_json_file(path) == 2
    assert load_dataset("json", data_files=str(path), split="train").to_list() == [GOOD, GOOD]
