"""The loss alone on the GPU: LM head + cross-entropy over a long row, each way
sfttool can compute it (``loss_implementation``), with time and the memory it
adds. Called by ``gpu_check.py`` before the model cases; seconds on one H200.

Hidden states are random bf16 ``[positions, hidden]`` with gradients (what the
decoder hands the loss); the head weight is frozen, as under LoRA / QLoRA.
Fused kernels (Liger, Cut Cross-Entropy) run when installed, else are reported
as skipped with the install hint.
"""
from __future__ import annotations

import statistics
import time

LOSS_POSITIONS = (8192, 32768)  # trained positions in a step


def loss_implementations() -> tuple[list[str], dict]:
    from sfttool.errors import SfttoolError
    from sfttool.model.fused_loss import KERNELS, require_kernel

    run, skipped = ["unchunked", "chunked"], {}
    for name in KERNELS:
        try:
            require_kernel(name)
            run.append(name)
        except SfttoolError as exc:
            skipped[name] = str(exc)
    return run, skipped


def summed_loss(name: str, hidden, weight, targets):
    import torch.nn.functional as F

    from sfttool.model import loss as L
    from sfttool.model.chunked_loss import chunked_linear_cross_entropy
    from sfttool.model.fused_loss import fused_linear_cross_entropy

    if name == "unchunked":
        return L.summed_loss(F.linear(hidden, weight), targets)
    if name == "chunked":
        return chunked_linear_cross_entropy(hidden, weight, None, targets, None)
    return fused_linear_cross_entropy(name, hidden, weight, None, targets, None)


def loss_case(name: str, positions: int, hidden_size: int, vocab: int, steps: int, device) -> dict:
    import torch

    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(positions, hidden_size, device=device, dtype=torch.bfloat16, generator=gen)
    hidden.requires_grad_(True)
    weight = torch.randn(vocab, hidden_size, device=device, dtype=torch.bfloat16, generator=gen) * 0.02
    targets = torch.randint(0, vocab, (positions,), device=device, generator=gen)
    on_gpu = device.type == "cuda"
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if on_gpu else 0
    seconds, loss = [], None
    for _ in range(steps + 1):  # the first is a warm-up
        hidden.grad = None
        start = time.perf_counter()
        loss = summed_loss(name, hidden, weight, targets) / positions
        loss.backward()
        if on_gpu:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    extra = (torch.cuda.max_memory_allocated() - before) / 2**30 if on_gpu else None
    return {"loss_implementation": name, "positions": positions, "hidden_size": hidden_size, "vocab": vocab,
            "step_s": statistics.median(seconds[1:]), "peak_extra_gib": extra, "loss": float(loss)}


def run_loss_cases(shape: dict, device, dry_run: bool, steps: int = 3) -> list[dict]:
    """Every implementation at each length; a failure is reported, not raised."""
    import torch

    names, skipped = loss_implementations()
    positions = (64,) if dry_run else LOSS_POSITIONS
    rows = [{"loss_implementation": n, "skipped": why} for n, why in skipped.items()]
    print(f"{'loss':18} {'positions':>9} {'step s':>8} {'extra GiB':>9} {'loss':>8}")
    for n in positions:
        for name in names:
            try:
                row = loss_case(name, n, shape["hidden_size"], shape["vocab_size"], steps, device)
            except Exception as exc:  # one broken kernel must not hide the others
                row = {"loss_implementation": name, "positions": n, "error": f"{type(exc).__name__}: {exc}"[:300]}
            rows.append(row)
            extra = row.get("peak_extra_gib")
            print(f"{name:18} {n:9} {row.get('step_s', float('nan')):8.4f} "
                  f"{extra if extra is not None else float('nan'):9.2f} {row.get('loss', float('nan')):8.4f}",
                  flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows
