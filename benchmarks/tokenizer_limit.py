"""The data pipeline against the tokenizer's limit: what fraction of the raw
fast-tokenizer throughput does JSON -> packed rows reach?

For one JSONL file of generated conversations (``pipeline.conversations``), in
one run and on the exact texts the pipeline tokenizes (every templated turn's
input and output, ``template_map_fn_factory('qwen_chat')``; with
``--template hf_chat_template``, each conversation rendered whole by the
tokenizer's chat template):

- **limit**: the Rust tokenizer's batch encode of those texts
  (``encode_batch_fast``, its own threads on every allowed core, in the
  pipeline's slices of about a million characters), tokens/s;
- **pipeline**: ``process_hf_dataset`` (map-style) and ``StreamingPackedDataset``
  (one pass), packed and unpacked, default settings, from the JSON file to
  the last packed row, tokens/s and the fraction of the limit;
- the same per CPU second (the process's threads and its map processes), the
  figure that holds on a loaded machine, where wall-clock time does not;
- the tokenizer calls' share of each pipeline run's CPU time, measured in the
  same process (``tokenizer_cpu_share``; ``tokenizer_share_after_load`` of the
  CPU time after ``load_dataset``);
- ``load_dataset``'s own CPU time in each run (``load_cpu_seconds``: reading the
  file into Arrow, and its first use's imports), and the fraction of the limit
  by the CPU time of the pipeline's work after it (``cpu_fraction_after_load``).
  For the stream, whose reading happens as it is iterated, only the call counts;
- the same fraction against the limit measured in the pipeline case's own process, before and after
  its run (the mean rate; ``cpu_fraction_after_load_here``, column ``here``): both sides under the same
  load, where the limit's own process, a minute apart on a shared machine, may run 30 % faster or slower.

Any other encode entry point (a lazy dataset's reads, a worker's batches) is
measured the same way: ``--entry NAME=FILE.py:FUNCTION`` adds the cases
``NAME_packed`` and ``NAME_unpacked``, each ``FUNCTION(tokenizer, data_file,
max_length, packed, template)`` returning the tokens it produced; or, inside the
process that does the work, ``with CpuMeter() as meter: ...`` then
``meter.fractions(tokens, limit_tokens_per_cpu_s(tokenizer, texts))``.

Each measurement runs in a fresh process pinned to 1, 2, ... cores
(``os.sched_setaffinity``), with fresh caches, so nothing is reused.

    python benchmarks/tokenizer_limit.py --rows 5000 --cores 1,2
    python benchmarks/tokenizer_limit.py --rows 2000 --cores 1 --template hf_chat_template
    python benchmarks/tokenizer_limit.py --rows 2000 --cores 1 --entry lazy=my_bench.py:run_lazy
    python benchmarks/tokenizer_limit.py --rows 2000 --cores 1 --cases map_packed
    python benchmarks/tokenizer_limit.py --rows 2000 --alternate 10 --out results/tokenizer_limit_alternate.json
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import importlib.util
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

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
    p.add_argument("--entry", action="append", default=[], metavar="NAME=FILE.py:FUNCTION",
                   help="another encode entry point to measure: FUNCTION(tokenizer, data_file, max_length, packed, "
                        "template) -> tokens produced (FILE.py or an importable module); repeatable")
    p.add_argument("--cases", default=",".join(CASES), help=f"the cases to run, comma-separated (default: all: "
                   f"{', '.join(CASES)}); the limit always runs")
    p.add_argument("--alternate", type=int, default=0, metavar="N",
                   help="instead of the cases: in one process on one core, the limit and the map-style packed "
                        "pipeline in turn N times (warm), each pair's fraction and the medians")
    p.add_argument("--out", type=Path, default=HERE / "results" / "tokenizer_limit.json")
    args = p.parse_args(argv)
    args.cases = set(args.cases.split(",")) | {"limit"}
    unknown = sorted(args.cases - set(CASES))
    if unknown:
        p.error(f"--cases: unknown {', '.join(unknown)}; choose from {', '.join(CASES)}")
    for entry in args.entry:
        name, _, spec = entry.partition("=")
        if not name or ":" not in spec or name in ("limit", "map", "stream"):
            p.error(f"--entry {entry!r}: expected NAME=FILE.py:FUNCTION, NAME not limit, map or stream")
    return args


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
    """The tokenizer alone, called as the pipeline calls it: on slices of about ``CHUNK_CHARACTERS``, the
    batch size at which it is fastest (one call over every text costs 10-15 % more CPU per token)."""
    from sfttool.dataset.tokens import text_chunks

    backend = tok.backend_tokenizer
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
    return sum(len(e.ids) for chunk in text_chunks(texts) for e in encode(chunk, add_special_tokens=False))


def run_map(tok, data_file: str, max_length: int, packed: bool, template: str) -> int:
    from datasets import load_dataset

    from sfttool.dataset import process_hf_dataset
    from sfttool.dataset.map_fns import template_map_fn_factory

    out = process_hf_dataset(dataset=dict(type=load_dataset, path="json", data_files=data_file), tokenizer=tok,
                             max_length=max_length, template_map_fn=template_map_fn_factory(template),
                             pack_to_max_length=packed, seed=0)
    return lambda: int(sum(out.with_format("arrow")["length"].to_numpy()))  # counted after the clock stops


def run_stream(tok, data_file: str, max_length: int, packed: bool, template: str) -> int:
    from datasets import load_dataset

    from sfttool.dataset.map_fns import template_map_fn_factory
    from sfttool.dataset.streaming import StreamingPackedDataset

    stream = StreamingPackedDataset(dataset=dict(type=load_dataset, path="json", data_files=data_file, split="train",
                                                 streaming=True),
                                    tokenizer=tok, max_length=max_length,
                                    template_map_fn=template_map_fn_factory(template), pack_to_max_length=packed)
    return sum(len(row["input_ids"]) for row in stream)


def load_entry(spec: str) -> Callable:
    """``FILE.py:FUNCTION`` or ``module:FUNCTION`` -> the function."""
    where, _, name = spec.rpartition(":")
    if where.endswith(".py"):
        module_spec = importlib.util.spec_from_file_location(Path(where).stem, where)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    return getattr(module, name)


def measure(case: str, cores: int, tok_dir: str, data_file: str, max_length: int, template: str = "qwen_chat",
            entries: dict[str, str] | None = None) -> dict:
    """One case in this (fresh, spawned) process, pinned to the first ``cores`` cores."""
    os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:cores]))
    fresh_caches()
    import datasets  # noqa: F401  imported before the clock: a training process has them loaded already
    from transformers import AutoTokenizer

    import sfttool.dataset.streaming  # noqa: F401

    tok = AutoTokenizer.from_pretrained(tok_dir)
    kind, _, layout = case.rpartition("_") if case != "limit" else ("limit", "", "")
    runs = {"map": run_map, "stream": run_stream, **{name: load_entry(spec) for name, spec in (entries or {}).items()}}
    texts = texts_to_tokenize(data_file, tok, template)  # the tokenizer alone (a case's limit here: below)
    # A pipeline case measures the limit in its own process too, before and after its run (mean rate): the
    # first tokenizer call of a process and the one after a pipeline's each favour one side.
    before = limit_tokens_per_cpu_s(tok, texts) if kind != "limit" else None
    start = time.perf_counter()
    with CpuMeter() as meter:
        if kind == "limit":
            tokens = run_limit(tok, texts)
        else:
            tokens = runs[kind](tok, data_file, max_length, layout == "packed", template)
    seconds = time.perf_counter() - start
    tokens = tokens() if callable(tokens) else tokens
    cpu = meter.cpu_seconds
    share = {} if kind == "limit" else {"tokenizer_cpu_share": round(meter.tokenizer_cpu_seconds / cpu, 3),
                                        "load_cpu_seconds": round(meter.load_cpu_seconds, 2),
                                        "tokenizer_share_after_load": round(meter.tokenizer_cpu_seconds
                                                                            / meter.cpu_after_load, 3),
                                        "tokens_per_cpu_s_after_load": round(tokens / meter.cpu_after_load)}
    if kind != "limit":
        # The fraction by CPU time with both sides measured in this process, under the same load (the limit's
        # own process, another minute, can run 30 % faster or slower on a shared machine).
        limit = (before + limit_tokens_per_cpu_s(tok, texts)) / 2
        share["limit_tokens_per_cpu_s_here"] = round(limit)
        share["cpu_fraction_after_load_here"] = round(tokens / meter.cpu_after_load / limit, 3)
    return {"case": case, "cores": cores, "seconds": round(seconds, 2), "cpu_seconds": round(cpu, 2),
            "tokens": tokens, "tokens_per_s": round(tokens / seconds), "tokens_per_cpu_s": round(tokens / cpu),
            **share}


def limit_tokens_per_cpu_s(tok, texts: list[str]) -> float:
    """The limit in this process: tokens per CPU second of the tokenizer's batch encode of ``texts``."""
    with CpuMeter() as meter:
        tokens = run_limit(tok, texts)
    return tokens / meter.cpu_seconds


