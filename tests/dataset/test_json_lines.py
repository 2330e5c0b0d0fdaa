"""Local JSON Lines read without load_dataset's builder (``json_lines``): the same dataset as
``load_dataset('json', ...)``, the same pipeline output, and load_dataset for what it does not read."""
from __future__ import annotations

import gzip
import json

import pytest
from datasets import load_dataset

from sfttool import assets
from sfttool.dataset import json_lines
from sfttool.dataset.data_path import load_data_path
from sfttool.dataset.json_lines import json_lines_files, load_json_config, load_json_lines
from sfttool.dataset.map_fns import template_map_fn_factory
from sfttool.dataset.pipeline import run_pipeline

QWEN = template_map_fn_factory("qwen_chat")

FILES = {
    # turns of differing keys: datasets 5 reads them as Json
    "mixed_turn_keys": [{"conversation": [{"system": "s", "input": "q", "output": "a"},
                                          {"input": "q2", "output": "b"}]},
                        {"conversation": [{"input": "q", "output": "a", "output_with_loss": False}]}],
    "one_struct": [{"conversation": [{"input": "q", "output": "a"}], "id": i, "score": i / 3} for i in range(5)],
    "nulls_nested_unicode": [{"conversation": [{"input": "héllo 🙂 \u4e2d", "output": "ok"}], "meta": None,
                              "tags": ["a", "b"]},
                             {"conversation": [{"input": "", "output": "\n\t"}], "meta": {"k": 1.5, "b": True},
                              "tags": []}],
    "field_changes_type": [{"conversation": [{"input": "q", "output": "a"}], "extra": "text"},
                           {"conversation": [{"input": "q", "output": "a"}], "extra": {"x": [1, 2]}}],
    "dates_and_ints": [{"conversation": [{"input": "q", "output": "a"}], "when": "2024-01-02", "n": 1},
                       {"conversation": [{"input": "q", "output": "a"}], "when": "2024-03-04", "n": 2}],
}


def write_jsonl(path, rows, blank_lines=False, bom=False):
    lines = [json.dumps(r, ensure_ascii=False) for r in rows]
    if blank_lines:
        lines.insert(1, "")
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + ("\n".join(lines) + "\n").encode("utf-8"))
    return str(path)


def assert_same(mine, reference):
    assert mine is not None
    assert mine.features == reference.features
    assert mine.data.table.equals(reference.data.table)
    assert mine.to_list() == reference.to_list()


@pytest.mark.parametrize("name", sorted(FILES))
@pytest.mark.parametrize("blank_lines, bom", [(False, False), (True, True)])
def test_the_same_dataset_as_load_dataset(tmp_path, name, blank_lines, bom):
    path = write_jsonl(tmp_path / "d.jsonl", FILES[name], blank_lines, bom)
    try:
        reference = load_dataset("json", data_files=path, split="train")
    except Exception:  # noqa: BLE001  (datasets 5.2 fails on a blank line among mixed-type rows)
        assert load_json_lines([path]) is None  # so load_dataset runs, and says what it says today
        return
    assert_same(load_json_lines([path]), reference)


def test_several_files_and_a_lines_file_named_json(tmp_path):
    files = [write_jsonl(tmp_path / "a.jsonl", FILES["one_struct"]),
             write_jsonl(tmp_path / "b.json", FILES["one_struct"][:2])]
    assert_same(load_json_lines(files), load_dataset("json", data_files=files, split="train"))


def _small_chunks(monkeypatch, size):
    reader = json_lines._reader

    def small(files):
        r, sources = reader(files)
        r.config.chunksize = size
        return r, sources
    monkeypatch.setattr(json_lines, "_reader", small)


