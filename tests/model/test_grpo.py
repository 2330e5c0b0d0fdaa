"""The GRPO model on a tiny Qwen2: the training log-probs against an unpacked forward and against the
generation's own logits; the loss and its gradient against the published formula on those log-probs;
zero gradient from groups of equal rewards; any micro-batch split gives the step's gradient; the
reference model; the settings' checks."""
from __future__ import annotations

import pytest
import torch

from sfttool.model import grpo_loss as G
from sfttool.model.grpo import completion_positions, rollout_batch
from sfttool.registry import ConfigBuildError

TEMPERATURE = 0.7


def samples(model, n=6, length=10, seed=3):
    """n (prompt, completion) pairs: real chat prompts, sampled completions (some cut at a stop token)."""
    tok = model.tokenizer
    texts = ["hi", "What is the river?", "Tell me one two three", "a", "Name a blue bird please", "ok?"][:n]
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                       tokenize=True)["input_ids"] for t in texts]
    out = model.generate_completions(prompts, [(0, i, 0) for i in range(n)], seed=seed, with_logits=True)
    return prompts, out


def unpacked_log_probs(model, prompts, completions, llm=None):
    """Each sample alone through the HF model (no packing, full logits): the reference log-probs [n]."""
    llm = model.llm if llm is None else llm
    values = []
    for prompt, completion in zip(prompts, completions):
        ids = torch.tensor([list(prompt) + list(completion)])
        logits = llm(input_ids=ids).logits[0, len(prompt) - 1:-1].float() / TEMPERATURE  # [len(completion), vocab]
        values.append(torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None]).squeeze(1))
    return torch.cat(values)


def batch_of(model, prompts, completions, advantages=None, loss_mask=None, max_packed_length=None):
    n = len(prompts)
    advantages = torch.zeros(n) if advantages is None else advantages
    loss_mask = torch.ones(n) if loss_mask is None else loss_mask
    return rollout_batch(prompts, completions, advantages, loss_mask, model.pad_id, max_packed_length)


@pytest.mark.parametrize("packed", [None, 80], ids=["one_row", "rows_of_80"])
@pytest.mark.parametrize("implementation", ["chunked", "unchunked"])
def test_training_log_probs_equal_an_unpacked_forward(make_grpo, packed, implementation):
    model = make_grpo(temperature=TEMPERATURE, max_completion_length=10, loss_implementation=implementation,
                      loss_chunk_size=7)
    with torch.no_grad():
        for name, param in model.llm.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)  # the adapter matters in both forwards
    prompts, out = samples(model)
    data = batch_of(model, prompts, out.ids, max_packed_length=packed)
    rows = data["input_ids"].shape[0]
    assert rows == 1 if packed is None else 1 < rows < len(prompts)  # rows of several samples
    with torch.no_grad():
        packed_logps = model.completion_log_probs(data)
        expected = unpacked_log_probs(model, prompts, out.ids)
    # the packed order is row by row; each completion's tokens stay in order
    sequence_of = completion_positions(data)[2]
    for s, completion in enumerate(out.ids):
        assert (sequence_of == s).sum() == len(completion)
    order = torch.cat([torch.nonzero(torch.repeat_interleave(torch.arange(6), torch.tensor(list(map(len, out.ids))))
                                     == s).squeeze(1) for s in sequence_of.unique_consecutive().tolist()])
    torch.testing.assert_close(packed_logps, expected[order], rtol=0, atol=2e-6)


def test_training_log_probs_equal_the_generations_own_scores(make_grpo):
    """generate's raw logits (KV cache, left padding) at the sampling temperature give the same log-probs
    as the packed training forward, within 1e-5 (float32: different kernels and summation orders)."""
    model = make_grpo(temperature=TEMPERATURE, max_completion_length=10)
    prompts, out = samples(model)
    with torch.no_grad():
        trained = model.completion_log_probs(batch_of(model, prompts, out.ids))
    scored = torch.cat([torch.log_softmax(logits / TEMPERATURE, -1).gather(1, torch.tensor(ids)[:, None]).squeeze(1)
                        for logits, ids in zip(out.logits, out.ids)])
    assert any(not t for t in out.truncated) or len(set(map(len, out.ids))) == 1
    torch.testing.assert_close(trained, scored, rtol=0, atol=1e-5)


def trainable(model):
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("loss_type,level,beta", [("grpo", "token", 0.04), ("bnpo", "sequence", 0.0),
                                                  ("dr_grpo", "token", 0.0), ("dapo", "sequence", 0.04)])
