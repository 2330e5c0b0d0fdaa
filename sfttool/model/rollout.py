"""Rollout engines: sample completions of prompts with the policy's current weights (LoRA included).

``HFRollout`` (the default, ``rollout_engine='hf'``) runs transformers' ``generate``: one left-padded
batch per generation round, with the KV cache, in eval mode and without gradients, on CPU or GPU.
``VLLMRollout`` (``'vllm'``, the ``sfttool[vllm]`` extra) lives in ``sfttool.model.rollout_vllm``.

Sampling is seeded per completion, not per batch: completion k of data row r in epoch e draws its
uniforms from ``numpy.random.default_rng([seed, e, r, k])``, one per generated token, and picks the
token where the uniform falls in the cumulative distribution (temperature, then top-p). Its tokens
therefore do not depend on which other prompts share the batch or on how many processes share
the round, and a resumed run samples what the uninterrupted one sampled.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from sfttool.registry import ConfigBuildError

ROLLOUT_ENGINES = ("hf", "vllm")


@dataclass
class SamplingSettings:
    max_completion_length: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0


@dataclass
class Completions:
    """What a rollout returns, one entry per requested completion."""
    ids: list[list[int]]  # the generated tokens, through the first stop token (included)
    truncated: list[bool]  # no stop token within max_completion_length
    logits: list[torch.Tensor] | None = None  # [len(ids[i]), vocab] raw logits, when asked for


def completion_uniforms(seed: int, keys: Sequence[Sequence[int]], length: int) -> torch.Tensor:
    """``[len(keys), length]`` float64 uniforms in [0, 1): row i from ``default_rng([seed, *keys[i]])`` (a
    negative seed taken modulo 2**64: numpy seeds with non-negative integers)."""
    seed %= 2 ** 64
    return torch.from_numpy(np.stack([np.random.default_rng([seed, *key]).random(length) for key in keys]))


def sample_from_uniforms(logits: torch.Tensor, uniforms: torch.Tensor, temperature: float,
                         top_p: float) -> torch.Tensor:
    """One token per row [B] from ``logits`` [B, vocab]: ``softmax(logits / temperature)`` restricted to
    the smallest set of most likely tokens whose mass reaches ``top_p`` (transformers' top-p), inverted
    at ``uniforms`` [B] through the cumulative distribution over the vocabulary's order."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # [B, vocab]
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1)  # ascending, as transformers' TopPLogitsWarper
        drop = sorted_probs.cumsum(dim=-1) <= 1 - top_p
        drop[:, -1] = False  # the most likely token always stays
        probs = probs.scatter(1, order, sorted_probs.masked_fill(drop, 0.0))
    cdf = probs.cumsum(dim=-1)  # [B, vocab] float32: one scan a step, as cheap as transformers' multinomial
    target = uniforms.to(cdf) * cdf[:, -1]
    return torch.searchsorted(cdf, target[:, None], right=True).squeeze(1).clamp(max=probs.shape[1] - 1)


class SeededSampling:
    """A transformers logits processor that samples each row from its own uniforms and hands
    ``generate`` (run greedily) scores whose only finite entry is the sampled token."""

    def __init__(self, uniforms: torch.Tensor, prompt_length: int, temperature: float, top_p: float):
        self.uniforms, self.prompt_length = uniforms, prompt_length  # [B, max_completion_length]
        self.temperature, self.top_p = temperature, top_p

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.prompt_length
        tokens = sample_from_uniforms(scores, self.uniforms[:, step].to(scores.device), self.temperature, self.top_p)
        picked = torch.full_like(scores, -torch.inf)
        return picked.scatter_(1, tokens[:, None], 0.0)


def stop_ids_of(tokenizer, llm: Any, extra: Sequence[int] = ()) -> list[int]:
    """The tokenizer's EOS, the model's generation-config EOS ids and ``extra``: where a completion ends."""
    ids = [tokenizer.eos_token_id, *extra]
    generation_eos = getattr(getattr(llm, "generation_config", None), "eos_token_id", None)
    ids += generation_eos if isinstance(generation_eos, list) else [generation_eos]
    return sorted({int(i) for i in ids if i is not None})


