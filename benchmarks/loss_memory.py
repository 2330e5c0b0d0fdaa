"""Loss step memory and time with a Qwen2.5-sized vocabulary: does the loss materialise the logits?

A random Qwen2-architecture model (vocabulary 151,936, hidden 256, 2 layers,
untied head, float32, full fine-tune), one row of 4,096 tokens, of which 100 %
or 60 % are trained (the first 40 % masked as a prompt). A step is forward +
backward. Cases:

- ``transformers``: plain ``model(input_ids, labels=...)``.
- ``sfttool_unchunked``: ``SupervisedFinetune(loss_implementation='unchunked')``
  (the LM head on trained positions only, all at once).
- ``sfttool_chunked``: ``SupervisedFinetune`` as built by default.
- ``reference_chunked``: the decoder's hidden states, then linear + cross-entropy
  over 512 positions at a time under activation checkpointing (recomputed in
  backward): the textbook way not to hold the logits.

Memory: each case in a fresh process, step memory = peak RSS after the step
minus RSS before it (the first step, so gradients are allocated in it). Time:
one process alternates the cases step by step, ``--repeats`` times, and reports
each case's median.

    OMP_NUM_THREADS=1 python benchmarks/loss_memory.py               # ~5 min on 2 cores
    python benchmarks/loss_memory.py --length 256 --vocab 4096 --repeats 1   # seconds
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from report import write_report

CASES = ("transformers", "sfttool_unchunked", "sfttool_chunked", "reference_chunked")
REFERENCE_CHUNK = 512
RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--length", type=int, default=4096, help="tokens in the one row")
    p.add_argument("--trained", default="1.0,0.6", help="fractions of positions trained")
    p.add_argument("--repeats", type=int, default=3, help="alternating timed steps per case")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--jobs", type=int, default=1,
                   help="memory children run this many at a time (each measures its own peak; their sum must fit "
                        "in RAM); the timing child always runs alone")
    p.add_argument("--out", type=Path, default=RESULTS / "loss_memory.json")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # JSON job for a child process
    return p.parse_args(argv)


# ---------------------------------------------------------------- a step ----

def build(job: dict):
    """The model (seeded, so every process has the same weights) and the batch."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from sfttool.model import SupervisedFinetune

    torch.set_num_threads(job["threads"])
    config = Qwen2Config(vocab_size=job["vocab"], hidden_size=job["hidden"], intermediate_size=2 * job["hidden"],
                         num_hidden_layers=job["layers"], num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=job["length"], tie_word_embeddings=False)
    torch.manual_seed(0)
    llm = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    model = SupervisedFinetune(llm=llm, use_activation_checkpointing=False)
    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, job["vocab"], (1, job["length"]), generator=gen)  # [1, length]
    labels = input_ids.clone()
    labels[:, :round(job["length"] * (1 - job["trained"]))] = -100  # the untrained prompt
    position_ids = torch.arange(job["length"])[None]
    return model, {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}


def step(case: str, model, data: dict) -> float:
    """Forward + backward of one case; returns the loss."""
    for p in model.parameters():
        p.grad = None
    if case == "transformers":
        loss = model.llm(input_ids=data["input_ids"], labels=data["labels"], use_cache=False).loss
    elif case == "reference_chunked":
        loss = reference_chunked_loss(model.llm, data)
    else:
        model.loss_implementation = "unchunked" if case == "sfttool_unchunked" else "chunked"
        loss = model(data, mode="loss")["loss"]
    loss.backward()
    return float(loss)


def reference_chunked_loss(llm, data: dict):
    import torch
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    hidden = llm.model(input_ids=data["input_ids"], position_ids=data["position_ids"],
                       use_cache=False).last_hidden_state[0]  # [length, hidden]
    targets = torch.cat([data["labels"][0, 1:], torch.tensor([-100])])  # next token; the last predicts nothing

    def chunk(h, t):
        return F.cross_entropy(llm.lm_head(h).float(), t, ignore_index=-100, reduction="sum")

    total = sum(checkpoint(chunk, hidden[i:i + REFERENCE_CHUNK], targets[i:i + REFERENCE_CHUNK], use_reentrant=False)
                for i in range(0, hidden.shape[0], REFERENCE_CHUNK))
    return total / (targets != -100).sum()


