"""``GRPO``: online RL from rewards (GRPO and its successors: DAPO, Dr. GRPO, GSPO), see docs/rl.md.

It is :class:`SupervisedFinetune` with another loss and two more abilities: sampling completions
(``generate``, through a rollout engine, ``sfttool.model.rollout``) and scoring them (the reward
functions, ``sfttool.model.rewards``). The train loop (``sfttool.engine.grpo_loop.GRPOLoop``) runs a
generation round, then passes over its completions in micro-batches.

A micro-batch (``rollout_batch``) packs prompt + completion samples into rows as SFT packs samples:
``position_ids`` restart at every sample, so samples never attend to each other; labels are -100 on
the prompt, the completion's ids on the completion; ``sequence_ids`` numbers each token's sample.
The completion tokens' log-probs come from the training forward (the chunked head), at the sampling
temperature, for the policy, for the policy that sampled (``old_logps``, when it differs from the
current one: ``num_iterations`` > 1 or a round of several optimizer steps) and for the reference
(``ref_logps``, only when ``beta`` > 0: the base model with the adapter switched off for LoRA, a frozen
copy of the starting weights for full fine-tuning).
"""
from __future__ import annotations

import copy
from typing import Any, Sequence

import numpy as np
import torch
from mmengine.logging import print_log

from sfttool.dataset.pack import best_fit_decreasing
from sfttool.model import grpo_loss as G
from sfttool.model.build import build_llm
from sfttool.model.loss import IGNORE_INDEX, shift_targets
from sfttool.model.rewards import accuracy_backend, resolve_reward_funcs
from sfttool.model.rollout import HFRollout, SamplingSettings, check_rollout_engine, stop_ids_of
from sfttool.model.rollout_vllm import VLLMRollout, check_vllm_model
from sfttool.model.sft import SupervisedFinetune
from sfttool.model.step_metrics import step_metrics
from sfttool.registry import BUILDER, ConfigBuildError, build_if_config


# Per-micro-batch sums the model returns beside the loss; the loop adds them up over the optimizer step.
STATS_PREFIX = "stats/"