class CpuMeter:
    """CPU seconds of a block of work in this process: in all (``_cpu_seconds``), in the tokenizer's calls
    (``tokens.batch_token_ids``) and in ``datasets.load_dataset``. Any encode entry point (a lazy dataset's
    reads, a worker's batches) can be measured in the process that runs it::

        with CpuMeter() as meter:
            tokens = run(...)
        meter.fractions(tokens, limit_tokens_per_cpu_s(tokenizer, texts))
    """

    def __enter__(self) -> "CpuMeter":
        import datasets

        from sfttool.dataset import chat_encode, encode, tokens
        self._stack = contextlib.ExitStack()
        # every module that calls it by its own name for it
        self._tokenizer = _timed_attribute(self._stack, [tokens, encode, chat_encode], "batch_token_ids")
        self._load = _timed_attribute(self._stack, [datasets, datasets.load], "load_dataset")
        self._start = _cpu_seconds()
        return self

    def __exit__(self, *exc) -> None:
        # the clock's tick: a tiny run may read 0
        self.cpu_seconds = max(_cpu_seconds() - self._start, 0.01)
        self.tokenizer_cpu_seconds, self.load_cpu_seconds = self._tokenizer[0], self._load[0]
        self.cpu_after_load = max(self.cpu_seconds - self.load_cpu_seconds, 0.01)
        self._stack.close()

    def fractions(self, tokens: int, limit_per_cpu_s: float) -> dict:
        """The work's tokens per CPU second against the limit's: in all and after ``load_dataset``."""
        return {"cpu_fraction_of_limit": round(tokens / self.cpu_seconds / limit_per_cpu_s, 3),
                "cpu_fraction_after_load": round(tokens / self.cpu_after_load / limit_per_cpu_s, 3),
                "tokenizer_cpu_share": round(self.tokenizer_cpu_seconds / self.cpu_seconds, 3),
                "tokenizer_share_after_load": round(self.tokenizer_cpu_seconds / self.cpu_after_load, 3),
                "load_cpu_seconds": round(self.load_cpu_seconds, 2)}