# ---------------------------------------------------------- child processes ----

def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def memory_child(job: dict) -> dict:
    """One case's first step in this fresh process."""
    model, data = build(job)
    gc.collect()
    before, peak_before = rss_mib(), peak_rss_mib()
    start = time.perf_counter()
    loss = step(job["case"], model, data)
    seconds = time.perf_counter() - start
    peak = peak_rss_mib()
    return {"case": job["case"], "trained": job["trained"], "loss": loss, "rss_before_mib": round(before, 1),
            "step_mib": round(peak - before, 1), "first_step_s": round(seconds, 3),
            # If building had peaked higher than the step, the step's own peak would be hidden.
            "step_raised_peak": peak > peak_before}


def timing_child(job: dict) -> dict:
    """Every case in one process, alternating, so background load hits them alike."""
    model, data = build(job)
    step("sfttool_chunked", model, data)  # warm-up: first-call allocations and kernels
    seconds = {case: [] for case in CASES}
    for _ in range(job["repeats"]):
        for case in CASES:
            start = time.perf_counter()
            step(case, model, data)
            seconds[case].append(time.perf_counter() - start)
    return {case: {"median_s": round(statistics.median(s), 3), "runs_s": [round(x, 3) for x in s]}
            for case, s in seconds.items()}


def in_child(job: dict) -> dict:
    cmd = [sys.executable, __file__, "--child", json.dumps(job)]
    env = {**os.environ, "OMP_NUM_THREADS": str(job["threads"])}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{job}: child failed\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ driver ----

def measure(args) -> list[dict]:
    base = {"vocab": args.vocab, "hidden": args.hidden, "layers": args.layers, "length": args.length,
            "threads": args.threads, "repeats": args.repeats}
    rows = []
    for trained in [float(x) for x in args.trained.split(",")]:
        jobs = [{**base, "case": case, "trained": trained, "mode": "memory"} for case in CASES]
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:  # threads that wait on child processes
            memory = dict(zip(CASES, pool.map(in_child, jobs)))
        timing = in_child({**base, "trained": trained, "mode": "time"})
        for case in CASES:
            rows.append({**memory[case], **timing[case]})
        summarise(rows[-len(CASES):])
    return rows


def summarise(rows: list[dict]) -> None:
    """Ratios the targets are stated in: memory against the chunked reference,
    time against sfttool unchunked; loss gap against plain transformers."""
    by_case = {r["case"]: r for r in rows}
    for r in rows:
        r["memory_vs_reference"] = round(r["step_mib"] / by_case["reference_chunked"]["step_mib"], 3)
        r["time_vs_unchunked"] = round(r["median_s"] / by_case["sfttool_unchunked"]["median_s"], 3)
        r["loss_gap"] = abs(r["loss"] - by_case["transformers"]["loss"])


def print_table(rows: list[dict]) -> None:
    print(f"{'trained':>7} {'case':18} {'step GiB':>8} {'x ref':>6} {'median s':>8} {'x unchunked':>11} {'loss':>9}")
    for r in rows:
        print(f"{r['trained']:7.0%} {r['case']:18} {r['step_mib'] / 1024:8.2f} {r['memory_vs_reference']:6.2f} "
              f"{r['median_s']:8.2f} {r['time_vs_unchunked']:11.2f} {r['loss']:9.5f}", flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        job = json.loads(args.child)
        print(json.dumps(memory_child(job) if job["mode"] == "memory" else timing_child(job)))
        return 0
    started = time.perf_counter()
    rows = measure(args)
    print_table(rows)
    write_report(args.out, "loss_memory",
                 setup={"vocab": args.vocab, "hidden": args.hidden, "layers": args.layers, "length": args.length,
                        "dtype": "float32", "method": "full fine-tune", "threads": args.threads,
                        "repeats": args.repeats, "reference_chunk": REFERENCE_CHUNK,
                        "step": "forward + backward, first step of a fresh process for memory"},
                 wall_s=round(time.perf_counter() - started, 1), results=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