@contextlib.contextmanager
def plain_generation_config(llm: Any, config: Any) -> Iterator[None]:
    """Generate with ``config`` alone. transformers fills a setting the caller left unset from the model's
    own generation config (Qwen's ``repetition_penalty=1.05``, ``top_k=20``, ...), which would change the
    distribution sampled; the model's is swapped out for the call."""
    owners = [llm] + ([llm.get_base_model()] if hasattr(llm, "get_base_model") else [])
    saved = [(owner, owner.generation_config) for owner in owners if hasattr(owner, "generation_config")]
    try:
        for owner, _ in saved:
            owner.generation_config = config
        yield
    finally:
        for owner, previous in saved:
            owner.generation_config = previous


def cut_completions(generated: torch.Tensor, stop_ids: Sequence[int], max_new_tokens: int
                    ) -> tuple[list[list[int]], list[bool]]:
    """Rows of generated tokens [B, T] -> each through its first stop token, and whether it had none."""
    ids, truncated = [], []
    stops = torch.isin(generated, torch.tensor(list(stop_ids), device=generated.device))
    for row, row_stops in zip(generated.tolist(), stops):
        hits = row_stops.nonzero()
        end = int(hits[0]) + 1 if len(hits) else min(len(row), max_new_tokens)
        ids.append(row[:end])
        truncated.append(not len(hits))
    return ids, truncated


class HFRollout:
    """transformers ``generate`` over one left-padded batch (see the module docstring)."""

    name = "hf"

    def __init__(self, tokenizer, stop_ids: Sequence[int], synced_gpus: bool = False):
        self.tokenizer, self.stop_ids, self.synced_gpus = tokenizer, list(stop_ids), synced_gpus
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.stop_ids[0]

    def generation_config(self, max_new_tokens: int, with_logits: bool):
        from transformers import GenerationConfig
        return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1, use_cache=True,
                                eos_token_id=self.stop_ids, pad_token_id=self.pad_id,
                                bos_token_id=self.tokenizer.bos_token_id, repetition_penalty=1.0,
                                return_dict_in_generate=True, output_logits=with_logits)

    def left_padded(self, prompts: Sequence[Sequence[int]], device: Any) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)  # [B, prompt]
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, prompt in enumerate(prompts):
            ids[i, width - len(prompt):] = torch.tensor(list(prompt), dtype=torch.long)
            mask[i, width - len(prompt):] = 1
        return ids.to(device), mask.to(device)

    @torch.no_grad()
    def generate(self, llm: Any, prompts: Sequence[Sequence[int]], keys: Sequence[Sequence[int]],
                 settings: SamplingSettings, with_logits: bool = False) -> Completions:
        """``prompts[i]`` sampled with the uniforms of ``keys[i]`` (see the module docstring)."""
        device = next(llm.parameters()).device
        ids, mask = self.left_padded(prompts, device)
        uniforms = completion_uniforms(settings.seed, keys, settings.max_completion_length)
        sampler = SeededSampling(uniforms, ids.shape[1], settings.temperature, settings.top_p)
        config = self.generation_config(settings.max_completion_length, with_logits)
        with plain_generation_config(llm, config):
            out = llm.generate(input_ids=ids, attention_mask=mask, generation_config=config,
                               logits_processor=[sampler], synced_gpus=self.synced_gpus)
        generated = out.sequences[:, ids.shape[1]:]  # [B, generated]
        completions, truncated = cut_completions(generated, self.stop_ids, settings.max_completion_length)
        logits = None
        if with_logits:
            steps = torch.stack(out.logits, dim=1).float().cpu()  # [B, generated, vocab]
            logits = [steps[i, :len(c)] for i, c in enumerate(completions)]
        return Completions(completions, truncated, logits)


def check_rollout_engine(name: Any) -> None:
    """``rollout_engine``: 'hf', or 'vllm' where vLLM and a CUDA GPU are present; else one line saying why."""
    if name not in ROLLOUT_ENGINES:
        raise ConfigBuildError(f"model.rollout_engine must be one of {', '.join(ROLLOUT_ENGINES)}, got {name!r}")
    if name != "vllm":
        return
    import importlib.util
    if importlib.util.find_spec("vllm") is None:
        raise ConfigBuildError("model.rollout_engine='vllm': vLLM is not installed (pip install 'sfttool[vllm]', "
                               "on a machine with a CUDA GPU); or set rollout_engine='hf'")
    if not torch.cuda.is_available():
        raise ConfigBuildError("model.rollout_engine='vllm' needs a CUDA GPU and none is visible; "
                               "set rollout_engine='hf' (transformers' generate runs on CPU too)")
