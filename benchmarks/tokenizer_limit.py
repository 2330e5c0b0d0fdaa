"""The data pipeline against the tokenizer's limit: what fraction of the raw
fast-tokenizer throughput does JSON -> packed rows reach?

For one JSONL file of generated conversations (``pipeline.conversations``), in
one run and on the exact texts the pipeline tokenizes (every templated turn's
input and output, ``template_map_fn_factory('qwen_chat')``; with
``--template hf_chat_template``, each conversation rendered whole by the
tokenizer's chat template):

- **limit**: the Rust tokenizer's batch encode of those texts
  (``encode_batch_fast``, its own threads on every allowed core), tokens/s;
- **pipeline**: ``process_hf_dataset`` (map-style) and ``StreamingPackedDataset``
  (one pass), packed and unpacked, default settings, from the JSON file to
  the last packed row, tokens/s and the fraction of the limit;
- the same per CPU second (the process's threads and its map processes), the
  figure that holds on a loaded machine, where wall-clock time does not;
- the tokenizer calls' share of each pipeline run's CPU time, measured in the
  same process (``tokenizer_cpu_share``).

Each measurement runs in a fresh process pinned to 1, 2, ... cores
(``os.sched_setaffinity``), with fresh caches, so nothing is reused.

    python benchmarks/tokenizer_limit.py --rows 5000 --cores 1,2
    python benchmarks/tokenizer_limit.py --rows 2000 --cores 1 --template hf_chat_template
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
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

CASES = ("limit", "map_packed", "map_unpacked", "stream_packed", "stream_unpacked")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=5000)
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--cores", default=None, help="core counts to pin to (default: 1, 2, all)")
    p.add_argument("--template", default="qwen_chat", help="a PROMPT_TEMPLATE name (default qwen_chat), e.g. "
                   "hf_chat_template: the tokenizer's own chat template")
    p.add_argument("--out", type=Path, default=HERE / "results" / "tokenizer_limit.json")
    return p.parse_args(argv)


def texts_to_tokenize(data_file: str, tok, template: str) -> list[str]:
    """Every string the encoder tokenizes: each templated turn's input and output, or in chat-template
    mode each conversation's whole render."""
    from sfttool.dataset.conversation import to_messages
    from sfttool.dataset.map_fns import template_map_fn_factory

    template_map_fn = template_map_fn_factory(template)
    texts = []
    with open(data_file, encoding="utf-8") as f:
        for line in f:
            conversation = template_map_fn(json.loads(line))["conversation"]
            if template == "hf_chat_template":
                texts.append(tok.apply_chat_template(to_messages(conversation), tokenize=False))
                continue
            for turn in conversation:
                texts += [turn.get("input") or "", turn.get("output") or ""]
    return [t for t in texts if t]


def run_limit(tok, texts: list[str]) -> int:
    backend = tok.backend_tokenizer
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
    return sum(len(e.ids) for e in encode(texts, add_special_tokens=False))


def run_map(tok, data_file: str, max_length: int, packed: bool, template: str) -> int:
    from datasets import load_dataset

    from sfttool.dataset import process_hf_dataset
    from sfttool.dataset.map_fns import template_map_fn_factory

    out = process_hf_dataset(dataset=dict(type=load_dataset, path="json", data_files=data_file), tokenizer=tok,
                             max_length=max_length, template_map_fn=template_map_fn_factory(template),
                             pack_to_max_length=packed, seed=0)
    return int(sum(len(ids) for ids in out["input_ids"]))


def run_stream(tok, data_file: str, max_length: int, packed: bool, template: str) -> int:
    from datasets import load_dataset

    from sfttool.dataset.map_fns import template_map_fn_factory
    from sfttool.dataset.streaming import StreamingPackedDataset

    stream = StreamingPackedDataset(dataset=dict(type=load_dataset, path="json", data_files=data_file, split="train",
                                                 streaming=True),
                                    tokenizer=tok, max_length=max_length,
                                    template_map_fn=template_map_fn_factory(template), pack_to_max_length=packed)
    return sum(len(row["input_ids"]) for row in stream)


