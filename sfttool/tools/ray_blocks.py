"""The blocks ``process-dataset --ray`` cuts the raw rows into, and how a Ray worker reads one.

The driver reads no row: it lists where each row starts (a JSON Lines file's line offsets, a Parquet
file's row counts) and cuts the rows, numbered across the files in order as ``number_rows`` numbers
them, into contiguous blocks, as the local command cuts its shards (``datasets``' contiguous
``shard``), after the same ``max_dataset_length`` subset (``rows.subset_indices``). A block names
the files' byte or row ranges it spans, so a worker reads only its own rows::

    >>> blocks = plan_blocks('json', ['a.jsonl'], shard_rows=2, seed=0)   # 5 rows  # doctest: +SKIP
    >>> [(b['index'], b['first_row'], b['rows']) for b in blocks]          # doctest: +SKIP
    [(0, 0, 2), (1, 2, 2), (2, 4, 1)]
"""
from __future__ import annotations

from array import array
from pathlib import Path

import numpy as np

from sfttool.dataset.data_path import data_source
from sfttool.dataset.errors import ROW_COLUMN, DatasetError
from sfttool.dataset.load import expand_data_files
from sfttool.dataset.rows import subset_indices
from sfttool.dataset.resolve import rows_config
from sfttool.registry import type_name

_BOM = b"\xef\xbb\xbf"


