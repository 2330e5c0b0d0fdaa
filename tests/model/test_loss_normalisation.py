"""Loss normalisation does not change with batching (contracts 5 and 6).

The train loop sets ``loss_normalizer = global_count / (loss_factor * world_size)``
before each optimizer step, the optim wrapper divides each micro-batch loss by
``loss_factor``, and data parallelism averages gradients over ``world_size``.
Simulated here step by step; the gradients must equal those of the global
mean over trained tokens (or samples), however the batch is split.
"""
from __future__ import annotations

import pytest
import torch

ATOL = 1e-6


def accumulate(model, rows, micro_batches, world_size=1):
    """Gradients of one optimizer step on one rank, as the train loop takes it.

    ``micro_batches``: per rank, a list of micro-batches, each a list of
    packed rows (lists of samples). Returns the rank-averaged gradients.
    """
    batches = [[rows.collate([rows.pack(r) for r in mb]) for mb in rank] for rank in micro_batches]
    global_count = sum(model.count_loss_units(b) for rank in batches for b in rank)  # the all-reduce
    per_rank = []
    for rank in batches:
        loss_factor = len(rank)  # accumulative_counts (or the remainder of a partial window)
        model.zero_grad()
        for b in rank:
            normalizer = global_count / (loss_factor * world_size)
            loss = model({**b, "loss_normalizer": normalizer}, mode="loss")["loss"]
            (loss / loss_factor).backward()  # what OptimWrapper.update_params does
        per_rank.append([p.grad.clone() for p in model.parameters() if p.requires_grad])
    return [sum(gs) / world_size for gs in zip(*per_rank)]  # DDP all-reduce mean


def one_big_batch(model, rows, samples):
    model.zero_grad()
    data = rows.collate([rows.as_row(s) for s in samples])
    model(data, mode="loss")["loss"].backward()
    return [p.grad.clone() for p in model.parameters() if p.requires_grad]


def assert_same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert torch.allclose(g, w, atol=ATOL)


@pytest.mark.parametrize("reduction", ["token", "sample"])
def test_accumulation_split_does_not_change_gradients(tiny_llama_dir, make_sft, rows, reduction):
    model = make_sft(tiny_llama_dir, loss_reduction=reduction)
    samples = rows.make_samples(4, seed=21, lengths=(4, 20))  # very different trained-token counts
    mb1_acc4 = accumulate(model, rows, [[[[s]] for s in samples]])
    mb4_acc1 = accumulate(model, rows, [[[[s] for s in samples]]])
    assert_same(mb1_acc4, mb4_acc1)
    assert_same(mb4_acc1, one_big_batch(model, rows, samples))


@pytest.mark.parametrize("reduction", ["token", "sample"])
def test_ranks_packing_and_partial_windows_do_not_change_gradients(tiny_llama_dir, make_sft, rows, reduction):
    model = make_sft(tiny_llama_dir, loss_reduction=reduction)
    samples = rows.make_samples(6, seed=22, lengths=(4, 20))
    want = one_big_batch(model, rows, samples)
    # Two ranks, micro-batch 1, accumulation 3.
    assert_same(accumulate(model, rows, [[[[s]] for s in samples[:3]], [[[s]] for s in samples[3:]]],
                           world_size=2), want)
    # Packed: rows of 2 and 3 samples, plus a partial window of one row.
    assert_same(accumulate(model, rows, [[[samples[:2], samples[2:5]], [samples[5:]]]]), want)


def test_local_mean_per_micro_batch_would_be_wrong(tiny_llama_dir, make_sft, rows):
    """Sensitivity check: averaging each micro-batch on its own (no global
    normaliser) weighs short samples' tokens more, and the test would see it."""
    model = make_sft(tiny_llama_dir)
    samples = rows.make_samples(4, seed=21, lengths=(4, 20))
    model.zero_grad()
    for s in samples:
        (model(rows.collate([rows.as_row(s)]), mode="loss")["loss"] / 4).backward()
    naive = [p.grad.clone() for p in model.parameters()]
    want = one_big_batch(model, rows, samples)
    assert max((n - w).abs().max() for n, w in zip(naive, want)) > 1e-4


def test_lora_gradients_are_invariant_too(tiny_qwen2_dir, make_sft, rows):
    from peft import LoraConfig

    model = make_sft(tiny_qwen2_dir, lora=dict(type=LoraConfig, r=4, lora_alpha=8, lora_dropout=0.0,
                                               init_lora_weights=False))
    samples = rows.make_samples(4, seed=23)
    assert_same(accumulate(model, rows, [[[[s]] for s in samples]]), one_big_batch(model, rows, samples))
