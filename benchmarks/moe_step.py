"""Mixture-of-experts training step on CPU: a small Qwen3-MoE against the dense Qwen3 with the same active
parameters per token, in time and memory, through ``SupervisedFinetune`` (the router's aux loss included).

The MoE model has ``experts`` experts of width ``expert_width``, ``top_k`` per token; the dense model's
MLP is ``top_k x expert_width`` wide, so both do the same MLP arithmetic per token (the MoE adds the
router, a ``hidden x experts`` product). Attention, embeddings and head are the same. Each case runs in
its own process (its peak RSS is its own), on the same synthetic packed rows, and times
``model.train_step`` (forward, backward, AdamW) the way mmengine's runner calls it: the median of
``--steps`` steps after ``--warmup``. MoE cases run with each experts implementation transformers offers
here ('grouped_mm' and 'eager': the loop over experts that received tokens).

    OMP_NUM_THREADS=1 python benchmarks/moe_step.py                 # ~3 min on 2 busy CPU cores
    python benchmarks/moe_step.py --methods lora --steps 2 --warmup 1 --out /tmp/moe_step.json
    python benchmarks/moe_step.py --device cuda --shape qwen3-30b-a3b-2l --length 4096   # run by gpu_check.sh

On a GPU the weights are bfloat16 and the memory is torch's peak allocation; on CPU float32 and the peak
RSS of the case's process. ``step_s`` is the median step (a burst of other work on a shared machine spoils
one step, not the figure), ``tokens_per_s`` the tokens of one step over it.
"""
from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import write_report  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = {
    "small": dict(hidden=256, layers=4, heads=8, kv_heads=4, experts=8, top_k=2, expert_width=256, vocab=2048),
    # Qwen3-30B-A3B's layer (128 experts of width 768, 8 per token, 32 query / 4 key-value heads of 128),
    # 2 layers deep, with a small vocabulary: what the experts kernels cost on a GPU (benchmarks/gpu_check.sh).
    "qwen3-30b-a3b-2l": dict(hidden=2048, layers=2, heads=32, kv_heads=4, head_dim=128, experts=128, top_k=8,
                             expert_width=768, vocab=32000),
}


def model_config(kind: str, shape: dict):
    """The transformers config of the 'moe' or the 'dense' model of ``shape``."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    common = dict(vocab_size=shape["vocab"], hidden_size=shape["hidden"], num_hidden_layers=shape["layers"],
                  num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                  head_dim=shape.get("head_dim", shape["hidden"] // shape["heads"]), max_position_embeddings=4096,
                  tie_word_embeddings=False)
    if kind == "dense":  # the MLP as wide as the top_k experts a token goes through
        return Qwen3Config(**common, intermediate_size=shape["top_k"] * shape["expert_width"])
    return Qwen3MoeConfig(**common, num_experts=shape["experts"], num_experts_per_tok=shape["top_k"],
                          moe_intermediate_size=shape["expert_width"], decoder_sparse_step=1, norm_topk_prob=True)


def packed_rows(n_rows: int, length: int, vocab: int, seed: int) -> list[dict]:
    """Rows of ``length`` tokens packed from samples of 32..256 tokens, the first 40% of each untrained."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n_rows):
        ids, labels, positions = [], [], []
        while len(ids) < length:
            size = min(rng.randint(32, 256), length - len(ids))
            sample = [rng.randrange(3, vocab) for _ in range(size)]
            prompt = int(size * 0.4)
            ids += sample
            labels += [-100] * prompt + sample[prompt:]
            positions += list(range(size))
        rows.append({"input_ids": ids, "labels": labels, "position_ids": positions})
    return rows


def build_model(folder: Path, method: str, experts_implementation: str | None, device: str):
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    from sfttool.model import SupervisedFinetune

    dtype = "bfloat16" if device == "cuda" else "float32"
    llm = dict(type=AutoModelForCausalLM.from_pretrained, pretrained_model_name_or_path=str(folder), dtype=dtype)
    if experts_implementation:
        llm["experts_implementation"] = experts_implementation
    lora = dict(type=LoraConfig, r=8, lora_alpha=16, lora_dropout=0.0) if method == "lora" else None
    return SupervisedFinetune(llm=llm, lora=lora, use_activation_checkpointing=False).to(device)


