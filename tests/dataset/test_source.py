"""A row read again as its file has it: Arrow fills a field other rows have with null, the file tells a
missing field from a null one, and the errors say which."""
from __future__ import annotations

import json

import pytest
from datasets import load_dataset

from sfttool.dataset import DatasetError, process_hf_dataset
from sfttool.dataset.data_path import load_data_path
from sfttool.dataset.map_fns import template_map_fn_factory
from sfttool.dataset.source import DataSource
from sfttool.dataset.split import split_indices, validation_split

GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}


def test_rows_are_numbered_as_loaded_across_files_and_layouts(tmp_path):
    lines = tmp_path / "a.jsonl"
    lines.write_text("\n".join(json.dumps({"n": i}) for i in range(3)).replace("\n", "\n  \n", 1) + "\n")
    array = tmp_path / "b.json"
    array.write_text(json.dumps([{"n": 3}, {"n": 4}]))
    pretty = tmp_path / "c.jsonl"
    pretty.write_text(json.dumps({"n": 5}, indent=2) + "\n" + json.dumps({"n": 6}, indent=2) + "\n")
    files = [str(lines), str(array), str(pretty)]
    loaded = load_dataset("json", data_files=files, split="train")
    source = DataSource("my data", files)
    assert source == "my data" and isinstance(source, str)
    assert [source.raw_row(i) for i in range(len(loaded))] == loaded.to_list() == [{"n": i} for i in range(7)]
    assert source.raw_row(7) is None


def test_a_worker_process_gets_the_name_and_files_not_the_index(tmp_path):
    import pickle
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps({"n": 0}) + "\n")
    source = DataSource(str(path), [str(path)])
    assert source.raw_row(0) == {"n": 0} and source._rows
    copy = pickle.loads(pickle.dumps(source))
    assert (copy, copy.files, copy.field, copy._rows) == (source, source.files, None, {})


@pytest.mark.parametrize("val_ratio", [None, 0.25])
def test_a_missing_field_is_not_called_null(tmp_path, tiny_tokenizer, val_ratio):
    # Row 2 lacks `messages`, row 3 has it null: Arrow loads both as null. Row 0 is the held-out one.
    path = tmp_path / "d.jsonl"
    rows = [GOOD, GOOD, {"other": 1}, {"messages": None}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    raw = dict(type=load_data_path, path=str(path))
    assert split_indices(4, 1, seed=1)[1].tolist() == split_indices(3, 1, seed=1)[1].tolist() == [0]
    if val_ratio:
        raw = dict(type=validation_split, dataset=raw, part="train", val_ratio=val_ratio, seed=1)
    args = dict(tokenizer=tiny_tokenizer, max_length=64, dataset_map_fn="openai_map_fn",
                template_map_fn=template_map_fn_factory("qwen_chat"))
    with pytest.raises(DatasetError) as exc:
        process_hf_dataset(raw, **args)
    assert str(exc.value) == (f"{path}, row 2: dataset_map_fn openai_map_fn failed: MapFnError: openai_map_fn: no "
                              "'messages' field; found fields ['other'].")
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:2] + rows[3:]))
    with pytest.raises(DatasetError) as exc:
        process_hf_dataset(raw, **args)
    assert str(exc.value) == (f"{path}, row 2: dataset_map_fn openai_map_fn failed: MapFnError: openai_map_fn: field "
                              "'messages' is null; fill it in or drop this row from the dataset.")


def test_a_stream_stops_at_a_malformed_line_with_the_line_by_line_checks_one_line(tmp_path, tiny_tokenizer):
    """A stream is not checked before it starts (that would read the whole corpus); when it reaches the bad
    line, Arrow's ArrowInvalid (a traceback) becomes the check's line for the file."""
    from sfttool.dataset.streaming import StreamingPackedDataset
    path = tmp_path / "big.jsonl"
    cut = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}'
    path.write_text("".join(json.dumps(GOOD) + "\n" for _ in range(5)) + cut + "\n")
    stream = StreamingPackedDataset(dict(type=load_data_path, path=str(path), streaming=True), tiny_tokenizer,
                                    max_length=64, dataset_map_fn="openai_map_fn",
                                    template_map_fn=template_map_fn_factory("qwen_chat"))
    with pytest.raises(DatasetError) as exc:
        list(stream)
    assert str(exc.value) == (f"{path}, line 6: invalid JSON: the line ends before its last object, array or string "
                              "is closed (Expecting ',' delimiter at column 88); it was cut off (a writer stopped "
                              "mid-row?): complete it or remove it")


def test_a_streams_row_errors_name_the_data_path(tmp_path, tiny_tokenizer):
    from sfttool.dataset.streaming import StreamingPackedDataset
    path = tmp_path / "big.jsonl"
    bad = {"messages": [{"role": "human", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    path.write_text("".join(json.dumps(row) + "\n" for row in (GOOD, GOOD, bad)))
    stream = StreamingPackedDataset(dict(type=load_data_path, path=str(path), streaming=True), tiny_tokenizer,
                                    max_length=64, dataset_map_fn="openai_map_fn",
                                    template_map_fn=template_map_fn_factory("qwen_chat"))
    with pytest.raises(DatasetError, match=rf"^{path}, row 2: dataset_map_fn openai_map_fn failed: MapFnError: "
                                           r"openai_map_fn: messages\[0\] has role 'human'"):
        list(stream)
