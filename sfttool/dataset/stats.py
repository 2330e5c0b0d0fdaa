"""What a built dataset holds: rows, samples, tokens, trained tokens and packing efficiency, counted
one Arrow batch at a time (memory stays at one batch). The one count the dataset-info hook logs
before training and ``process-dataset`` writes into its manifest.
"""
from __future__ import annotations

from typing import Any, Iterator

from sfttool.dataset.pack import packing_efficiency
from sfttool.utils.constants import IGNORE_INDEX

COUNTED_COLUMNS = ("input_ids", "labels", "sample_lengths")


def dataset_stats(dataset: Any, max_length: int | None = None, batch_size: int = 10_000) -> dict:
    """``{'rows', 'samples', 'tokens', 'trained_tokens', 'max_length', 'packing_efficiency'}``.

    ``samples`` counts ``sample_lengths`` entries (a row of an unpacked dataset is one sample);
    ``max_length`` is the given one, else the longest row; ``packing_efficiency`` is
    ``pack.packing_efficiency`` of that length (None without rows).

    >>> from datasets import Dataset
    >>> dataset_stats(Dataset.from_dict({'input_ids': [[1, 2, 3], [4]], 'labels': [[-100, 2, 3], [4]]}), 4)
    {'rows': 2, 'samples': 2, 'tokens': 4, 'trained_tokens': 3, 'max_length': 4, 'packing_efficiency': 0.5}
    """
    import pyarrow.compute as pc

    rows = samples = tokens = trained = longest = 0
    for table in _tables(dataset, batch_size):
        lengths = pc.list_value_length(table["input_ids"])
        rows += table.num_rows
        tokens += pc.sum(lengths).as_py() or 0
        longest = max(longest, pc.max(lengths).as_py() or 0)
        if "sample_lengths" in table.column_names:
            samples += pc.sum(pc.list_value_length(table["sample_lengths"])).as_py() or 0
        else:
            samples += table.num_rows
        if "labels" in table.column_names:
            labels = pc.list_flatten(table["labels"])
            trained += pc.sum(pc.not_equal(labels, IGNORE_INDEX).cast("int64")).as_py() or 0
    max_length = max_length or longest
    return {"rows": rows, "samples": samples, "tokens": tokens, "trained_tokens": trained,
            "max_length": max_length, "packing_efficiency": packing_efficiency(tokens, rows, max_length)}


def _tables(dataset: Any, batch_size: int) -> Iterator[Any]:
    """The counted columns as Arrow tables of at most ``batch_size`` rows: straight from a
    ``datasets.Dataset``, else read row by row (a custom map-style dataset)."""
    import pyarrow as pa

    names = getattr(dataset, "column_names", None)
    if names is not None and hasattr(dataset, "with_format"):
        kept = dataset.select_columns([c for c in COUNTED_COLUMNS if c in names])
        yield from kept.with_format("arrow").iter(batch_size=batch_size)
        return
    for start in range(0, len(dataset), batch_size):
        rows = [dataset[i] for i in range(start, min(start + batch_size, len(dataset)))]
        yield pa.table({c: [row[c] for row in rows] for c in COUNTED_COLUMNS if c in rows[0]})
