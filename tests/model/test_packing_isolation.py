"""Packed samples never see each other: one packed row of three samples gives
the same logits, loss and gradients as the samples run one by one (loss
token-weighted), on eager and SDPA attention, on the tiny Llama and Qwen2.
Also with right padding per the collate contract."""
from __future__ import annotations

import pytest
import torch

ATOL = 1e-5
CASES = [(arch, attn) for arch in ("llama", "qwen2") for attn in ("eager", "sdpa")]


@pytest.fixture
def model_dirs(tiny_llama_dir, tiny_qwen2_dir):
    return {"llama": tiny_llama_dir, "qwen2": tiny_qwen2_dir}


def grads_of(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def separate_reference(model, rows, samples):
    """Per-sample logits, and loss/grads of the token-weighted mean over the samples."""
    model.zero_grad()
    logits, total, count = [], 0.0, 0
    for s in samples:
        data = rows.collate([rows.as_row(s)])
        logits.append(model(data, mode="tensor")[0].detach())
        units = model.count_loss_units(data)
        total = total + model(data, mode="loss")["loss"] * units  # back to a sum over tokens
        count += units
    loss = total / count
    loss.backward()
    return logits, loss.detach(), grads_of(model)


def assert_grads_close(got, want):
    assert got.keys() == want.keys()
    for name in want:
        assert torch.allclose(got[name], want[name], atol=ATOL), name


@pytest.mark.parametrize("arch,attn", CASES)
def test_packed_row_equals_samples_run_separately(model_dirs, make_sft, rows, arch, attn):
    model = make_sft(model_dirs[arch], attn=attn)
    samples = rows.make_samples(3, seed=11)
    want_logits, want_loss, want_grads = separate_reference(model, rows, samples)

    model.zero_grad()
    data = rows.collate([rows.pack(samples)])
    logits = model(data, mode="tensor")[0].detach()
    loss = model(data, mode="loss")["loss"]
    loss.backward()

    assert torch.allclose(logits, torch.cat(want_logits), atol=ATOL)
    assert torch.allclose(loss, want_loss, atol=ATOL)
    assert_grads_close(grads_of(model), want_grads)


@pytest.mark.parametrize("arch,attn", CASES)
def test_padded_packed_batch_equals_samples_run_separately(model_dirs, make_sft, rows, arch, attn):
    """Two packed rows of unequal length, right-padded: the padding is its own
    pseudo-sample, so neither it nor the other samples leak into any logit."""
    model = make_sft(model_dirs[arch], attn=attn)
    samples = rows.make_samples(5, seed=12)
    want_logits, want_loss, want_grads = separate_reference(model, rows, samples)

    model.zero_grad()
    packed = [rows.pack(samples[:2]), rows.pack(samples[2:])]
    data = rows.collate(packed, pad_index=0)
    assert data["input_ids"].shape[1] > min(len(r["input_ids"]) for r in packed)  # there is padding
    logits = model(data, mode="tensor").detach()
    loss = model(data, mode="loss")["loss"]
    loss.backward()

    got = [logits[0, :len(packed[0]["input_ids"])], logits[1, :len(packed[1]["input_ids"])]]
    assert torch.allclose(got[0], torch.cat(want_logits[:2]), atol=ATOL)
    assert torch.allclose(got[1], torch.cat(want_logits[2:]), atol=ATOL)
    assert torch.allclose(loss, want_loss, atol=ATOL)
    assert_grads_close(grads_of(model), want_grads)


def test_collate_fn_batch_is_isolated_too(tiny_llama_dir, make_sft, rows):
    """The same property through the data pipeline's real collate function."""
    from sfttool.dataset import collate_fns  # sfttool's own module: a broken import must fail, not skip

    model = make_sft(tiny_llama_dir)
    samples = rows.make_samples(4, seed=13)
    want_logits, want_loss, _ = separate_reference(model, rows, samples)
    packed = [rows.pack(samples[:3]), rows.pack(samples[3:])]
    data = collate_fns.default_collate_fn(packed, pad_index=0)["data"]
    logits = model(data, mode="tensor").detach()
    assert torch.allclose(logits[0, :len(packed[0]["input_ids"])], torch.cat(want_logits[:3]), atol=ATOL)
    assert torch.allclose(logits[1, :len(packed[1]["input_ids"])], want_logits[3], atol=ATOL)
    assert torch.allclose(model(data, mode="loss")["loss"], want_loss, atol=ATOL)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_the_trap_is_real_without_isolation(tiny_llama_dir, make_sft, rows, attn):
    """Sensitivity check: with a KV cache, or with a padding mask, transformers
    does not isolate packed samples, and this test's tolerance would notice."""
    model = make_sft(tiny_llama_dir, attn=attn)
    samples = rows.make_samples(3, seed=14)
    want = torch.cat(separate_reference(model, rows, samples)[0])
    data = rows.collate([rows.pack(samples)])
    ids, positions = data["input_ids"], data["position_ids"]
    with torch.no_grad():
        cached = model.llm(input_ids=ids, position_ids=positions, use_cache=True).logits[0]
        masked = model.llm(input_ids=ids, position_ids=positions, attention_mask=torch.ones_like(ids),
                           use_cache=False).logits[0]
    assert (cached - want).abs().max() > 1e-3
    assert (masked - want).abs().max() > 1e-3


@pytest.mark.parametrize("reduction", ["token", "sample"])
def test_batch_flattened_to_one_row_gives_the_same_results(tiny_qwen2_dir, make_sft, rows, reduction):
    """Flash-attention finds packed samples from position_ids only in a single
    row, so with it the batch is run as one long row. That path (testable here
    on SDPA) must give exactly the batched logits, loss and gradients."""
    model = make_sft(tiny_qwen2_dir, loss_reduction=reduction)
    assert model.flatten_batch is False  # SDPA: no need to flatten
    samples = rows.make_samples(5, seed=15)
    data = rows.collate([rows.pack(samples[:2]), rows.pack(samples[2:])])
    results = []
    for flatten in (False, True):
        model.flatten_batch = flatten
        model.zero_grad()
        logits = model(data, mode="tensor").detach()
        loss = model(data, mode="loss")["loss"]
        loss.backward()
        results.append((logits, loss.detach(), grads_of(model)))
    (logits, loss, grads), (flat_logits, flat_loss, flat_grads) = results
    assert flat_logits.shape == logits.shape
    assert torch.allclose(flat_logits, logits, atol=ATOL) and torch.allclose(flat_loss, loss, atol=ATOL)
    assert_grads_close(flat_grads, grads)


@pytest.mark.real_asset
@pytest.mark.slow
def test_real_model_packed_row_is_isolated(smollm2_dir, make_sft, rows):
    """The same property on the real SmolLM2-135M (Llama architecture, SDPA)."""
    model = make_sft(smollm2_dir)
    samples = rows.make_samples(3, seed=16, vocab=40000, lengths=(6, 12))
    want_logits, want_loss, _ = separate_reference(model, rows, samples)
    data = rows.collate([rows.pack(samples)])
    with torch.no_grad():
        logits = model(data, mode="tensor")[0]
        loss = model(data, mode="loss")["loss"]
    # A packed row runs the real model's float32 matmuls in other shapes than the separate rows,
    # and the summation order those shapes get depends on the CPU's kernels: 2.3e-4 at most on an
    # AVX2 machine (logits up to ~25). Attention leaking between samples moves logits by ~0.1.
    assert torch.allclose(logits, torch.cat(want_logits), atol=1e-3)
    assert torch.allclose(loss, want_loss, atol=1e-5)