def measure(case: str, cores: int, tok_dir: str, data_file: str, max_length: int, template: str = "qwen_chat") -> dict:
    """One case in this (fresh, spawned) process, pinned to the first ``cores`` cores."""
    os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:cores]))
    cache = tempfile.mkdtemp(prefix="tokenizer-limit-")
    os.environ.update(HF_DATASETS_CACHE=os.path.join(cache, "datasets"), SFTTOOL_CACHE=os.path.join(cache, "sft"))
    import datasets  # noqa: F401  imported before the clock: a training process has them loaded already
    from transformers import AutoTokenizer

    import sfttool.dataset.streaming  # noqa: F401

    tok = AutoTokenizer.from_pretrained(tok_dir)
    kind, _, layout = case.partition("_")
    texts = texts_to_tokenize(data_file, tok, template) if kind == "limit" else None  # the tokenizer alone
    tokenizer_cpu = _time_tokenizer_calls()
    start, cpu_start = time.perf_counter(), _cpu_seconds()
    if kind == "limit":
        tokens = run_limit(tok, texts)
    elif kind == "map":
        tokens = run_map(tok, data_file, max_length, layout == "packed", template)
    else:
        tokens = run_stream(tok, data_file, max_length, layout == "packed", template)
    seconds = time.perf_counter() - start
    cpu = max(_cpu_seconds() - cpu_start, 0.01)  # the clock's tick: a tiny run may read 0
    share = {} if kind == "limit" else {"tokenizer_cpu_share": round(tokenizer_cpu[0] / cpu, 3)}
    return {"case": case, "cores": cores, "seconds": round(seconds, 2), "cpu_seconds": round(cpu, 2),
            "tokens": tokens, "tokens_per_s": round(tokens / seconds), "tokens_per_cpu_s": round(tokens / cpu),
            **share}


def _time_tokenizer_calls() -> list[float]:
    """Count the CPU time of the pipeline's tokenizer calls (``encode.batch_token_ids``): their share of the
    run's CPU, measured in the same process and so stretched alike by the machine's load, is the fraction
    that single runs of the limit and the pipeline, seconds apart, estimate with more noise. Map processes
    would not be counted (one process at these sizes)."""
    from sfttool.dataset import encode
    spent, inner = [0.0], encode.batch_token_ids

    def timed(*args, **kwargs):
        start = _cpu_seconds()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[0] += _cpu_seconds() - start
    encode.batch_token_ids = timed
    return spent


def _cpu_seconds() -> float:
    """CPU time of this process (all its threads: the tokenizer's too) and of its ended children (map
    processes): on a shared machine, the part of the work that other jobs' load does not stretch."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def in_child(*args) -> dict:
    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(measure, args)


def main(argv=None) -> int:
    args = parse_args(argv)
    available = len(os.sched_getaffinity(0))
    cores = [int(c) for c in args.cores.split(",")] if args.cores else sorted({1, min(2, available), available})
    tok_dir, tok_name = tokenizer_dir()
    data_file = str(Path(tempfile.mkdtemp()) / "rows.jsonl")
    with open(data_file, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in conversations(args.rows, seed=0))
    results = []
    print(f"{'cores':>5} {'case':16} {'seconds':>8} {'tokens/s':>10} {'of limit':>8} {'cpu s':>7} {'of limit':>8} "
          f"{'tokenizer':>9}")
    for n in cores:
        limit = None
        for case in CASES:
            r = in_child(case, n, tok_dir, data_file, args.max_length, args.template)
            limit = limit or r
            r["fraction_of_limit"] = round(r["tokens_per_s"] / limit["tokens_per_s"], 3)
            r["cpu_fraction_of_limit"] = round(r["tokens_per_cpu_s"] / limit["tokens_per_cpu_s"], 3)
            results.append(r)
            print(f"{n:5} {case:16} {r['seconds']:8.2f} {r['tokens_per_s']:10} {r['fraction_of_limit']:8.1%} "
                  f"{r['cpu_seconds']:7.2f} {r['cpu_fraction_of_limit']:8.1%} "
                  f"{r.get('tokenizer_cpu_share', 1.0):9.1%}", flush=True)
    write_report(args.out, "tokenizer_limit", rows=args.rows, max_length=args.max_length, tokenizer=tok_name,
                 template=args.template,
                 load_average=[round(x, 2) for x in os.getloadavg()], results=results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
