"""`process-dataset --ray` against the local command on the same data: throughput per worker.

One JSONL file of generated conversations (``pipeline.conversations``), one config (qwen_chat template,
packing to ``--max-length``), and:

- **tokenizer alone**: the Rust tokenizer's batch encode of the exact texts the pipeline tokenizes
  (``tokenizer_limit.run_limit``), in batches of 1000 texts as the pipeline's ``map`` sends them, pinned
  to 1 core: the limit one worker can reach;
- **local process-dataset**: ``process_dataset`` in one process (one shard), pinned to 1 core;
- **ray, N workers**: ``ray_process_dataset`` on a local Ray of N worker CPUs, blocks of ``--shard-rows``
  raw rows; run twice, the first starting the worker processes (imports), the second on warm workers.

For each: wall-clock seconds, tokens/s, and per worker: tokens per second of a worker's time in the
tasks (read + pipeline + write, summed over the tasks: ``manifest['ray']``) and per CPU second of the
workers (``cpu_seconds``), each as a fraction of the tokenizer alone's. On a machine of few cores shared
with other jobs the wall-clock speed-up says little; the per-CPU-second figures hold best.

    python benchmarks/ray_process.py --rows 20000 --workers 1,2
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from pipeline import conversations, tokenizer_dir  # noqa: E402  (the same generated rows and tokenizer)
from report import write_report  # noqa: E402
from tokenizer_limit import run_limit, texts_to_tokenize  # noqa: E402

CONFIG = '''
from datasets import load_dataset
from transformers import AutoTokenizer
from sfttool.dataset import process_hf_dataset
from sfttool.dataset.map_fns import template_map_fn_factory
from sfttool.utils import PROMPT_TEMPLATE

tokenizer = dict(type=AutoTokenizer.from_pretrained, pretrained_model_name_or_path={tok!r})
train_dataset = dict(type=process_hf_dataset, dataset=dict(type=load_dataset, path='json', data_files={data!r}),
                     tokenizer=tokenizer, max_length={max_length}, pack_to_max_length=True, seed=0,
                     template_map_fn=dict(type=template_map_fn_factory, template=PROMPT_TEMPLATE.qwen_chat))
train_dataloader = dict(batch_size=1, dataset=train_dataset)
'''


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=20000)
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--workers", default="1,2", help="Ray worker CPU counts to run with")
    p.add_argument("--shard-rows", type=int, default=None, help="rows per block (default: rows / 4)")
    p.add_argument("--out", type=Path, default=HERE / "results" / "ray_process.json")
    return p.parse_args(argv)


def limit_run(tok_dir: str, data_file: str) -> dict:
    """The tokenizer alone on the pipeline's texts, 1000 at a time, in this (spawned) process on 1 core."""
    os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:1]))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    texts = texts_to_tokenize(data_file, tok, "qwen_chat")
    start, cpu = time.perf_counter(), time.process_time()
    tokens = sum(run_limit(tok, texts[i:i + 1000]) for i in range(0, len(texts), 1000))
    return {"seconds": time.perf_counter() - start, "cpu_seconds": time.process_time() - cpu, "tokens": tokens}


def local_run(cfg_path: str, out: str) -> dict:
    """``process_dataset`` in this (spawned) process, pinned to 1 core."""
    os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:1]))
    from sfttool.config import load_config
    from sfttool.tools.process_dataset import process_dataset

    cfg = load_config(cfg_path)
    start, cpu = time.perf_counter(), time.process_time()
    manifest = process_dataset(cfg, out, num_proc=1)
    return {"seconds": time.perf_counter() - start, "cpu_seconds": time.process_time() - cpu,
            "tokens": manifest["tokens"], "packing_efficiency": manifest["packing_efficiency"]}


