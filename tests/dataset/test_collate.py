"""default_collate_fn: right padding as its own pseudo-sequence, no attention mask."""
from __future__ import annotations

import torch

from sfttool.dataset.collate_fns import default_collate_fn


ROWS = [{"input_ids": [5, 6, 7, 8], "labels": [-100, 6, 7, 8], "position_ids": [0, 1, 0, 1],
         "sample_lengths": [2, 2]},
        {"input_ids": [9, 10], "labels": [9, -100], "position_ids": [0, 1], "sample_lengths": [2]}]


def test_padding_and_positions():
    out = default_collate_fn(ROWS, pad_index=0)
    assert out["data_samples"] is None
    data = out["data"]
    assert set(data) == {"input_ids", "labels", "position_ids"}
    assert data["input_ids"].tolist() == [[5, 6, 7, 8], [9, 10, 0, 0]]
    assert data["labels"].tolist() == [[-100, 6, 7, 8], [9, -100, -100, -100]]
    assert data["position_ids"].tolist() == [[0, 1, 0, 1], [0, 1, 0, 1]]
    assert all(t.dtype == torch.long for t in data.values())


def test_hf_format_and_pad_index():
    data = default_collate_fn(ROWS, pad_index=2, return_hf_format=True)
    assert data["input_ids"][1].tolist() == [9, 10, 2, 2]


def test_rows_without_position_ids_are_one_sample():
    data = default_collate_fn([{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}, {"input_ids": [4], "labels": [4]}],
                              return_hf_format=True)
    assert data["position_ids"].tolist() == [[0, 1, 2], [0, 0, 1]]


def test_varlen_cumulative_lengths():
    data = default_collate_fn(ROWS, use_varlen_attn=True, return_hf_format=True)
    assert [c.tolist() for c in data["cumulative_len"]] == [[0, 2, 4], [0, 2, 4]]
    assert data["max_seqlen"] == 2
    assert all(c.dtype == torch.int32 for c in data["cumulative_len"])


def test_registered_name_resolves():
    from sfttool.registry import resolve_type
    assert resolve_type("default_collate_fn") is default_collate_fn
