"""GRPO's objective and its successors' (DAPO, Dr. GRPO, GSPO), as pure functions (see docs/rl.md).

Tokens are flat here: a per-token tensor is ``[n]``, in the order the packed forward gives the
micro-batch's completion tokens, and ``sequence_of`` ``[n]`` numbers each token's completion
(0 .. S-1). ``weights`` ``[n]`` is 1 for a token that counts in the loss, 0 for one that does not
(the tokens of a truncated completion under ``mask_truncated_completions``).

Per token, with r the importance ratio to the policy that sampled, A the completion's advantage::

    loss_t = -min(r_t A, clip(r_t, 1 - epsilon, 1 + epsilon_high) A) + beta * KL_t
    KL_t   = exp(ref_t - logp_t) - (ref_t - logp_t) - 1                     (the k3 estimator)
    r_t    = exp(logp_t - old_t)                    importance_sampling_level='token'
    r_t    = exp(mean over the completion of (logp - old))                 'sequence' (GSPO)

and the step's loss divides the summed token losses by ``loss_units`` of the whole step:

    grpo     sum over completions of their token mean      / completions
    bnpo     token sum of the micro-batch / its tokens     / micro-batches
    dr_grpo  token sum                                     / (completions * max_completion_length)
    dapo     token sum                                     / tokens

``aggregate`` returns each micro-batch's share of the numerator and ``loss_units`` its share of the
denominator; the train loop adds the units up over the optimizer step and the processes.
"""
from __future__ import annotations

import torch

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
SCALE_REWARDS = ("group", "batch", "none")
STD_EPS = 1e-4  # added to the std an advantage is divided by (TRL's value)


def group_advantages(rewards: torch.Tensor, group_size: int, scale_rewards: str = "group",
                     batch_std: float | None = None) -> torch.Tensor:
    """Advantages [N] float32 of rewards [N] laid out group after group.

    >>> group_advantages(torch.tensor([1., 0., 1., 1.], dtype=torch.float64), 2).tolist()
    [0.707..., -0.707..., 0.0, 0.0]

    ``A = r - mean(group)``, divided by the group's std (``'group'``), by ``batch_std`` (``'batch'``:
    the std over the whole generation round of every process) or by nothing (``'none'``), each std
    plus ``STD_EPS``; stds are unbiased (Bessel's correction). A group whose rewards are all equal
    gets exactly 0, not the rounding left by ``r - mean``.
    """
    groups = rewards.double().view(-1, group_size)  # [groups, G]
    advantages = groups - groups.mean(1, keepdim=True)
    if scale_rewards == "group":
        advantages = advantages / (unbiased_std(groups) + STD_EPS)
    elif scale_rewards == "batch":
        advantages = advantages / ((batch_std if batch_std is not None else 0.0) + STD_EPS)
    elif scale_rewards != "none":
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}")
    constant = groups.amax(1) == groups.amin(1)  # [groups]
    advantages[constant] = 0.0
    return advantages.reshape(-1).float()


def unbiased_std(groups: torch.Tensor) -> torch.Tensor:
    """Unbiased std of each row, [rows, 1]; 0 for rows of one value."""
    if groups.shape[1] < 2:
        return groups.new_zeros(groups.shape[0], 1)
    return groups.std(1, keepdim=True)


def sequence_mean(values: torch.Tensor, weights: torch.Tensor, sequence_of: torch.Tensor,
                  num_sequences: int) -> torch.Tensor:
    """Each completion's weighted token mean, [S]: ``sum(w v) / max(sum(w), 1)``."""
    sums = values.new_zeros(num_sequences).index_add(0, sequence_of, values * weights)
    counts = values.new_zeros(num_sequences).index_add(0, sequence_of, weights)
    return sums / counts.clamp(min=1.0)


def importance_log_ratio(logps: torch.Tensor, old_logps: torch.Tensor, weights: torch.Tensor,
                         sequence_of: torch.Tensor, num_sequences: int, level: str = "token") -> torch.Tensor:
    """``log r`` per token, [n]: the token's own log-ratio, or (GSPO) its completion's mean log-ratio."""
    log_ratio = logps - old_logps
    if level == "token":
        return log_ratio
    if level == "sequence":
        return sequence_mean(log_ratio, weights, sequence_of, num_sequences)[sequence_of]
    raise ValueError(f"importance_sampling_level must be one of {IMPORTANCE_SAMPLING_LEVELS}, got {level!r}")


def clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, epsilon_low: float,
                      epsilon_high: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(-min(r A, clip(r) A), low-clipped, high-clipped)``, each [n]. A token is clipped where the
    clip took effect: ratio below ``1 - epsilon_low`` with a negative advantage, or above
    ``1 + epsilon_high`` with a positive one."""
    clipped = ratio.clamp(1 - epsilon_low, 1 + epsilon_high)
    loss = -torch.min(ratio * advantages, clipped * advantages)
    low = (ratio < 1 - epsilon_low) & (advantages < 0)
    high = (ratio > 1 + epsilon_high) & (advantages > 0)
    return loss, low, high


def kl_k3(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(policy || reference) per token: ``exp(d) - d - 1``, d = ref - logp."""
    delta = ref_logps - logps
    return torch.exp(delta) - delta - 1


def per_token_loss(logps: torch.Tensor, old_logps: torch.Tensor, ref_logps: torch.Tensor | None,
                   advantages: torch.Tensor, weights: torch.Tensor, sequence_of: torch.Tensor, num_sequences: int,
                   level: str = "token", epsilon_low: float = 0.2, epsilon_high: float = 0.2, beta: float = 0.0
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(loss_t, low-clipped, high-clipped, KL_t or None)``, each [n]: the module docstring's per-token
    loss. ``advantages`` [n] is each token's completion's advantage; ``ref_logps`` is used when beta > 0."""
    log_ratio = importance_log_ratio(logps, old_logps, weights, sequence_of, num_sequences, level)
    loss, low, high = clipped_surrogate(torch.exp(log_ratio), advantages, epsilon_low, epsilon_high)
    kl = None
    if beta > 0:
        kl = kl_k3(logps, ref_logps)
        loss = loss + beta * kl
    return loss, low, high, kl


def aggregate(token_loss: torch.Tensor, weights: torch.Tensor, sequence_of: torch.Tensor, num_sequences: int,
              loss_type: str) -> torch.Tensor:
    """The micro-batch's share of the step's loss numerator (see the module docstring)."""
    if loss_type == "grpo":
        return sequence_mean(token_loss, weights, sequence_of, num_sequences).sum()
    total = (token_loss * weights).sum()
    if loss_type == "bnpo":
        return total / weights.sum().clamp(min=1.0)
    if loss_type in ("dr_grpo", "dapo"):
        return total
    raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")


def loss_units(loss_type: str, num_sequences: int, weights: torch.Tensor, max_completion_length: int) -> int:
    """The micro-batch's share of the step's loss denominator (see the module docstring)."""
    if loss_type == "grpo":
        return num_sequences
    if loss_type == "bnpo":
        return 1
    if loss_type == "dr_grpo":
        return num_sequences * max_completion_length
    if loss_type == "dapo":
        return int(weights.sum().item())
    raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