def test_chunks_of_one_schema_are_read_once_and_equal_load_dataset(tmp_path, monkeypatch):
    rows = [{"conversation": [{"input": f"q{i}", "output": "a" * i}]} for i in range(300)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    _small_chunks(monkeypatch, 1024)
    assert_same(load_json_lines([path]), load_dataset("json", data_files=path, split="train", chunksize=1024))


def test_a_later_chunk_of_another_schema_goes_to_load_dataset(tmp_path, monkeypatch):
    rows = [{"conversation": [{"input": "q", "output": "a"}]}] * 100 + [{"conversation": [], "new": 1}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    _small_chunks(monkeypatch, 1024)
    assert load_json_lines([path]) is None


def test_what_it_does_not_read_is_left_to_load_dataset(tmp_path):
    lines = write_jsonl(tmp_path / "d.jsonl", FILES["one_struct"])
    array = tmp_path / "a.json"
    array.write_text(json.dumps(FILES["one_struct"]), encoding="utf-8")
    packed = tmp_path / "d.jsonl.gz"
    packed.write_bytes(gzip.compress(open(lines, "rb").read()))
    assert load_json_lines([str(array)]) is None  # an array: datasets reads the whole file its own way
    for cfg in (dict(type=load_dataset, path="json", data_files=str(packed)),
                dict(type=load_dataset, path="json", data_files=str(tmp_path / "*.jsonl")),
                dict(type=load_dataset, path="json", data_files=lines, field="rows"),
                dict(type=load_dataset, path="json", data_files={"train": lines, "test": lines}),
                dict(type=load_dataset, path="csv", data_files=lines),
                dict(type=load_dataset, path="jsonl", data_files=lines),
                dict(type=load_dataset, path="json", data_files=lines, split="train[:2]")):
        assert load_json_config(cfg, "train") is None, cfg
    assert json_lines_files(dict(type=load_dataset, path="json", data_files={"val": lines})) == ([lines], "val")
    assert json_lines_files(dict(type=load_data_path, path=lines)) == ([lines], "train")


def test_the_file_is_cached_by_content(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", FILES["one_struct"])
    first = load_json_lines([path])
    again = load_json_lines([path])
    assert again.cache_files == first.cache_files and again._fingerprint == first._fingerprint
    # map caches beside it, as on load_dataset's file: a second identical map reuses the result
    mapped = first.map(lambda row: {"n": len(row["conversation"])}, new_fingerprint="count")
    assert mapped.cache_files and mapped.cache_files[0]["filename"].startswith(str(json_lines._cache_dir()))
    write_jsonl(tmp_path / "d.jsonl", FILES["one_struct"][:2])
    changed = load_json_lines([path])
    assert changed._fingerprint != first._fingerprint and len(changed) == 2


@pytest.mark.parametrize("packed", [True, False])
def test_pipeline_output_equals_the_load_dataset_one(tmp_path, tiny_tokenizer, packed):
    rows = assets.tiny_conversations(30, seed=5) + FILES["mixed_turn_keys"]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    cfg = dict(type=load_dataset, path="json", data_files=path)
    assert load_json_config(cfg, "train") is not None  # the fast path is the one compared
    runs = [run_pipeline(data, tiny_tokenizer, 64, template_map_fn=QWEN, pack_to_max_length=packed, source=path)
            for data in (cfg, load_dataset("json", data_files=path, split="train"))]
    (mine, mine_report), (reference, reference_report) = runs
    assert mine.to_dict() == reference.to_dict()
    assert {k: v for k, v in vars(mine_report).items() if k != "stages"} == \
        {k: v for k, v in vars(reference_report).items() if k != "stages"}


def test_data_its_reader_refuses_fails_as_load_dataset_fails(tmp_path, tiny_tokenizer):
    from sfttool.dataset.resolve import resolve_dataset
    path = write_jsonl(tmp_path / "d.jsonl", FILES["field_changes_type"], blank_lines=True)
    cfg = dict(type=load_dataset, path="json", data_files=path)
    with pytest.raises(Exception) as before:
        resolve_dataset(cfg, "train")
    with pytest.raises(Exception) as now:
        run_pipeline(cfg, tiny_tokenizer, 64, template_map_fn=QWEN)
    assert type(now.value) is type(before.value) and str(now.value) == str(before.value)
