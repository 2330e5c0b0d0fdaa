"""Rollouts: seeded per-completion sampling (the distribution, independence from the batch), stop tokens,
the policy's current weights (LoRA included), the model's own generation config kept out, vLLM's refusal."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from sfttool.model import rollout as RO
from sfttool.registry import ConfigBuildError


def reference_sample(logits: np.ndarray, u: float, temperature: float, top_p: float) -> int:
    """Inverse-CDF sampling written out: softmax at the temperature; top-p keeps the most likely tokens
    until their mass reaches top_p (transformers' rule: drop those whose ascending cumulative mass is
    <= 1 - top_p); the token where u * mass falls in the cumulative distribution, in vocabulary order."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p < 1:
        order = np.argsort(p, kind="stable")
        drop = np.cumsum(p[order]) <= 1 - top_p
        drop[-1] = False
        p = p.copy()
        p[order[drop]] = 0.0
    cdf = np.cumsum(p)
    return int(np.searchsorted(cdf, u * cdf[-1], side="right"))


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.3, 0.8), (1.0, 0.5)])
def test_sampling_inverts_the_cumulative_distribution(temperature, top_p):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 11, generator=g) * 2
    uniforms = torch.rand(64, generator=g, dtype=torch.float64)
    got = RO.sample_from_uniforms(logits, uniforms, temperature, top_p).tolist()
    expected = [reference_sample(row.numpy(), u, temperature, top_p) for row, u in zip(logits, uniforms.tolist())]
    assert got == expected


def test_sampled_frequencies_follow_the_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0, 0.5]]).expand(20000, -1)
    uniforms = RO.completion_uniforms(7, [(0, 0, 0)], 20000)[0]
    tokens = RO.sample_from_uniforms(logits, uniforms, 1.0, 1.0)
    frequencies = torch.bincount(tokens, minlength=5).double() / 20000
    torch.testing.assert_close(frequencies, torch.softmax(logits[0].double(), 0), atol=0.01, rtol=0)


def test_uniforms_depend_on_the_seed_and_the_key_only():
    a = RO.completion_uniforms(42, [(0, 5, 1), (0, 5, 2)], 6)
    assert torch.equal(a[0], RO.completion_uniforms(42, [(0, 5, 1)], 6)[0])  # not on the other rows
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[0], RO.completion_uniforms(43, [(0, 5, 1)], 6)[0])
    assert torch.equal(RO.completion_uniforms(42, [(0, 5, 1)], 3)[0], a[0, :3])  # a longer draw extends a shorter


def prompts_of(tokenizer, *texts):
    return [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                          tokenize=True)["input_ids"] for t in texts]


def test_a_completion_does_not_depend_on_the_rest_of_the_batch(make_grpo):
    """The same prompt and key alone, or beside a longer prompt (so left-padded), or several times: the
    same tokens. Hence 1 or 2 processes, or another generation batch, sample the same completions."""
    model = make_grpo(max_completion_length=12)
    tok = model.tokenizer
    short, long = prompts_of(tok, "hi", "Tell me about the river and the old city at night?")
    alone = model.generate_completions([short] * 3, [(0, 1, k) for k in range(3)], seed=5)
    mixed = model.generate_completions([long, short, long, short, short], [(0, 2, 0), (0, 1, 0), (0, 2, 1),
                                                                         (0, 1, 1), (0, 1, 2)], seed=5)
    assert [mixed.ids[i] for i in (1, 3, 4)] == alone.ids
    assert len(set(map(tuple, alone.ids))) == 3  # three keys, three different completions
    again = model.generate_completions([short] * 3, [(0, 1, k) for k in range(3)], seed=5)
    other = model.generate_completions([short] * 3, [(0, 1, k) for k in range(3)], seed=6)
    assert again.ids == alone.ids and other.ids != alone.ids
    assert all(len(c) == 12 for c in alone.ids) and alone.truncated == [True] * 3


def test_completions_end_at_their_first_stop_token():
    generated = torch.tensor([[5, 2, 7, 2], [5, 6, 7, 8], [9, 9, 9, 0]])
    ids, truncated = RO.cut_completions(generated, [2, 3], 4)
    assert ids == [[5, 2], [5, 6, 7, 8], [9, 9, 9, 0]] and truncated == [False, True, True]


def test_generation_stops_at_any_stop_id(make_grpo):
    model = make_grpo(max_completion_length=8)
    every_token = list(range(len(model.tokenizer)))
    model.stop_ids = every_token  # whatever it samples first ends the completion
    model._engine = None
    out = model.generate_completions(prompts_of(model.tokenizer, "hi") * 4, [(0, 0, k) for k in range(4)], seed=1)
    assert [len(c) for c in out.ids] == [1] * 4 and out.truncated == [False] * 4