def contiguous_bounds(rows: int, shards: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of each of ``shards`` contiguous parts, as ``datasets.Dataset.shard(contiguous=True)``
    cuts them (the first ``rows % shards`` parts one row longer).

    >>> contiguous_bounds(7, 3)
    [(0, 3), (3, 5), (5, 7)]
    """
    div, mod = divmod(rows, shards)
    bounds, start = [], 0
    for i in range(shards):
        stop = start + div + (i < mod)
        bounds.append((start, stop))
        start = stop
    return bounds


def row_offsets(kind: str, path: str) -> np.ndarray:
    """Where each row of a file starts and, last, where the file ends: byte offsets of its non-blank
    lines (JSON Lines), or row indices (Parquet)."""
    if kind == "parquet":
        import pyarrow.parquet as pq
        return np.arange(pq.ParquetFile(path).metadata.num_rows + 1, dtype=np.int64)
    offsets, position = array("q"), 0
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                offsets.append(position)
            position += len(line)
    offsets.append(position)
    return np.frombuffer(offsets, dtype=np.int64)


def plan_blocks(kind: str, files: list[str], shard_rows: int, seed: int,
                max_dataset_length: int | None = None) -> tuple[list[dict], int]:
    """The blocks of ``shard_rows`` rows (after the subset), each ``{index, first_row, rows, segments,
    keep}``: ``segments`` the ``(path, start, stop)`` ranges it reads (bytes, or Parquet rows), ``keep``
    the row numbers of the subset in it (None: all). Returns ``(blocks, rows in the files)``."""
    offsets = [row_offsets(kind, path) for path in files]
    counts = [len(o) - 1 for o in offsets]
    firsts = np.cumsum([0] + counts)  # the number of each file's first row
    total = int(firsts[-1])
    if total == 0:
        raise DatasetError(f"{', '.join(files)}: the files hold no rows")
    keep = subset_indices(total, max_dataset_length, seed)
    used = total if keep is None else len(keep)
    blocks = []
    for index, (start, stop) in enumerate(contiguous_bounds(used, max(1, -(-used // shard_rows)))):
        first, last = (start, stop) if keep is None else (int(keep[start]), int(keep[stop - 1]) + 1)
        blocks.append({"index": index, "first_row": first, "rows": stop - start,
                       "segments": _segments(files, offsets, firsts, first, last),
                       "keep": None if keep is None else keep[start:stop].tolist()})
    return blocks, total


def _segments(files: list[str], offsets: list[np.ndarray], firsts: np.ndarray, first: int, last: int) -> list:
    """The ``(path, start, stop)`` pieces of the files that hold rows ``first`` to ``last - 1``."""
    segments = []
    for path, file_offsets, file_first in zip(files, offsets, firsts):
        lo, hi = max(first - file_first, 0), min(last - file_first, len(file_offsets) - 1)
        if lo < hi:
            segments.append((path, int(file_offsets[lo]), int(file_offsets[hi])))
    return segments


def read_block(kind: str, block: dict):
    """A block's rows as one Arrow table, numbered (``ROW_COLUMN``) as loaded; only the subset's rows."""
    import pyarrow as pa
    tables = [_read_segment(kind, path, start, stop) for path, start, stop in block["segments"]]
    table = tables[0] if len(tables) == 1 else pa.concat_tables(tables, promote_options="permissive")
    numbers = np.arange(block["first_row"], block["first_row"] + len(table))
    if block["keep"] is not None:
        rows = np.asarray(block["keep"]) - block["first_row"]
        table, numbers = table.take(rows), numbers[rows]
    return table.append_column(ROW_COLUMN, pa.array(numbers, pa.int64()))


def _read_segment(kind: str, path: str, start: int, stop: int):
    if kind == "parquet":
        return _parquet_rows(path, start, stop)
    import io

    import pyarrow.json as pj
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read(stop - start)
    # Arrow's JSON reader, as datasets reads JSON Lines; blank lines are skipped, as when counted.
    return pj.read_json(io.BytesIO(data.removeprefix(_BOM) if start == 0 else data),
                        read_options=pj.ReadOptions(block_size=max(1 << 20, len(data) + 1)))


def _parquet_rows(path: str, start: int, stop: int):
    """Rows ``start`` to ``stop - 1`` of a Parquet file, reading only the row groups that hold them."""
    import pyarrow.parquet as pq
    parquet = pq.ParquetFile(path)
    groups, first, group_start = [], None, 0
    for g in range(parquet.metadata.num_row_groups):
        group_stop = group_start + parquet.metadata.row_group(g).num_rows
        if group_start < stop and group_stop > start:
            groups.append(g)
            first = group_start if first is None else first
        group_start = group_stop
    return parquet.read_row_groups(groups).slice(start - first, stop - start)


def input_files(dataset_cfg, key: str = "train_dataloader.dataset.dataset") -> tuple[str, list[str]]:
    """``('json' | 'parquet', files)``: the local JSON Lines or Parquet files a dataset config loads
    (``load_data_path``, or ``load_dataset('json' | 'parquet', data_files=...)``), which Ray workers
    read block by block; anything else is an error saying what ``--ray`` reads."""
    cfg = rows_config(dataset_cfg)
    name = type_name(cfg.get("type")) if isinstance(cfg, dict) else None
    source = data_source(cfg.get("path")) if name == "load_data_path" else cfg if name == "load_dataset" else {}
    kind = {"jsonl": "json"}.get(source.get("path"), source.get("path"))
    files = expand_data_files(source.get("data_files")) if kind in ("json", "parquet") else []
    if rows_config(dataset_cfg) is not dataset_cfg or not files or not all(Path(f).is_file() for f in files):
        raise DatasetError(f"{key}: --ray reads local JSON Lines or Parquet files (load_data_path, or "
                           "load_dataset('json' | 'parquet', data_files=...)); run without --ray for this dataset")
    compressed = [f for f in files if not f.lower().endswith((".json", ".jsonl", ".parquet"))]
    if compressed:
        raise DatasetError(f"{compressed[0]}: --ray reads uncompressed .jsonl/.json and .parquet files; "
                           "decompress it or run without --ray")
    if kind == "json":
        for path in files:
            _require_json_lines(path)
    return kind, files


def _require_json_lines(path: str) -> None:
    with open(path, "rb") as f:
        head = f.read(4096).removeprefix(_BOM).lstrip()
    if head.startswith(b"["):
        raise DatasetError(f"{path}: a JSON array; --ray reads JSON Lines (one object per line): convert it "
                           "(e.g. jq -c '.[]') or run without --ray")
