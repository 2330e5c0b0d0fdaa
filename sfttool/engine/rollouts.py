"""One generation round of online RL (``GRPO``): generate -> score -> advantages -> micro-batches.

    round = build_round(model, prompt_rows, RoundSpec(index=3, epoch=0, seed=42, micro_batch_size=8))

Each process generates ``num_generations`` completions of each of its prompts (groups stay whole on
a process), scores them with every reward function, turns the weighted rewards into group-relative
advantages (``scale_rewards='batch'`` divides by the std over every process's rewards of the round),
and packs the completions, in order, into micro-batches of ``micro_batch_size``. Each micro-batch
carries what the loss needs (advantages, the reference's and the sampling policy's log-probs when
they are needed) and what the step's metrics are made of (rewards, lengths, truncation).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from sfttool.dataset.errors import ROW_COLUMN
from sfttool.dataset.prompts import ENCODED_COLUMNS
from sfttool.model.grpo_loss import group_advantages, unbiased_std
from sfttool.model.rewards import score_completions, total_rewards


@dataclass
class RoundSpec:
    index: int                    # rounds since the start of training
    epoch: int                    # the prompts' epoch (seeds the sampling)
    seed: int                     # the run's seed
    micro_batch_size: int         # completions per micro-batch
    need_old_log_probs: bool = False
    synced_gpus: bool = False     # DeepSpeed ZeRO-3: every process runs every generation step


@dataclass
class Round:
    index: int
    epoch: int
    micro_batches: list[dict]     # each a model batch (CPU tensors)
    groups: list[dict] = field(default_factory=list)  # per prompt: text, completions, rewards (for the log)


def _is_conversational(prompt: Any) -> bool:
    return isinstance(prompt, (list, tuple))


def reward_inputs(rows: list[dict], texts: list[str], completion_ids: list[list[int]],
                  num_generations: int) -> tuple[list, list, dict[str, list]]:
    """``(prompts, completions, columns)`` as reward functions take them (TRL's forms), a row's values
    repeated for each of its completions."""
    repeat = [row for row in rows for _ in range(num_generations)]
    prompts = [row["prompt"] for row in repeat]
    completions = [[{"role": "assistant", "content": t}] if _is_conversational(p) else t
                   for p, t in zip(prompts, texts)]
    names = [c for c in rows[0] if c not in (*ENCODED_COLUMNS, ROW_COLUMN, "prompt")]
    return prompts, completions, {name: [row.get(name) for row in repeat] for name in names}


def batch_reward_std(totals: torch.Tensor) -> float:
    """The unbiased std of the round's rewards over every process (``scale_rewards='batch'``)."""
    from mmengine.dist import all_gather_object
    everything = torch.cat(all_gather_object(totals.double().cpu()))  # rank order
    return float(unbiased_std(everything[None])[0, 0])


def build_round(model: Any, rows: list[dict], spec: RoundSpec) -> Round:
    """The round of ``rows`` (prompt rows of this process): see the module docstring."""
    G = model.num_generations
    prompt_ids = [list(row["prompt_ids"]) for row in rows for _ in range(G)]
    keys = [(spec.epoch, int(row[ROW_COLUMN]), k) for row in rows for k in range(G)]
    completions = model.generate_completions(prompt_ids, keys, spec.seed, spec.synced_gpus)
    texts = [model.decode(ids) for ids in completions.ids]
    prompts, reward_completions, columns = reward_inputs(rows, texts, completions.ids, G)
    labels = [f"row {row} (completion {k + 1} of {G})" for _, row, k in keys]
    per_function = score_completions(model.rewards, prompts, reward_completions, completions.ids, columns, labels)
    totals = total_rewards(per_function, model.rewards)  # [N]
    batch_std = batch_reward_std(totals) if model.scale_rewards == "batch" else None
    advantages = group_advantages(totals, G, model.scale_rewards, batch_std)
    truncated = torch.tensor(completions.truncated, dtype=torch.bool)
    loss_mask = (~truncated if model.mask_truncated_completions else torch.ones_like(truncated)).float()
    group_std = unbiased_std(totals.view(-1, G)).expand(-1, G).reshape(-1)  # [N]: each completion's group's
    batches = []
    for start in range(0, len(prompt_ids), spec.micro_batch_size):
        part = slice(start, start + spec.micro_batch_size)
        data = model.rollout_batch(prompt_ids[part], completions.ids[part], advantages[part], loss_mask[part])
        data.update(rewards=totals[part], reward_parts=per_function[part], group_std=group_std[part],
                    truncated=truncated[part])
        batches.append(with_log_probs(model, data, spec.need_old_log_probs))
    groups = [dict(row=int(row[ROW_COLUMN]), prompt=model.tokenizer.decode(row["prompt_ids"]),
                   completions=texts[i * G:(i + 1) * G], rewards=totals[i * G:(i + 1) * G].tolist(),
                   reward_parts=[[None if v != v else v for v in parts]  # None: the function did not apply
                                 for parts in per_function[i * G:(i + 1) * G].tolist()],
                   advantages=advantages[i * G:(i + 1) * G].tolist()) for i, row in enumerate(rows)]
    return Round(spec.index, spec.epoch, batches, groups)


def with_log_probs(model: Any, data: dict, need_old: bool) -> dict:
    """The micro-batch with the sampling policy's (``old_logps``) and the reference's (``ref_logps``)
    log-probs of its completion tokens, computed on the model's device and kept on the CPU."""
    if not need_old and model.beta == 0:
        return data
    device = next(model.parameters()).device
    on_device = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in data.items()}
    if need_old:
        data["old_logps"] = model.old_log_probs(on_device).cpu()
    if model.beta > 0:
        data["ref_logps"] = model.reference_log_probs(on_device).cpu()
    return data


# ---------------------------------------------------------------------------
# What the log shows of a round.

def format_group(group: dict, reward_names: list[str]) -> str:
    """A prompt and its completions, each with its reward (and each function's part) and advantage."""
    lines = [f"prompt (row {group['row']}):", group["prompt"]]
    for k, text in enumerate(group["completions"]):
        parts = ", ".join(f"{name} {'-' if v is None else f'{v:.3g}'}"
                          for name, v in zip(reward_names, group["reward_parts"][k]))
        lines.append(f"--- completion {k + 1}: reward {group['rewards'][k]:.3g} ({parts}), advantage "
                     f"{group['advantages'][k]:+.3f}")
        lines.append(text)
    return "\n".join(lines)


def write_groups(work_dir: str, step: int, groups: list[dict]) -> str:
    """``work_dir/completions/step_<step>.jsonl``: one group per line. Returns the path."""
    folder = os.path.join(work_dir, "completions")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"step_{step}.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for group in groups:
            f.write(json.dumps(dict(group, step=step), ensure_ascii=False) + "\n")
    return path
