"""The encode stage's batch as one Arrow table (packing keeps no input column but the row numbers): the
same columns as the numpy ones, and the same packed rows through the pipeline."""
from __future__ import annotations

import pytest
from datasets import Dataset

from sfttool import assets
from sfttool.dataset.errors import ROW_COLUMN
from sfttool.dataset.map_fns import template_map_fn_factory
from sfttool.dataset.pipeline import run_pipeline
from sfttool.dataset.encode import encode_batch_arrays

QWEN = template_map_fn_factory("qwen_chat")


def conversations():
    rows = assets.tiny_conversations(20, seed=4)
    rows.append({"conversation": [{"input": "q", "output": "a", "output_with_loss": False}]})
    rows.append({"conversation": [{"input": " ".join(["word"] * 80), "output": "cut."}]})
    return [QWEN(row)["conversation"] for row in rows]


@pytest.mark.parametrize("max_length", [1, 16, 64, 4096])
def test_the_table_holds_the_numpy_columns(tiny_tokenizer, max_length):
    batch = {"conversation": conversations(), ROW_COLUMN: list(range(7, 7 + len(conversations())))}
    table = encode_batch_arrays(batch, [], tiny_tokenizer, max_length, carry=[ROW_COLUMN])
    columns = encode_batch_arrays(batch, [], tiny_tokenizer, max_length)
    assert table.column_names == list(columns)
    assert table.to_pydict() == {name: [v.tolist() if hasattr(v, "tolist") else v for v in values]
                                 for name, values in columns.items()}
    assert str(table.schema.field("input_ids").type) == "list<item: int32>"


def test_an_empty_batch_is_an_empty_table(tiny_tokenizer):
    table = encode_batch_arrays({"conversation": [], ROW_COLUMN: []}, [], tiny_tokenizer, 8, carry=[ROW_COLUMN])
    assert table.num_rows == 0 and table.column_names[-1] == ROW_COLUMN


def test_columns_kept_beside_the_tokens_keep_the_dict(tiny_tokenizer):
    rows = [{"conversation": [{"input": "q", "output": f"a{i}"}], "id": i} for i in range(3)]
    out, _ = run_pipeline(Dataset.from_list(rows), tiny_tokenizer, 64, template_map_fn=QWEN, pack_to_max_length=False)
    assert out["id"] == [0, 1, 2]
