"""validation_split: a seeded share of the raw rows, none in both parts, or a separate file."""
from __future__ import annotations

import json

import pytest
from datasets import Dataset, DatasetDict

from sfttool.dataset.errors import DatasetError
from sfttool.dataset.split import held_out_count, validation_split


def rows(n: int) -> DatasetDict:
    return DatasetDict(train=Dataset.from_dict({"id": list(range(n))}))


def ids(dataset) -> list[int]:
    return list(dataset["id"])


def test_the_parts_cover_every_row_once_in_file_order():
    train = validation_split(rows(100), "train", val_ratio=0.05, seed=1)
    val = validation_split(rows(100), "val", val_ratio=0.05, seed=1)
    assert len(val) == 5 and len(train) == 95
    assert sorted(ids(train) + ids(val)) == list(range(100))
    assert ids(val) == sorted(ids(val)) and ids(train) == sorted(ids(train))
    assert list(val["_sfttool_row"]) == ids(val)  # errors name the row's place in the loaded data


def test_the_split_follows_the_seed():
    assert ids(validation_split(rows(100), "val", val_ratio=0.1, seed=1)) == \
        ids(validation_split(rows(100), "val", val_ratio=0.1, seed=1))
    assert ids(validation_split(rows(100), "val", val_ratio=0.1, seed=1)) != \
        ids(validation_split(rows(100), "val", val_ratio=0.1, seed=2))


def test_counts_round_with_at_least_one_row_and_the_cap():
    assert held_out_count(820, 0.05) == 41
    assert held_out_count(10, 0.01) == 1
    assert held_out_count(10_000, 0.05, max_val_rows=200) == 200
    assert len(validation_split(rows(1000), "val", val_ratio=0.5, max_val_rows=7)) == 7


def test_without_validation_the_train_part_is_every_row():
    assert ids(validation_split(rows(10), "train")) == list(range(10))
    assert ids(validation_split(rows(10), "train", val_ratio=0)) == list(range(10))


def test_val_data_path_wins_and_leaves_the_training_rows_whole(tmp_path):
    file = tmp_path / "val.jsonl"
    file.write_text("".join(json.dumps({"id": 100 + i}) + "\n" for i in range(3)))
    assert ids(validation_split(rows(10), "val", val_ratio=0.5, val_data_path=str(file))) == [100, 101, 102]
    assert ids(validation_split(rows(10), "train", val_ratio=0.5, val_data_path=str(file))) == list(range(10))


def test_val_data_path_takes_what_data_path_takes(tmp_path):
    folder = tmp_path / "val"
    folder.mkdir()
    (folder / "a.csv").write_text("id\n200\n201\n")
    (folder / "b.csv").write_text("id\n202\n")
    assert ids(validation_split(rows(10), "val", val_data_path=str(folder))) == [200, 201, 202]
    assert ids(validation_split(rows(10), "val", val_data_path=str(folder / "*.csv"))) == [200, 201, 202]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1}\n{broken\n')
    with pytest.raises(DatasetError, match=rf"{bad}, line 2: invalid JSON"):
        validation_split(rows(10), "val", val_data_path=str(bad))


@pytest.mark.parametrize("kwargs, message", [
    (dict(part="val"), "needs val_data_path or val_ratio"),
    (dict(part="test", val_ratio=0.1), "part must be one of train, val"),
    (dict(part="val", val_ratio=1.5), "val_ratio must be a number from 0"),
    (dict(part="val", val_ratio=0.1, max_val_rows=0), "max_val_rows must be a positive integer"),
    (dict(part="train", val_ratio=0.9), "leaves none to train on"),
    (dict(part="val", val_data_path="missing.jsonl"), "val_data_path 'missing.jsonl': no such file or folder"),
])
def test_bad_settings_are_one_line_errors(kwargs, message):
    with pytest.raises(DatasetError, match=message):
        validation_split(rows(2), **kwargs)
