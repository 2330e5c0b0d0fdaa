"""`data_path` takes a hub name, a local .json/.jsonl/.csv/.parquet file, a folder or a glob;
a missing file is an error naming `data_path` and the path."""
from __future__ import annotations

import json

import pytest

from sfttool.dataset import DatasetError
from sfttool.dataset.data_path import data_source, load_data_path

ROWS = [{"conversation": [{"input": f"q{i}", "output": f"a{i}"}]} for i in range(3)]


def _jsonl(path, rows=ROWS):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _inputs(dataset) -> list[str]:
    return [row["conversation"][0]["input"] for row in dataset["train"]]


def test_a_local_jsonl_file_loads(tmp_path):
    path = _jsonl(tmp_path / "data.jsonl")
    assert data_source(str(path)) == {"path": "json", "data_files": [str(path)]}
    assert _inputs(load_data_path(str(path))) == ["q0", "q1", "q2"]


def test_csv_and_parquet_files_load(tmp_path):
    import datasets
    table = datasets.Dataset.from_dict({"instruction": ["a", "b"], "output": ["x", "y"]})
    table.to_csv(str(tmp_path / "d.csv"), index=False)
    table.to_parquet(str(tmp_path / "d.parquet"))
    for name, builder in (("d.csv", "csv"), ("d.parquet", "parquet")):
        assert data_source(str(tmp_path / name))["path"] == builder
        assert load_data_path(str(tmp_path / name))["train"]["output"] == ["x", "y"]


def test_a_folder_and_a_glob_read_every_data_file_in_order(tmp_path):
    _jsonl(tmp_path / "d" / "b.jsonl", ROWS[1:])
    _jsonl(tmp_path / "d" / "a.jsonl", ROWS[:1])
    (tmp_path / "d" / "README.md").write_text("not data")
    expected = [str(tmp_path / "d" / "a.jsonl"), str(tmp_path / "d" / "b.jsonl")]
    assert data_source(str(tmp_path / "d")) == {"path": "json", "data_files": expected}
    assert data_source(str(tmp_path / "d" / "*.jsonl")) == {"path": "json", "data_files": expected}
    assert _inputs(load_data_path(str(tmp_path / "d"))) == ["q0", "q1", "q2"]


def test_a_saved_dataset_folder_loads_from_disk(tmp_path):
    import datasets
    datasets.DatasetDict(train=datasets.Dataset.from_list(ROWS)).save_to_disk(str(tmp_path / "saved"))
    assert _inputs(load_data_path(str(tmp_path / "saved"))) == ["q0", "q1", "q2"]


def test_a_hub_name_is_passed_on(tmp_path, monkeypatch):
    assert data_source("tatsu-lab/alpaca") == {"path": "tatsu-lab/alpaca"}
    # A missing subfolder of a folder that is here is local, not a hub name.
    (tmp_path / "data").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DatasetError, match=r"^data_path 'data/train': no such file or folder"):
        data_source("data/train")


@pytest.mark.parametrize("path, problem", [("/no/such/data.jsonl", "no such file or folder"),
                                           ("./missing", "no such file or folder"),
                                           ("/no/such/*.jsonl", "no file matches this pattern")])
def test_a_missing_local_path_names_data_path(path, problem):
    with pytest.raises(DatasetError, match=rf"^data_path '{path.replace('*', '[*]')}': {problem}; set data_path "
                                           r"\(PART 1 of the config\)"):
        data_source(path)


def test_files_of_different_kinds_are_refused(tmp_path):
    _jsonl(tmp_path / "d" / "a.jsonl")
    (tmp_path / "d" / "b.csv").write_text("a,b\n1,2\n")
    with pytest.raises(DatasetError, match=r"expected files of one kind .* found a\.jsonl, b\.csv"):
        data_source(str(tmp_path / "d"))


def test_a_malformed_json_line_is_named_before_arrow_reads_it(tmp_path):
    from sfttool.dataset.resolve import json_source_files, resolve_dataset
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n{not json\n")
    config = dict(type=load_data_path, path=str(path))
    assert json_source_files(config) == [str(path)]   # what the pipeline and check-custom-dataset check
    with pytest.raises(DatasetError, match=rf"{path}, line 2: invalid JSON"):
        resolve_dataset(config, "train")