def run_case(case: dict) -> dict:
    """One (model, method, experts implementation) in this process."""
    import torch
    from mmengine.optim import OptimWrapper

    torch.manual_seed(0)
    torch.set_num_threads(case["threads"])
    folder = Path(case["work_dir"]) / case["model"]
    if not (folder / "config.json").is_file():  # random weights, the same for every case of this model
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_config(model_config(case["model"], case["shape"])).save_pretrained(folder)
    device = case.get("device", "cpu")
    model = build_model(folder, case["method"], case.get("experts"), device)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    wrapper = OptimWrapper(optimizer=torch.optim.AdamW(params, lr=1e-4))
    n_rows = case["batch_size"] * (case["warmup"] + case["steps"])
    rows = packed_rows(n_rows, case["length"], case["shape"]["vocab"], seed=0)
    times, tokens = [], 0
    for step in range(case["warmup"] + case["steps"]):
        batch = rows[step * case["batch_size"]:(step + 1) * case["batch_size"]]
        data = {k: torch.tensor([r[k] for r in batch], device=device) for k in ("input_ids", "labels", "position_ids")}
        data["loss_normalizer"] = model.count_loss_units(data)
        start = time.perf_counter()
        log = model.train_step({"data": data, "data_samples": None}, wrapper)
        if device == "cuda":
            torch.cuda.synchronize()
        if step >= case["warmup"]:
            times.append(time.perf_counter() - start)
            tokens += data["input_ids"].numel()
    active = active_parameters(model, case)
    return {key: case[key] for key in ("model", "method", "experts") if key in case} | {
        "params": sum(p.numel() for p in model.parameters()), "active_params": active,
        "trainable_params": sum(p.numel() for p in params), "step_s": statistics.median(times),
        "tokens_per_s": tokens / len(times) / statistics.median(times),
        "peak_mem_mib": round(peak_memory_mib(device), 1),
        "memory_kind": "cuda_max_allocated" if device == "cuda" else "peak_rss",
        "last_aux_loss": step_value(log, "aux_loss"), "last_loss": step_value(log, "loss")}


def peak_memory_mib(device: str) -> float:
    import torch

    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def step_value(log_vars: dict, name: str) -> float | None:
    """A step metric of ``train_step``'s log (``sfttool.model.step_metrics``): its sum over its count."""
    from sfttool.model.step_metrics import STEP_METRICS

    total, count = log_vars.get(STEP_METRICS, {}).get(name, (None, None))
    return None if total is None else float(total) / float(count)


def active_parameters(model, case: dict) -> int:
    """Parameters a token goes through: all but the experts it is not routed to."""
    shape = case["shape"]
    total = sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n)
    if case["model"] == "dense":
        return total
    per_expert = 3 * shape["hidden"] * shape["expert_width"]
    return total - shape["layers"] * (shape["experts"] - shape["top_k"]) * per_expert


def run_in_child(case: dict) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--case", json.dumps(case)], capture_output=True, text=True)
    if proc.returncode:
        return {**{k: case.get(k) for k in ("model", "method", "experts")}, "error": proc.stderr[-800:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def print_table(results: list[dict]) -> None:
    print(f"{'model':6} {'method':6} {'experts':10} {'params':>9} {'active':>9} {'step s':>7} {'tok/s':>7} "
          f"{'peak MiB':>9}")
    for r in results:
        if "error" in r:
            print(f"{r['model']:6} {r['method']:6} {str(r.get('experts') or '-'):10} error: {r['error'][-200:]}")
            continue
        print(f"{r['model']:6} {r['method']:6} {str(r.get('experts') or '-'):10} {r['params'] / 1e6:8.2f}M "
              f"{r['active_params'] / 1e6:8.2f}M {r['step_s']:7.3f} {r['tokens_per_s']:7.0f} {r['peak_mem_mib']:9.0f}")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default="full,lora")
    parser.add_argument("--experts", default="grouped_mm,eager", help="experts implementations of the MoE cases")
    parser.add_argument("--length", type=int, default=1024, help="tokens per packed row")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: bfloat16 weights")
    parser.add_argument("--out", type=Path, default=RESULTS / "moe_step.json")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.case:
        print(json.dumps(run_case(json.loads(args.case))))
        return 0
    results = []
    with tempfile.TemporaryDirectory() as work:
        common = dict(work_dir=work, shape=SHAPES[args.shape], device=args.device, length=args.length,
                      batch_size=args.batch_size, steps=args.steps, warmup=args.warmup, threads=args.threads)
        for method in args.methods.split(","):
            results.append(run_in_child(dict(common, model="dense", method=method)))
            for experts in args.experts.split(","):
                results.append(run_in_child(dict(common, model="moe", method=method, experts=experts)))
    print_table(results)
    write_report(args.out, "moe_step", shape=SHAPES[args.shape], settings={k: v for k, v in vars(args).items()
                                                               if k not in ("case", "out")}, results=results)
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
