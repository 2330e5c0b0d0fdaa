"""GPU readiness check: LoRA and QLoRA steps of a real-shaped model, tokens/s per GPU, MFU, peak memory.

No download: the model has Llama-3-8B (or Qwen2.5-7B) shapes with random weights, saved
once to a local folder and loaded back through sfttool's own path (``SupervisedFinetune``
with the same ``llm``/``lora``/``quantization_config`` dicts a config uses), so the
check covers bitsandbytes 4-bit loading, peft, activation checkpointing and the
packed-row loss. Speed does not depend on the weight values.

First the loss alone (``gpu_loss_check.py``): the LM head + cross-entropy over
8k and 32k positions, unchunked, chunked (the default) and the fused kernels
when installed, with time and the GPU memory each adds.

Each case is (method, attention, max_length): one packed row of ``max_length``
tokens per step (several samples, position_ids restarting at each), bf16,
SDPA and flash-attention 2 varlen when ``flash_attn`` is installed.

    python benchmarks/gpu_check.py                 # on a GPU: ~4-6 min on one H200
    python benchmarks/gpu_check.py --dry-run       # tiny shapes on CPU: the same code path, seconds

MFU = tokens/s x (6 N + 12 L d c) / peak bf16 FLOP/s, with N the parameters in
matmuls (embedding lookup excluded), L layers, d hidden size and c the mean
attended context per token in the packed samples (causal: about half a sample's
length; QK^T and AV cost 4 d c per token and layer forward, x3 with backward). It is the usual
"as if full fine-tuning" model-FLOPs count: LoRA skips the frozen weights'
gradients (about a third of them), and recomputation is not counted.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from gpu_loss_check import run_loss_cases

ARCHS = {
    # Llama-3-8B: hidden 4096, 32 layers, GQA 32/8 heads, MLP 14336, vocab 128256.
    "llama3-8b": dict(family="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                      rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=False),
    # Qwen2.5-7B: hidden 3584, 28 layers, GQA 28/4 heads, MLP 18944, vocab 152064.
    "qwen2.5-7b": dict(family="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                       rope_theta=1000000.0, max_position_embeddings=32768, tie_word_embeddings=False),
    # For --dry-run: the same code on CPU in seconds.
    "tiny": dict(family="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                 max_position_embeddings=1024, tie_word_embeddings=False),
}
# Dense bf16 peak FLOP/s by device name (no sparsity).
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12,
             "L40S": 362e12, "L4": 121e12, "A10": 125e12, "RTX 4090": 165e12}
RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="llama3-8b", choices=sorted(ARCHS))
    p.add_argument("--methods", default="qlora,lora")
    p.add_argument("--attn", default="sdpa,flash_attention_2",
                   help="attention backends; flash_attention_2 is skipped when flash_attn is missing")
    p.add_argument("--lengths", default="2048,8192")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--lora-r", type=int, default=64)
    p.add_argument("--budget-s", type=float, default=420, help="skip cases that would start after this")
    p.add_argument("--peak-tflops", type=float, default=None, help="bf16 dense peak, if the GPU is not known")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU, 1 step: checks the code path")
    p.add_argument("--out", type=Path, default=None, help="JSON path (default: $OUT or benchmarks/results)")
    args = p.parse_args(argv)
    if args.dry_run:
        args.arch, args.lengths, args.steps, args.warmup = "tiny", "128", 1, 1
    if args.out is None:
        args.out = Path(os.environ.get("OUT") or RESULTS) / "gpu_check.json"
    return args


# ---------------------------------------------------------------- model ----

def save_random_model(arch: str, folder: Path, device) -> dict:
    """Random-initialised weights of ``arch`` in bf16, saved as a normal HF folder."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    shape = dict(ARCHS[arch])
    family = shape.pop("family")
    config_cls = LlamaConfig if family == "llama" else Qwen2Config
    config = config_cls(**shape, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):  # initialising 8B weights on the GPU takes seconds, on a CPU minutes
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    del model
    return {"family": family, **shape}


def build_model(folder: Path, method: str, attn: str, lora_r: int, on_gpu: bool):
    """``SupervisedFinetune`` from config dicts, as a user's LoRA/QLoRA config builds it."""
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from sfttool.model import SupervisedFinetune

    llm = dict(type=AutoModelForCausalLM.from_pretrained, pretrained_model_name_or_path=str(folder),
               dtype=torch.bfloat16, attn_implementation=attn)
    if method == "qlora":
        llm["quantization_config"] = dict(
            type=BitsAndBytesConfig, load_in_4bit=True, bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16)
    elif on_gpu:
        llm["device_map"] = {"": 0}  # load straight onto the GPU
    lora = dict(type=LoraConfig, r=lora_r, lora_alpha=2 * lora_r, lora_dropout=0.0, bias="none",
                task_type="CAUSAL_LM")
    model = SupervisedFinetune(llm=llm, lora=lora, use_activation_checkpointing=True,
                               use_varlen_attn=attn == "flash_attention_2")
    return model.cuda() if on_gpu and method != "qlora" else model


