"""Sequence-parallel attention on one GPU: what one rank runs after the all-to-all, for a rank's share of
Qwen2.5-7B's heads at ``sequence_parallel_size=4`` (7 query heads, 1 key/value head, head dim 128), bf16,
over one packed row of 8,192 and 32,768 tokens, forward + backward. Flash-attention's varlen kernel,
called exactly as ``sfttool.parallel.attention.varlen_attention`` calls it (when flash-attn is installed),
against SDPA with the whole row's mask: the largest output difference, time and the memory each adds.

    python benchmarks/sp_attention_check.py               # on the GPU machine (gpu_check.sh runs it)
    python benchmarks/sp_attention_check.py --dry-run     # anywhere: tiny shapes on CPU, a pure-torch kernel
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import write_report  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 7, 1, 128


def packed_positions(length: int, rng: random.Random) -> torch.Tensor:
    """[1, length] positions of samples of random lengths (up to a quarter of the row), restarting at 0."""
    positions: list[int] = []
    while len(positions) < length:
        positions += range(min(rng.randint(1, max(1, length // 4)), length - len(positions)))
    return torch.tensor([positions])


def reference_kernel(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=None, causal=True):
    """flash_attn_varlen_func's contract in pure torch: each sample alone, causal."""
    out = torch.empty_like(q)
    groups = q.shape[1] // k.shape[1]
    for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))
        out[a:b] = torch.nn.functional.scaled_dot_product_attention(
            qs, ks.repeat_interleave(groups, 0), vs.repeat_interleave(groups, 0), is_causal=causal,
            scale=softmax_scale).transpose(0, 1)
    return out


def run(name: str, fn, q, k, v, device) -> tuple[dict, torch.Tensor]:
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    sync()
    start = time.perf_counter()
    out = fn(q, k, v)
    out.float().square().sum().backward()
    sync()
    seconds = time.perf_counter() - start
    peak = (torch.cuda.max_memory_allocated() - before) / 2**30 if device.type == "cuda" else None
    return dict(attention=name, seconds=round(seconds, 4), added_peak_gib=peak and round(peak, 3)), out.detach()


def check_length(length: int, device, dtype, kernel) -> list[dict]:
    from sfttool.parallel.attention import packed_causal_mask, sdpa_attention, varlen_arguments, varlen_attention

    rng = random.Random(length)
    positions = packed_positions(length, rng).to(device)
    torch.manual_seed(length)
    q = torch.randn(1, HEADS, length, HEAD_DIM, device=device, dtype=dtype)
    k, v = (torch.randn(1, KV_HEADS, length, HEAD_DIM, device=device, dtype=dtype) for _ in range(2))
    scale = HEAD_DIM ** -0.5
    rows, outs = [], {}
    cases = {"sdpa_whole_row_mask": lambda q, k, v: sdpa_attention(q, k, v, packed_causal_mask(positions), scale)}
    if kernel is not None:
        cases["flash_varlen"] = lambda q, k, v: varlen_attention(q, k, v, varlen_arguments(positions), scale,
                                                               kernel=kernel)
    for name, fn in cases.items():
        run(name, fn, q, k, v, device)  # warm-up
        row, outs[name] = run(name, fn, q, k, v, device)
        rows.append(dict(row, length=length, samples=int((positions == 0).sum())))
    if len(outs) == 2:
        rows[-1]["max_abs_diff_vs_sdpa"] = float((outs["flash_varlen"] - outs["sdpa_whole_row_mask"]).abs().max())
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="8192,32768")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU with a pure-torch varlen kernel")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/sp_attention_check.json"))
    args = p.parse_args(argv)
    if not torch.cuda.is_available() and not args.dry_run:
        print("sp_attention_check: no GPU here; --dry-run checks the code path on CPU", file=sys.stderr)
        return 2
    on_gpu = not args.dry_run
    device, dtype = (torch.device("cuda"), torch.bfloat16) if on_gpu else (torch.device("cpu"), torch.float32)
    lengths = [int(n) for n in args.lengths.split(",")] if not args.dry_run else [64]
    kernel, note = reference_kernel, "dry run: pure-torch varlen kernel"
    if on_gpu:
        try:
            from flash_attn import flash_attn_varlen_func as kernel
            note = "flash-attn"
        except ImportError:
            kernel, note = None, "flash-attn not installed: SDPA only"
    rows = [row for n in lengths for row in check_length(n, device, dtype, kernel)]
    for row in rows:
        print(row)
    write_report(args.out, "sp_attention_check", device=torch.cuda.get_device_name() if on_gpu else "cpu",
                 heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=str(dtype), kernel=note, results=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