@BUILDER.register_module()
class GRPO(SupervisedFinetune):
    """Group-relative policy optimisation; every setting is named as in TRL's ``GRPOConfig``.

    Args (besides :class:`SupervisedFinetune`'s):
        reward_funcs: reward functions (``sfttool.model.rewards``); ``reward_weights`` their weights.
        tokenizer: the tokenizer (required: completions are decoded for the reward functions).
        num_generations: completions per prompt (the group).
        max_completion_length: tokens a completion may have.
        temperature, top_p: sampling; log-probs are those of ``softmax(logits / temperature)``.
        rollout_engine: ``'hf'`` (transformers' generate) or ``'vllm'``.
        beta: KL coefficient against the reference; 0 keeps and runs no reference.
        epsilon, epsilon_high: the clip range ``[1 - epsilon, 1 + epsilon_high]`` (``epsilon_high``
            None: ``epsilon``).
        loss_type: ``'grpo'``, ``'bnpo'``, ``'dr_grpo'`` or ``'dapo'`` (``sfttool.model.grpo_loss``).
        importance_sampling_level: ``'token'``, or ``'sequence'`` (GSPO).
        scale_rewards: ``'group'``, ``'batch'`` or ``'none'``.
        mask_truncated_completions: completions without a stop token add nothing to the loss.
        ref_llm: full fine-tuning with ``beta`` > 0: the reference model or its config (None copies ``llm``).
        max_packed_length: tokens per packed row of a micro-batch (None: the whole micro-batch in one row).
        stop_token_ids: token ids that end a completion, besides the tokenizer's EOS and the model's
            generation-config EOS ids.
        vllm_gpu_memory_utilization, vllm_max_model_len, vllm_enable_sleep_mode: the vLLM engine's share of
            the GPU memory, context length (None: the model's) and whether it frees its memory while training
            runs (``sfttool.model.rollout_vllm``).
    """

    build_args_lazily = ("llm", "ref_llm")
    unsaved_modules = ("ref_llm",)  # the frozen reference is rebuilt from its source at start

    def __init__(self, llm, reward_funcs, tokenizer, reward_weights=None, num_generations=8, max_completion_length=256,
                 temperature=1.0, top_p=1.0, rollout_engine="hf", beta=0.0, epsilon=0.2, epsilon_high=None,
                 loss_type="dapo", importance_sampling_level="token", scale_rewards="group",
                 mask_truncated_completions=False, ref_llm=None, max_packed_length=None, stop_token_ids=(),
                 vllm_gpu_memory_utilization=0.3, vllm_max_model_len=None, vllm_enable_sleep_mode=False,
                 **sft_args):
        check_grpo_args(num_generations, max_completion_length, temperature, top_p, beta, epsilon, epsilon_high,
                        loss_type, importance_sampling_level, scale_rewards, max_packed_length)
        check_rollout_engine(rollout_engine)
        if ref_llm is not None and (beta == 0 or sft_args.get("lora") is not None):
            raise ConfigBuildError("model.ref_llm: a reference model is used only by full fine-tuning with beta > 0 "
                                   "(with LoRA the reference is the base model with the adapter disabled); remove it")
        self.tokenizer = build_if_config(tokenizer, "model.tokenizer")
        super().__init__(llm, tokenizer=self.tokenizer, **sft_args)
        self.rewards = resolve_reward_funcs(reward_funcs, reward_weights, max_completion_length)
        if any(r.name == "accuracy" for r in self.rewards):  # in the run's log: which verifier the rewards used
            print_log(f"accuracy reward: compares final answers with {accuracy_backend()}", logger="current")
        self.num_generations, self.max_completion_length = num_generations, max_completion_length
        self.temperature, self.top_p, self.rollout_engine = float(temperature), float(top_p), rollout_engine
        self.beta, self.epsilon_low = float(beta), float(epsilon)
        self.epsilon_high = float(epsilon if epsilon_high is None else epsilon_high)
        self.loss_type, self.importance_sampling_level = loss_type, importance_sampling_level
        self.scale_rewards, self.mask_truncated_completions = scale_rewards, bool(mask_truncated_completions)
        self.max_packed_length = max_packed_length
        self.stop_ids = stop_ids_of(self.tokenizer, self.llm, stop_token_ids)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.stop_ids[0]
        self.ref_llm = None
        if self.beta > 0 and not self.use_lora:
            self.ref_llm = self._build_reference(ref_llm, sft_args.get("max_position_embeddings"))
        self.vllm_options = dict(gpu_memory_utilization=vllm_gpu_memory_utilization, max_model_len=vllm_max_model_len,
                                 enable_sleep_mode=vllm_enable_sleep_mode)
        if rollout_engine == "vllm":
            check_vllm_model(self.llm)
        self._engine = None

    def _build_reference(self, ref_llm: Any, max_position_embeddings: Any):
        ref = copy.deepcopy(self.llm) if ref_llm is None else build_llm(ref_llm, self.use_varlen_attn,
                                                                         max_position_embeddings)
        ref.config.use_cache = False
        ref.requires_grad_(False)
        return ref.eval()

    def train(self, mode: bool = True):
        super().train(mode)
        if getattr(self, "ref_llm", None) is not None:
            self.ref_llm.eval()  # the reference never drops out
        return self

    # -- rollouts ---------------------------------------------------------

    def engine(self, synced_gpus: bool = False):
        """The rollout engine (built on first use: vLLM needs the device the run trains on)."""
        if self._engine is None:
            if self.rollout_engine == "vllm":
                self._engine = VLLMRollout(self, self.stop_ids, **self.vllm_options)
            else:
                self._engine = HFRollout(self.tokenizer, self.stop_ids)
        self._engine.synced_gpus = synced_gpus
        return self._engine

    @torch.no_grad()
    def generate_completions(self, prompt_ids: Sequence[Sequence[int]], keys: Sequence[Sequence[int]], seed: int,
                             synced_gpus: bool = False, with_logits: bool = False):
        """Sample one completion of ``prompt_ids[i]`` with the uniforms of ``keys[i]`` (``rollout``), in eval mode."""
        was_training = self.training
        self.eval()
        try:
            settings = SamplingSettings(self.max_completion_length, self.temperature, self.top_p, seed)
            return self.engine(synced_gpus).generate(self.llm, prompt_ids, keys, settings, with_logits)
        finally:
            self.train(was_training)

    def decode(self, completion_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(completion_ids, skip_special_tokens=True)

    # -- micro-batches and their log-probs --------------------------------

    def rollout_batch(self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
                      advantages: torch.Tensor, loss_mask: torch.Tensor) -> dict:
        """Samples (prompt + completion) packed into rows (see the module docstring), with the
        per-completion ``advantages`` [S] and ``loss_mask`` [S] (0: adds nothing to the loss)."""
        return rollout_batch(prompts, completions, advantages, loss_mask, self.pad_id, self.max_packed_length)

    def completion_log_probs(self, data: dict, llm: Any = None) -> torch.Tensor:
        """Per-token log-probs [n] of the batch's completions under ``llm`` (the policy by default)."""
        keep, targets, _ = completion_positions(data)
        return self.trained_token_log_probs(data, keep, targets, llm, temperature=self.temperature)

    @torch.no_grad()
    def old_log_probs(self, data: dict) -> torch.Tensor:
        """The sampling policy's log-probs (no dropout), before any update of this round."""
        was_training = self.training
        self.eval()
        try:
            return self.completion_log_probs(data).float()
        finally:
            self.train(was_training)

    @torch.no_grad()
    def reference_log_probs(self, data: dict) -> torch.Tensor:
        if self.ref_llm is not None:
            return self.completion_log_probs(data, self.ref_llm).float()
        was_training = self.training
        self.eval()
        try:
            with self.llm.disable_adapter():
                return self.completion_log_probs(data).float()
        finally:
            self.train(was_training)

    # -- the loss ---------------------------------------------------------

    def count_loss_units(self, data: dict) -> int:
        """The micro-batch's share of the step's loss denominator (``grpo_loss.loss_units``)."""
        if "advantages" not in data and isinstance(data.get("data"), dict):
            data = data["data"]
        weights = data["loss_mask"].float() * data["completion_lengths"].float()  # masked tokens per completion
        units = G.loss_units(self.loss_type, len(data["advantages"]), weights, self.max_completion_length)
        return units

    def compute_loss(self, data: dict) -> dict:
        keep, targets, sequence_of = completion_positions(data)
        count = len(data["advantages"])
        logps = self.trained_token_log_probs(data, keep, targets, temperature=self.temperature)  # [n]
        old = data.get("old_logps")
        old = logps.detach() if old is None else old.to(logps)  # the first pass of a one-step round: ratio 1
        weights = data["loss_mask"].to(logps)[sequence_of]  # [n]
        ref = data["ref_logps"].to(logps) if self.beta > 0 else None
        token_loss, low, high, kl = G.per_token_loss(
            logps, old, ref, data["advantages"].to(logps)[sequence_of], weights, sequence_of, count,
            self.importance_sampling_level, self.epsilon_low, self.epsilon_high, self.beta)
        stats = {"tokens": weights.sum(), "clipped_low": (low * weights).sum(), "clipped_high": (high * weights).sum()}
        if kl is not None:
            stats["kl"] = (kl.detach() * weights).sum()
        total = G.aggregate(token_loss, weights, sequence_of, count, self.loss_type)
        # backward: this micro-batch's share of the step's loss; shown: the step's loss, from sums and units
        out = {"loss": self.normalize(total, data), **step_metrics(loss=(total, self.count_loss_units(data)))}
        out.update({STATS_PREFIX + name: value.detach().double() for name, value in stats.items()})
        return out


def completion_positions(data: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(keep [rows, seq], targets [n], sequence_of [n])``: the positions that predict a completion token,
    the tokens, and each one's completion (row-major, the order of ``trained_token_log_probs``)."""
    targets = shift_targets(data["labels"], data["position_ids"])
    keep = targets != IGNORE_INDEX
    return keep, targets[keep], data["sequence_ids"][keep]


def rollout_batch(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], advantages: torch.Tensor,
                  loss_mask: torch.Tensor, pad_id: int, max_packed_length: int | None = None) -> dict:
    """Pack samples into rows of at most ``max_packed_length`` tokens (best fit decreasing; None: one row),
    padded right as SFT pads (padding is its own pseudo-sample, labels -100, ``sequence_ids`` -1).

    >>> rollout_batch([[5, 6]], [[7, 2]], torch.zeros(1), torch.ones(1), 0)['labels'].tolist()
    [[-100, -100, 7, 2]]
    """
    lengths = np.array([len(p) + len(c) for p, c in zip(prompts, completions)], dtype=np.int64)
    bins = [list(range(len(lengths)))] if max_packed_length is None else \
        best_fit_decreasing(lengths, max(int(max_packed_length), int(lengths.max())))
    width = max(int(lengths[b].sum()) for b in bins)
    rows = {name: [] for name in ("input_ids", "labels", "position_ids", "sequence_ids")}
    for members in bins:
        row = {name: [] for name in rows}
        for s in sorted(members):
            prompt, completion = list(prompts[s]), list(completions[s])
            row["input_ids"] += prompt + completion
            row["labels"] += [IGNORE_INDEX] * len(prompt) + completion
            row["position_ids"] += list(range(len(prompt) + len(completion)))
            row["sequence_ids"] += [s] * (len(prompt) + len(completion))
        pad = width - len(row["input_ids"])
        for name, value in (("input_ids", pad_id), ("labels", IGNORE_INDEX), ("sequence_ids", -1)):
            rows[name].append(row[name] + [value] * pad)
        rows["position_ids"].append(row["position_ids"] + list(range(pad)))
    data = {name: torch.tensor(values, dtype=torch.long) for name, values in rows.items()}  # [rows, width]
    data.update(advantages=advantages.float(), loss_mask=loss_mask.float(),
                completion_lengths=torch.tensor([len(c) for c in completions], dtype=torch.long))
    return data


def check_grpo_args(num_generations, max_completion_length, temperature, top_p, beta, epsilon, epsilon_high,
                    loss_type, importance_sampling_level, scale_rewards, max_packed_length) -> None:
    """Each setting in its range, or one line naming it and the fix."""
    def number(value):
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    def positive_int(value):
        return isinstance(value, int) and not isinstance(value, bool) and value >= 1

    problems = []
    if not positive_int(num_generations) or num_generations < 2:
        problems.append(f"num_generations must be an integer >= 2 (a group compares completions), got "
                        f"{num_generations!r}")
    if not positive_int(max_completion_length):
        problems.append(f"max_completion_length must be a positive integer, got {max_completion_length!r}")
    if not number(temperature) or temperature <= 0:
        problems.append(f"temperature must be > 0 (GRPO samples), got {temperature!r}")
    if not number(top_p) or not 0 < top_p <= 1:
        problems.append(f"top_p must be in (0, 1], got {top_p!r}")
    if not number(beta) or beta < 0:
        problems.append(f"beta must be >= 0, got {beta!r}")
    for name, value in (("epsilon", epsilon), ("epsilon_high", epsilon_high)):
        if value is not None and (not number(value) or value < 0):
            problems.append(f"{name} must be >= 0, got {value!r}")
    for name, value, allowed in (("loss_type", loss_type, G.LOSS_TYPES),
                                 ("importance_sampling_level", importance_sampling_level, G.IMPORTANCE_SAMPLING_LEVELS),
                                 ("scale_rewards", scale_rewards, G.SCALE_REWARDS)):
        if value not in allowed:
            problems.append(f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")
    if max_packed_length is not None and not positive_int(max_packed_length):
        problems.append(f"max_packed_length must be a positive integer or None, got {max_packed_length!r}")
    if problems:
        raise ConfigBuildError("; ".join(f"model.{p}" for p in problems))