def test_the_models_own_generation_config_does_not_change_what_is_sampled(make_grpo):
    """Qwen ships repetition_penalty, top_k and temperature in its generation config; transformers would
    fill them into a sampling call that leaves them unset."""
    model = make_grpo(max_completion_length=10)
    prompts, keys = prompts_of(model.tokenizer, "hi") * 2, [(0, 0, 0), (0, 0, 1)]
    plain = model.generate_completions(prompts, keys, seed=2).ids
    config = model.llm.generation_config
    config.repetition_penalty, config.top_k, config.temperature, config.do_sample = 5.0, 1, 0.1, True
    assert model.generate_completions(prompts, keys, seed=2).ids == plain
    assert model.llm.generation_config.repetition_penalty == 5.0  # the model's own is put back


def test_generation_uses_the_current_adapter_weights(make_grpo):
    model = make_grpo(max_completion_length=10)
    prompts, keys = prompts_of(model.tokenizer, "hi") * 4, [(0, 0, k) for k in range(4)]
    base = model.generate_completions(prompts, keys, seed=2).ids
    with torch.no_grad():
        for name, param in model.llm.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 2.0)  # a trained adapter
    moved = model.generate_completions(prompts, keys, seed=2).ids
    with model.llm.disable_adapter():
        assert model.generate_completions(prompts, keys, seed=2).ids == base
    assert moved != base
    assert model.training  # generation ran in eval mode and put the training mode back


def test_vllm_without_vllm_or_a_gpu_is_refused_before_training(make_grpo):
    import importlib.util
    if importlib.util.find_spec("vllm") is not None and torch.cuda.is_available():
        pytest.skip("vLLM and a GPU are present here")
    expected = ("model.rollout_engine='vllm': vLLM is not installed (pip install 'sfttool[vllm]', on a machine with "
                "a CUDA GPU); or set rollout_engine='hf'") if importlib.util.find_spec("vllm") is None else \
        ("model.rollout_engine='vllm' needs a CUDA GPU and none is visible; set rollout_engine='hf' "
         "(transformers' generate runs on CPU too)")
    with pytest.raises(ConfigBuildError) as err:
        RO.check_rollout_engine("vllm")
    assert str(err.value) == expected
    with pytest.raises(ConfigBuildError) as err:
        make_grpo(rollout_engine="vllm")
    assert str(err.value) == expected
    with pytest.raises(ConfigBuildError, match="model.rollout_engine must be one of hf, vllm, got 'sglang'"):
        RO.check_rollout_engine("sglang")


def test_the_vllm_engine_gets_the_merged_weights_under_the_checkpoints_names(make_grpo, tiny_qwen2_dir):
    """What the vllm engine loads into vLLM (vLLM itself needs a GPU: benchmarks/gpu_check.sh runs it): every
    parameter of the base checkpoint, by its name there, the adapter merged in."""
    from transformers import AutoModelForCausalLM

    from sfttool.model.rollout_vllm import merged_weights
    model = make_grpo()
    with torch.no_grad():
        for name, param in model.llm.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    prompts = prompts_of(model.tokenizer, "hi")
    model.llm.merge_adapter()
    try:
        weights = {name: value.clone() for name, value in merged_weights(model.llm)}  # views: unmerge restores them
    finally:
        model.llm.unmerge_adapter()
    checkpoint = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32)
    assert weights.keys() == dict(checkpoint.named_parameters()).keys()
    checkpoint.load_state_dict(weights)
    ids = torch.tensor(prompts)
    with torch.no_grad():
        torch.testing.assert_close(checkpoint(input_ids=ids).logits, model.llm(input_ids=ids).logits,
                                   rtol=1e-5, atol=1e-5)


def test_vllm_outputs_become_completions_through_their_stop_token():
    from types import SimpleNamespace

    from sfttool.model.rollout_vllm import VLLMRollout, completion_seed
    engine = VLLMRollout(SimpleNamespace(llm=torch.nn.Linear(2, 2)), stop_ids=[2, 9])

    def out(ids, reason, stop=None):
        return SimpleNamespace(outputs=[SimpleNamespace(token_ids=ids, finish_reason=reason, stop_reason=stop)])

    got = engine._completions([out([5, 6, 2], "stop"), out([5, 6], "stop", 9), out([5, 6], "stop"),
                               out([5, 6, 7, 8], "length")], max_new_tokens=4)
    assert got.ids == [[5, 6, 2], [5, 6, 9], [5, 6, 2], [5, 6, 7, 8]] and got.truncated == [False, False, False, True]
    assert completion_seed(42, (0, 5, 1)) == completion_seed(42, (0, 5, 1)) != completion_seed(42, (0, 5, 2))
    assert 0 <= completion_seed(42, (3, 10**6, 7)) < 2**31
