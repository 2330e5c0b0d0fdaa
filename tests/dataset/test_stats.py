"""One count of a built dataset, for the dataset-info hook and process-dataset's manifest."""
from __future__ import annotations

from datasets import Dataset

from sfttool.dataset.stats import dataset_stats

PACKED = {
    "input_ids": [[1, 2, 3, 4], [5, 6], [7, 8, 9]],
    "labels": [[-100, 2, -100, 4], [-100, 6], [7, 8, 9]],
    "position_ids": [[0, 1, 0, 1], [0, 1], [0, 1, 2]],
    "sample_lengths": [[2, 2], [2], [3]],
}


def test_packed_rows_are_counted_exactly():
    rows = Dataset.from_dict(PACKED)
    assert dataset_stats(rows) == {"rows": 3, "samples": 4, "tokens": 9, "trained_tokens": 6,
                                   "max_length": 4, "packing_efficiency": 9 / 12}
    # With the config's max_length, the efficiency is the pipeline's: tokens / (rows x max_length).
    assert dataset_stats(rows, 8)["packing_efficiency"] == 9 / 24


def test_the_count_does_not_depend_on_the_batch_or_the_dataset_kind():
    """Arrow batches of any size and a plain map-style dataset read row by row give the same counts."""
    whole = dataset_stats(Dataset.from_dict(PACKED), 8)
    assert dataset_stats(Dataset.from_dict(PACKED), 8, batch_size=1) == whole
    rows = [dict(zip(PACKED, values)) for values in zip(*PACKED.values())]
    assert dataset_stats(rows, 8, batch_size=2) == whole


def test_unpacked_rows_are_one_sample_each_and_an_empty_set_has_no_efficiency():
    rows = Dataset.from_dict({"input_ids": [[1, 2], [3]], "labels": [[-100, 2], [3]]})
    assert dataset_stats(rows)["samples"] == 2
    empty = Dataset.from_dict({"input_ids": [], "labels": []})
    assert dataset_stats(empty) == {"rows": 0, "samples": 0, "tokens": 0, "trained_tokens": 0,
                                    "max_length": 0, "packing_efficiency": None}