def ray_runs(cfg_path: str, out: str, workers: int, shard_rows: int) -> list[dict]:
    """Two runs on a fresh local Ray of ``workers`` CPUs: cold (worker processes start) and warm."""
    import ray

    from sfttool.config import load_config
    from sfttool.tools.process_ray import ray_process_dataset

    cfg = load_config(cfg_path)
    ray.init(num_cpus=workers, object_store_memory=200 * 1024 ** 2, include_dashboard=False, log_to_driver=False,
             logging_level="ERROR", runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "RAYON_NUM_THREADS": "1"}})
    runs = []
    try:
        for run in ("cold", "warm"):
            start = time.perf_counter()
            manifest = ray_process_dataset(cfg, out, overwrite=True, shard_rows=shard_rows)
            figures = manifest["ray"]
            worker_seconds = figures["read_seconds"] + figures["pipeline_seconds"] + figures["write_seconds"]
            runs.append({"run": run, "workers": workers, "seconds": time.perf_counter() - start,
                         "tokens": manifest["tokens"], "worker_seconds": worker_seconds,
                         "cpu_seconds": figures["cpu_seconds"],
                         "blocks": figures["blocks"], "packing_efficiency": manifest["packing_efficiency"]})
    finally:
        ray.shutdown()
    return runs


def spawned(fn, *args):
    import multiprocessing as mp
    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


def main(argv=None) -> int:
    args = parse_args(argv)
    tok_dir, tok_name = tokenizer_dir()
    folder = Path(tempfile.mkdtemp(prefix="ray-process-"))
    data_file = folder / "rows.jsonl"
    data_file.write_text("".join(json.dumps(r) + "\n" for r in conversations(args.rows, seed=0)))
    cfg_path = folder / "cfg.py"
    cfg_path.write_text(CONFIG.format(tok=tok_dir, data=str(data_file), max_length=args.max_length))
    shard_rows = args.shard_rows or max(1, args.rows // 4)

    limit = _rates(spawned(limit_run, tok_dir, str(data_file)), None)
    results = [{"case": "tokenizer alone (1 core)", "workers": 1, **limit}]
    local = spawned(local_run, str(cfg_path), str(folder / "local"))
    results.append({"case": "local process-dataset (1 core)", "workers": 1, **_rates(local, local["seconds"])})
    for workers in (int(w) for w in args.workers.split(",")):
        for run in spawned(ray_runs, str(cfg_path), str(folder / "ray"), workers, shard_rows):
            results.append({"case": f"ray, {workers} worker(s), {run['run']}", "workers": workers,
                            "blocks": run["blocks"], **_rates(run, run["worker_seconds"])})
    for r in results:
        r["fraction_of_limit"] = round(r["tokens_per_worker_s"] / limit["tokens_per_worker_s"], 3)
        r["cpu_fraction_of_limit"] = round(r["tokens_per_cpu_s"] / limit["tokens_per_cpu_s"], 3)
    print(f"{'case':34} {'seconds':>8} {'tokens/s':>9} {'per worker-s':>12} {'of limit':>8} {'per cpu-s':>9} "
          f"{'of limit':>8} {'packing':>8}")
    for r in results:
        packing = f"{r['packing_efficiency']:.2%}" if "packing_efficiency" in r else ""
        print(f"{r['case']:34} {r['seconds']:8.2f} {r['tokens_per_s']:9} {r['tokens_per_worker_s']:12} "
              f"{r['fraction_of_limit']:8.1%} {r['tokens_per_cpu_s']:9} {r['cpu_fraction_of_limit']:8.1%} {packing:>8}")
    shutil.rmtree(folder, ignore_errors=True)
    write_report(args.out, "ray_process", rows=args.rows, max_length=args.max_length, shard_rows=shard_rows,
                 tokenizer=tok_name, load_average=[round(x, 2) for x in os.getloadavg()], results=results)
    return 0


def _rates(run: dict, worker_seconds: float | None) -> dict:
    """Tokens per second of wall-clock, of worker time (default: wall-clock) and of CPU time."""
    rates = {"seconds": round(run["seconds"], 2), "tokens": run["tokens"],
             "tokens_per_s": round(run["tokens"] / run["seconds"]),
             "tokens_per_worker_s": round(run["tokens"] / (worker_seconds or run["seconds"])),
             "tokens_per_cpu_s": round(run["tokens"] / max(run["cpu_seconds"], 0.01))}
    return {**rates, "packing_efficiency": run["packing_efficiency"]} if "packing_efficiency" in run else rates


if __name__ == "__main__":
    sys.exit(main())