def optim_wrapper(model, on_gpu: bool):
    """What the built-in configs use: AdamW under bf16 autocast on a GPU (plain on CPU)."""
    import torch
    from mmengine.optim import AmpOptimWrapper, OptimWrapper

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=2e-4, betas=(0.9, 0.999), weight_decay=0)
    if on_gpu:
        return AmpOptimWrapper(optimizer=optimizer, dtype=torch.bfloat16, clip_grad=dict(max_norm=1))
    return OptimWrapper(optimizer=optimizer, clip_grad=dict(max_norm=1))


# ----------------------------------------------------------------- data ----

def packed_row(max_length: int, vocab: int, rng: random.Random) -> dict:
    """One full row of whole samples (64 .. max_length/2 tokens; the last fills the row),
    the first 30-60% of each sample (its prompt) not trained."""
    ids, labels, positions, lengths = [], [], [], []
    while len(ids) < max_length:
        left = max_length - len(ids)
        n = rng.randint(min(64, left), max(min(64, left), max_length // 2))
        n = left if left - n < 64 else n  # never leave a sliver
        sample = [rng.randrange(3, vocab) for _ in range(n)]
        prompt = int(n * rng.uniform(0.3, 0.6))
        ids += sample
        labels += [-100] * prompt + sample[prompt:]
        positions += range(n)
        lengths.append(n)
    return {"input_ids": ids, "labels": labels, "position_ids": positions, "sample_lengths": lengths}


def mean_context(lengths: list[int]) -> float:
    """Mean number of keys a query attends to under causal masking within samples."""
    return sum(n * (n + 1) / 2 for n in lengths) / sum(lengths)


# ---------------------------------------------------------------- a case ----

def run_case(model, wrapper, max_length: int, args, device) -> dict:
    import torch

    from sfttool.dataset.collate_fns import default_collate_fn

    rng = random.Random(max_length)
    vocab = model.llm.get_input_embeddings().num_embeddings
    rows = [packed_row(max_length, vocab, rng) for _ in range(args.warmup + args.steps)]
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    start = None
    for i, row in enumerate(rows):
        if i == args.warmup:
            _sync(device)
            start = time.perf_counter()
        batch = default_collate_fn([row])
        batch["data"] = {k: v.to(device) for k, v in batch["data"].items()}
        batch["data"]["loss_normalizer"] = float(model.count_loss_units(batch["data"]))
        loss = model.train_step(batch, wrapper)["loss"]
    _sync(device)
    seconds = time.perf_counter() - start
    tokens = args.steps * max_length
    measured = rows[args.warmup:]
    context = sum(mean_context(r["sample_lengths"]) for r in measured) / len(measured)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    return {"tokens_per_s": tokens / seconds, "step_s": seconds / args.steps, "mean_context": context,
            "peak_mem_gib": peak, "loss": float(loss.detach() if hasattr(loss, "detach") else loss)}


def _sync(device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize()


def flops_per_token(model, shape: dict, context: float) -> float:
    """6 N (matmul weights, incl. the LM head) + 12 L d c (attention scores and values)."""
    embedding = shape["vocab_size"] * shape["hidden_size"]
    base = model.llm.get_base_model() if hasattr(model.llm, "get_base_model") else model.llm
    n = _logical_params(base) - embedding
    return 6 * n + 12 * shape["num_hidden_layers"] * shape["hidden_size"] * context


def _logical_params(module) -> int:
    """Parameter count with 4-bit weights counted at their logical shape, LoRA excluded."""
    total = 0
    for name, p in module.named_parameters():
        if "lora_" in name:
            continue
        shape = getattr(getattr(p, "quant_state", None), "shape", None)
        total += int(torch_numel(shape)) if shape is not None else p.numel()
    return total


def torch_numel(shape) -> int:
    out = 1
    for s in shape:
        out *= int(s)
    return out


def peak_flops(args, device) -> float | None:
    import torch

    if args.peak_tflops:
        return args.peak_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(0)
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


# ---------------------------------------------------------------- driver ----

def attention_backends(requested: list[str], on_gpu: bool) -> tuple[list[str], dict]:
    """The requested backends this machine can run, and why the others are skipped."""
    from transformers.utils import is_flash_attn_2_available

    run, skipped = [], {}
    for attn in requested:
        if attn == "flash_attention_2" and not (on_gpu and is_flash_attn_2_available()):
            skipped[attn] = "flash_attn is not installed (or no GPU)"
        else:
            run.append(attn)
    return run, skipped


def environment(device) -> dict:
    import importlib.metadata as md
    import platform

    import torch

    versions = {}
    for name in ("torch", "transformers", "peft", "bitsandbytes", "mmengine", "flash-attn", "sfttool"):
        try:
            versions[name] = md.version(name)
        except md.PackageNotFoundError:
            versions[name] = None
    gpu = torch.cuda.get_device_name(0) if device.type == "cuda" else None
    return {"device": gpu or "cpu", "cpu_cores": os.cpu_count(), "python": platform.python_version(),
            "cuda": torch.version.cuda, "versions": versions}


def print_row(r: dict) -> None:
    if "error" in r or "skipped" in r:
        print(f"{r['method']:6} {r['attn']:18} {r['max_length']:6}  {r.get('error') or r.get('skipped')}")
        return
    mfu = f"{100 * r['mfu']:5.1f}%" if r.get("mfu") is not None else "   n/a"
    mem = f"{r['peak_mem_gib']:8.1f}" if r.get("peak_mem_gib") is not None else "     n/a"
    print(f"{r['method']:6} {r['attn']:18} {r['max_length']:6} {r['tokens_per_s']:10.0f} {r['step_s']:7.2f} "
          f"{mfu} {mem}", flush=True)


def run_all(args, device, folder: Path, shape: dict, started: float, save) -> list[dict]:
    """Every case; ``save(results)`` after each, so a run stopped by a timeout keeps what it measured."""
    import torch

    on_gpu = device.type == "cuda"
    backends, skipped = attention_backends(args.attn.split(","), on_gpu)
    lengths = [int(x) for x in args.lengths.split(",")]
    peak = peak_flops(args, device)
    results = [dict(method=m, attn=a, max_length=n, skipped=why)
               for m in args.methods.split(",") for a, why in skipped.items() for n in lengths]
    for method in args.methods.split(","):
        for attn in backends:
            if time.perf_counter() - started > args.budget_s:
                results += [dict(method=method, attn=attn, max_length=n, skipped="time budget") for n in lengths]
                continue
            try:
                model = build_model(folder, method, attn, args.lora_r, on_gpu)
                wrapper = optim_wrapper(model, on_gpu)
            except Exception as exc:  # report and go on: one broken backend must not hide the others
                results += [dict(method=method, attn=attn, max_length=n, error=f"{type(exc).__name__}: {exc}")
                            for n in lengths]
                continue
            for n in lengths:
                r = dict(method=method, attn=attn, max_length=n)
                try:
                    r.update(run_case(model, wrapper, n, args, device))
                    fpt = flops_per_token(model, shape, r["mean_context"])
                    r.update(flops_per_token=fpt, mfu=r["tokens_per_s"] * fpt / peak if peak else None)
                except Exception as exc:
                    r["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                results.append(r)
                print_row(r)
                save(results)
            del model, wrapper
            if on_gpu:
                torch.cuda.empty_cache()
    return results


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    started = time.perf_counter()
    on_gpu = torch.cuda.is_available()
    if not on_gpu and not args.dry_run:
        print("No CUDA device: run with --dry-run to check the code path on CPU.", file=sys.stderr)
        return 2
    device = torch.device("cuda" if on_gpu else "cpu")
    folder = Path(tempfile.mkdtemp(prefix="sfttool-gpu-check-"))
    shape: dict = {}
    loss_results: list[dict] = []

    def save(results: list[dict]) -> dict:
        return write_report(args, device, shape, results, started, loss_results)

    try:
        shape = save_random_model(args.arch, folder, device)
        print(f"{args.arch}: random weights saved in {time.perf_counter() - started:.0f} s; "
              f"device {environment(device)['device']}", flush=True)
        loss_results += run_loss_cases(shape, device, args.dry_run)
        save([])
        print(f"{'method':6} {'attention':18} {'length':>6} {'tokens/s':>10} {'step s':>7} {'MFU':>6} {'peak GiB':>8}")
        results = run_all(args, device, folder, shape, started, save)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    report = save(results)
    print(f"wrote {args.out} ({report['wall_s']} s)")
    return 1 if any("error" in r for r in results) else 0


def write_report(args, device, shape: dict, results: list[dict], started: float, loss_results: list[dict]) -> dict:
    report = {"benchmark": "gpu_check", "dry_run": args.dry_run, "arch": args.arch, "shape": shape,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "environment": environment(device), "lora_r": args.lora_r, "steps": args.steps,
              "warmup": args.warmup, "batch": "1 packed row of max_length tokens per GPU",
              "peak_flops": peak_flops(args, device), "wall_s": round(time.perf_counter() - started, 1),
              "loss_implementation": "chunked (SupervisedFinetune's default)", "results": results,
              "loss_results": loss_results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    sys.exit(main())