def test_loss_and_gradient_equal_the_formula_on_the_models_log_probs(make_grpo, loss_type, level, beta):
    """compute_loss against the published formula (tests/model/test_grpo_loss.py's reference, in TRL's padded
    layout) evaluated on unpacked log-probs, in value and in the adapter's gradient; with a sampling
    policy that differs (mu > 1) and a reference (beta > 0); one completion masked as truncated."""
    from test_grpo_loss import reference_loss

    model = make_grpo(temperature=TEMPERATURE, max_completion_length=10, loss_type=loss_type,
                      importance_sampling_level=level, beta=beta, epsilon=0.2, epsilon_high=0.28)
    prompts, out = samples(model)
    n = len(prompts)
    advantages = torch.tensor([1.0, -0.5, 0.3, -1.2, 0.8, 0.0])
    loss_mask = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 1.0])
    data = batch_of(model, prompts, out.ids, advantages, loss_mask)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        base = model.completion_log_probs(data)
    data["old_logps"] = base + 0.3 * torch.randn(base.shape, generator=g)
    data["ref_logps"] = base + 0.2 * torch.randn(base.shape, generator=g)
    model.zero_grad()
    loss = model.compute_loss(data)["loss"]
    loss.backward()
    ours = {k: p.grad.clone() for k, p in trainable(model).items()}

    model.zero_grad()
    lengths = [len(c) for c in out.ids]
    T = max(lengths)

    def padded(flat):
        rows = torch.split(flat, lengths)
        return torch.stack([torch.cat([r, r.new_zeros(T - len(r))]) for r in rows]).double()

    mask = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).double() * loss_mask[:, None].double()
    with torch.enable_grad():
        logps = unpacked_log_probs(model, prompts, out.ids)
    expected = reference_loss(padded(logps), padded(data["old_logps"]), padded(data["ref_logps"]),
                              advantages.double(), mask, loss_type, level, 0.2, 0.28, beta)
    if loss_type == "dr_grpo":  # the reference's constant is the test module's; rescale to this model's
        from test_grpo_loss import MAX_COMPLETION_LENGTH
        expected = expected * MAX_COMPLETION_LENGTH / 10
    expected.backward()
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-7)
    for k, p in trainable(model).items():
        torch.testing.assert_close(ours[k], p.grad, rtol=1e-4, atol=1e-7, msg=k)
    assert n == 6


def test_groups_of_equal_rewards_give_exactly_zero_gradient(make_grpo):
    """Advantages of an all-equal group are exactly 0; with beta 0 nothing else enters the loss."""
    model = make_grpo(max_completion_length=8)
    prompts, out = samples(model, n=4)
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.1, 2.0, 2.0, 2.0, 2.0], dtype=torch.float64)
    advantages = G.group_advantages(rewards, 4)
    data = batch_of(model, prompts * 2, out.ids * 2, advantages)
    model.zero_grad()
    model.compute_loss(data)["loss"].backward()
    grads = [p.grad for p in trainable(model).values()]
    assert all(g is not None and torch.equal(g, torch.zeros_like(g)) for g in grads)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_any_micro_batch_split_gives_the_steps_gradient(make_grpo, loss_type):
    """The step's completions in one micro-batch, or split 2 + 1 + 3 with the loss normaliser the loop sets
    (the step's units over all its micro-batches): the same gradient."""
    model = make_grpo(max_completion_length=10, loss_type=loss_type, beta=0.04, temperature=TEMPERATURE)
    prompts, out = samples(model)
    advantages = torch.tensor([1.0, -0.5, 0.3, -1.2, 0.8, -0.4])
    loss_mask = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, 1.0])

    def step(parts):
        model.zero_grad()
        batches = []
        for part in parts:
            data = batch_of(model, [prompts[i] for i in part], [out.ids[i] for i in part], advantages[part],
                            loss_mask[part])
            data["ref_logps"] = model.reference_log_probs(data) - 0.1
            batches.append(data)
        units = sum(model.count_loss_units(d) for d in batches)
        for data in batches:
            data["loss_normalizer"] = units
            model.compute_loss(data)["loss"].backward()
        return {k: p.grad.clone() for k, p in trainable(model).items()}

    whole, split = step([list(range(6))]), step([[0, 1], [2], [3, 4, 5]])
    for k in whole:
        torch.testing.assert_close(split[k], whole[k], rtol=1e-5, atol=1e-8, msg=k)


def test_the_reference_is_the_base_model_for_lora_and_a_frozen_copy_for_full_fine_tuning(make_grpo):
    lora = make_grpo(beta=0.1, temperature=TEMPERATURE)
    assert lora.ref_llm is None
    with torch.no_grad():
        for name, param in lora.llm.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    prompts, out = samples(lora, n=3)
    data = batch_of(lora, prompts, out.ids)
    with torch.no_grad(), lora.llm.disable_adapter():
        base = unpacked_log_probs(lora, prompts, out.ids)
    torch.testing.assert_close(lora.reference_log_probs(data), base, rtol=0, atol=2e-6)

    full = make_grpo(lora=False, beta=0.1)
    assert full.ref_llm is not None and not any(p.requires_grad for p in full.ref_llm.parameters())
    start = full.reference_log_probs(data)
    with torch.no_grad():
        for param in full.llm.parameters():
            param.add_(0.01)  # training moves the policy, not the reference
    assert torch.equal(full.reference_log_probs(data), start)
    assert not any(k.startswith("ref_llm.") for k in full.state_dict())
    full.train()
    assert not full.ref_llm.training
    assert make_grpo(lora=False, beta=0.0).ref_llm is None  # beta 0: no reference kept


@pytest.mark.parametrize("kwargs,message", [
    (dict(num_generations=1), "model.num_generations must be an integer >= 2"),
    (dict(temperature=0), "model.temperature must be > 0 (GRPO samples), got 0"),
    (dict(loss_type="ppo"), "model.loss_type must be one of 'grpo', 'bnpo', 'dr_grpo', 'dapo', got 'ppo'"),
    (dict(importance_sampling_level="seq"), "model.importance_sampling_level must be one of 'token', 'sequence'"),
    (dict(scale_rewards=True), "model.scale_rewards must be one of 'group', 'batch', 'none', got True"),
    (dict(top_p=1.5, beta=-1), "model.top_p must be in (0, 1], got 1.5; model.beta must be >= 0, got -1"),
    (dict(ref_llm=dict(type="x")), "model.ref_llm: a reference model is used only by full fine-tuning with beta > 0"),
])
def test_bad_settings_are_one_line_naming_the_key(make_grpo, kwargs, message):
    with pytest.raises(ConfigBuildError) as err:
        make_grpo(**kwargs)
    assert str(err.value).startswith(message)
