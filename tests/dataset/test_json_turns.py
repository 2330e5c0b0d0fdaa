"""Turns held as JSON text (``List(Json)``, how ``datasets`` loads turns whose keys differ between rows) reach
the encode stage parsed a batch at a time (``stages.python_batch``): the same values as ``datasets`` decodes."""
import json

import pytest
from datasets import load_dataset

from sfttool.dataset.stages import json_turns, python_batch

ROWS = [
    {"id": 0, "meta": {"tag": "a"}, "conversation": [{"system": "S", "input": "Q", "output": "A"},
                                                     {"input": "Q2", "output": "A2", "output_with_loss": False}]},
    {"id": 1, "meta": {"tag": "b"}, "conversation": None},
    {"id": 2, "meta": None, "conversation": []},
    {"id": 3, "meta": {"tag": "c"}, "conversation": [
        {"input": "é \u2028 😀", "output": "x", "messages": [{"role": "user", "content": "q"},
                                                           {"role": "assistant", "content": "",
                                                            "tool_calls": [{"function": {"name": "f",
                                                                                         "arguments": {"x": 0.1}}}]}]}]},
    {"id": 4, "meta": {"tag": "d"}, "conversation": [{"input": None, "output": "only an answer", "n": 12345678901234}]},
]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    path = tmp_path_factory.mktemp("json_turns") / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    return load_dataset("json", data_files=str(path), split="train",
                        cache_dir=str(tmp_path_factory.mktemp("cache")))


def test_turns_with_differing_keys_load_as_json_text(dataset):
    assert json_turns(dataset.features)


@pytest.mark.parametrize("start, stop", [(0, 5), (1, 4), (3, 5), (2, 3)])
def test_a_batch_parsed_at_once_equals_the_batch_datasets_decodes(dataset, start, stop):
    assert python_batch(dataset.with_format("arrow")[start:stop], dataset.features) == dataset[start:stop]


def test_rows_picked_by_an_indices_mapping(dataset):
    picked = dataset.select([4, 0, 3])
    assert python_batch(picked.with_format("arrow")[0:3], picked.features) == picked[0:3]


def test_turns_with_the_same_keys_load_as_structs(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"conversation": [{"input": "Q", "output": "A"}]}) + "\n")
    assert not json_turns(load_dataset("json", data_files=str(path), split="train",
                                       cache_dir=str(tmp_path / "cache")).features)


def test_the_pipeline_gives_the_same_rows_from_json_turns_as_from_struct_turns(tmp_path, tiny_tokenizer):
    """The same conversations loaded with JSON-text turns (a system prompt on some first turns only) and with
    struct turns (every turn with every key): the same packed rows, in one map process and in two."""
    import os

    from sfttool import assets
    from sfttool.dataset import process_hf_dataset
    from sfttool.dataset.map_fns import template_map_fn_factory

    rows = assets.tiny_conversations(80, seed=3)
    every_key = [{"conversation": [{"system": "", **turn} for turn in row["conversation"]]} for row in rows]
    runs = {}
    for name, data in (("json", rows), ("struct", every_key)):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in data))
        for num_proc in ((1, 2) if name == "json" and (os.cpu_count() or 1) > 1 else (1,)):
            loaded = dict(type=load_dataset, path="json", data_files=str(path),
                          cache_dir=str(tmp_path / f"cache-{name}-{num_proc}"))
            out = process_hf_dataset(dataset=loaded, tokenizer=tiny_tokenizer, max_length=128,
                                     template_map_fn=template_map_fn_factory("qwen_chat"), map_num_proc=num_proc)
            runs[name, num_proc] = out.to_list()
    features = {name: load_dataset("json", data_files=str(tmp_path / f"{name}.jsonl"), split="train",
                                   cache_dir=str(tmp_path / "cache-check")).features for name in ("json", "struct")}
    assert json_turns(features["json"]) and not json_turns(features["struct"])  # both paths were taken
    assert all(rows_out == runs["struct", 1] for rows_out in runs.values()) and len(runs["struct", 1]) > 1