def _timed_attribute(stack: contextlib.ExitStack, modules: list, name: str) -> list[float]:
    """Replace ``name`` in ``modules`` with a wrapper that adds its calls' CPU seconds to the returned
    list (calls nested inside an outer timed call are counted once), until ``stack`` closes."""
    spent, inner, depth = [0.0], getattr(modules[0], name), [0]

    @functools.wraps(inner)  # keeps its name: a config's ``type=load_dataset`` is recognised as such
    def timed(*args, **kwargs):
        start = _cpu_seconds()
        depth[0] += 1
        try:
            return inner(*args, **kwargs)
        finally:
            depth[0] -= 1
            if depth[0] == 0:
                spent[0] += _cpu_seconds() - start
    for module in modules:
        stack.enter_context(_replaced(module, name, timed))
    return spent


@contextlib.contextmanager
def _replaced(module, name: str, value):
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)


def _cpu_seconds() -> float:
    """CPU time of this process (all its threads: the tokenizer's too) and of its ended children (map
    processes): on a shared machine, the part of the work that other jobs' load does not stretch."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def in_child(*args) -> dict:
    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(measure, args)


def fresh_caches() -> None:
    """Empty caches for the next run: ``datasets``' (also in a process that imported it already) and sfttool's."""
    cache = tempfile.mkdtemp(prefix="tokenizer-limit-")
    os.environ.update(HF_DATASETS_CACHE=os.path.join(cache, "datasets"), SFTTOOL_CACHE=os.path.join(cache, "sft"))
    if "datasets" in sys.modules:
        sys.modules["datasets"].config.HF_DATASETS_CACHE = os.environ["HF_DATASETS_CACHE"]


def alternate(times: int, tok_dir: str, data_file: str, max_length: int, template: str) -> dict:
    """The limit and the map-style packed pipeline in turn, ``times`` times in this process on one core (the
    limit first in even pairs, second in odd ones), with fresh caches each time: each pair's fraction of the
    limit by CPU time after loading, measured a few seconds apart under the same load, and the tokenizer's
    share."""
    import statistics

    import datasets  # noqa: F401  imported before the clock, as in measure()
    from transformers import AutoTokenizer

    os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:1]))
    tok = AutoTokenizer.from_pretrained(tok_dir)
    texts = texts_to_tokenize(data_file, tok, template)
    pairs = []
    for i in range(times):
        fresh_caches()
        # The order flips every pair: whichever runs first or second in a pair is not always the same side.
        limit = limit_tokens_per_cpu_s(tok, texts) if i % 2 == 0 else None
        with CpuMeter() as meter:
            tokens = run_map(tok, data_file, max_length, True, template)
        tokens = tokens()
        limit = limit or limit_tokens_per_cpu_s(tok, texts)
        pair = {"fraction_after_load": round(tokens / meter.cpu_after_load / limit, 3),
                "tokenizer_share_after_load": round(meter.tokenizer_cpu_seconds / meter.cpu_after_load, 3),
                "pipeline_cpu_seconds_after_load": round(meter.cpu_after_load, 2)}
        pairs.append(pair)
        print(f"{i:3} fraction {pair['fraction_after_load']:6.1%}  tokenizer share {pair['tokenizer_share_after_load']:6.1%}"
              f"  (pipeline {pair['pipeline_cpu_seconds_after_load']:.2f} s after loading)", flush=True)
    medians = {key: statistics.median(p[key] for p in pairs) for key in ("fraction_after_load",
                                                                          "tokenizer_share_after_load")}
    print(f"median fraction {medians['fraction_after_load']:.1%}, tokenizer share "
          f"{medians['tokenizer_share_after_load']:.1%}")
    return {"pairs": pairs, "medians": medians}


def main(argv=None) -> int:
    args = parse_args(argv)
    tok_dir, tok_name = tokenizer_dir()
    data_file = str(Path(tempfile.mkdtemp()) / "rows.jsonl")
    with open(data_file, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in conversations(args.rows, seed=0))
    if args.alternate:
        result = alternate(args.alternate, tok_dir, data_file, args.max_length, args.template)
        write_report(args.out, "tokenizer_limit_alternate", rows=args.rows, max_length=args.max_length,
                     tokenizer=tok_name, template=args.template,
                     tokenizers_parallelism=os.environ.get("TOKENIZERS_PARALLELISM"), **result)
        return 0
    available = len(os.sched_getaffinity(0))
    cores = [int(c) for c in args.cores.split(",")] if args.cores else sorted({1, min(2, available), available})
    entries = dict(entry.split("=", 1) for entry in args.entry)
    cases = tuple(c for c in CASES if c in args.cases) + tuple(f"{name}_{layout}" for name in entries
                                                           for layout in ("packed", "unpacked"))
    results = []
    print(f"{'cores':>5} {'case':16} {'seconds':>8} {'tokens/s':>10} {'of limit':>8} {'cpu s':>7} {'of limit':>8} "
          f"{'load s':>6} {'after load':>10} {'tokenizer':>9} {'after load':>10} {'here':>6}")
    for n in cores:
        limit = None
        for case in cases:
            r = in_child(case, n, tok_dir, data_file, args.max_length, args.template, entries)
            limit = limit or r
            r["fraction_of_limit"] = round(r["tokens_per_s"] / limit["tokens_per_s"], 3)
            r["cpu_fraction_of_limit"] = round(r["tokens_per_cpu_s"] / limit["tokens_per_cpu_s"], 3)
            r["cpu_fraction_after_load"] = round(r.get("tokens_per_cpu_s_after_load", r["tokens_per_cpu_s"])
                                                 / limit["tokens_per_cpu_s"], 3)
            results.append(r)
            print(f"{n:5} {case:16} {r['seconds']:8.2f} {r['tokens_per_s']:10} {r['fraction_of_limit']:8.1%} "
                  f"{r['cpu_seconds']:7.2f} {r['cpu_fraction_of_limit']:8.1%} {r.get('load_cpu_seconds', 0):6.2f} "
                  f"{r['cpu_fraction_after_load']:10.1%} {r.get('tokenizer_cpu_share', 1.0):9.1%} "
                  f"{r.get('tokenizer_share_after_load', 1.0):10.1%} "
                  f"{r.get('cpu_fraction_after_load_here', 1.0):6.1%}", flush=True)
    write_report(args.out, "tokenizer_limit", rows=args.rows, max_length=args.max_length, tokenizer=tok_name,
                 template=args.template,
                 load_average=[round(x, 2) for x in os.getloadavg()], results=results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
