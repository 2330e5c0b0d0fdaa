"""What mixing ``data_sources`` costs after encoding: the mix (sample indices) and the packing of the mixed
samples, against packing the same number of samples of one source.

Two synthetic encoded sources (sample lengths drawn uniformly from 20 to 400 tokens, seeded) are mixed by
concat (ratios 1 and 1.5) and by interleave (0.5 / 0.5, and round-robin), then packed best-fit-decreasing
at ``--max-length``; the baseline packs the concatenated samples as ``process_hf_dataset`` packs one
dataset's. Encoding is left out: it is the same per source as for one dataset.

    python benchmarks/mix_sources.py --samples 500000 --out benchmarks/results/mix_sources.json
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from sfttool.dataset.data_sources import mixed_counts, pack_sources
from sfttool.dataset.mix import mix_indices, unified_table
from sfttool.dataset.pipeline import SOURCE_COLUMN, finish_rows
from sfttool.dataset.report import PipelineReport

MIXES = [("concat", None, [1.0, 1.5]), ("interleave", [0.5, 0.5], [1.0, 1.0]), ("interleave", None, [1.0, 1.0])]


def encoded_source(samples: int, index: int) -> pa.Table:
    """An encoded source as ``sample_table`` leaves it: token lists, lengths, trained counts, source index."""
    lengths = np.random.default_rng(index).integers(20, 401, samples)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    tokens = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)),
                                      pa.array((np.arange(offsets[-1]) % 500).astype(np.int32)))
    counts = pa.array(lengths.astype(np.int32))
    return pa.table({"input_ids": tokens, "labels": tokens, "length": counts, "num_trained": counts,
                     SOURCE_COLUMN: pa.array(np.full(samples, index, dtype=np.int32))})


def timed(fn, *args):
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=500_000, help="samples per source")
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    sources = [encoded_source(args.samples, i) for i in range(2)]
    unified = unified_table(sources)
    _, baseline_s = timed(finish_rows, unified, True, args.max_length, "bfd", True, 0, PipelineReport())
    runs = []
    for strategy, probabilities, ratios in MIXES:
        samples, mix_s = timed(mix_indices, [len(s) for s in sources], strategy, ratios, probabilities,
                               "first_exhausted", 0)
        mixed_counts(unified, samples)
        report = PipelineReport()
        packed, pack_s = timed(pack_sources, unified, samples, False, True, args.max_length, "bfd", True, 0, report)
        runs.append(dict(strategy=strategy, probabilities=probabilities, ratios=ratios, samples=int(len(samples)),
                         mix_s=round(mix_s, 3), pack_s=round(pack_s, 3), rows=len(packed),
                         packing_efficiency=round(report.pack.efficiency, 4)))
    result = dict(meta=dict(samples_per_source=args.samples, max_length=args.max_length,
                            tokens=int(sum(int(s["length"].to_numpy().sum()) for s in sources))),
                  baseline=dict(samples=len(unified), pack_s=round(baseline_s, 3)), mixes=runs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
