"""GRPO's loss family against the published formulas, written here independently in TRL's padded
[completions, tokens] layout (DeepSeekMath's GRPO, DAPO, Dr. GRPO, GSPO, TRL's bnpo; the k3 KL
estimator): values and gradients, every loss_type x importance_sampling_level, asymmetric clipping,
the KL term, truncated completions masked; the group-relative advantages; ratio 1 on a first pass."""
from __future__ import annotations

import itertools

import pytest
import torch

from sfttool.model import grpo_loss as G

MAX_COMPLETION_LENGTH = 9


def reference_loss(logps, old, ref, advantages, mask, loss_type, level, eps_low, eps_high, beta):
    """The published per-token objective and its aggregations, on padded [B, T] tensors."""
    log_ratio = logps - old
    if level == "sequence":  # GSPO: the completion's length-normalised log-ratio, one per completion
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages[:, None]
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * advantages[:, None]
    token_loss = -torch.minimum(unclipped, clipped)
    if beta:
        token_loss = token_loss + beta * (torch.exp(ref - logps) - (ref - logps) - 1)
    if loss_type == "grpo":  # mean over each completion's tokens, then over completions
        return ((token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":  # mean over the batch's tokens
        return (token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":  # a constant: completions x the maximum completion length
        return (token_loss * mask).sum() / (mask.shape[0] * MAX_COMPLETION_LENGTH)
    if loss_type == "dapo":  # mean over the accumulated batch's tokens
        return (token_loss * mask).sum() / mask.sum()
    raise AssertionError(loss_type)


def padded_case(seed=0, lengths=(5, 9, 1, 7, 3, 8), loss_mask=(1, 1, 1, 0, 1, 1), spread=0.3):
    """Random per-token log-probs (policy, sampling policy, reference) of completions of ``lengths``,
    padded to [B, T]; ``loss_mask`` 0 marks a masked (truncated) completion."""
    g = torch.Generator().manual_seed(seed)
    B, T = len(lengths), max(lengths)
    logps = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = logps + spread * torch.randn(B, T, generator=g, dtype=torch.float64)  # ratios well outside the clip
    ref = logps + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)
    advantages = torch.randn(B, generator=g, dtype=torch.float64)
    mask = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).double() * torch.tensor(loss_mask)[:, None]
    return logps, old, ref, advantages, mask, torch.tensor(lengths)


def flat(padded, lengths):
    """[B, T] -> the [n] layout the model uses (completion by completion, token by token)."""
    return torch.cat([row[:n] for row, n in zip(padded, lengths.tolist())])


def sfttool_loss(logps, old, ref, advantages, mask, lengths, loss_type, level, eps_low, eps_high, beta):
    """The package's loss of one micro-batch holding the whole step: its numerator over its loss units."""
    sequence_of = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    weights = flat(mask, lengths)
    token_loss, low, high, _ = G.per_token_loss(flat(logps, lengths), flat(old, lengths), flat(ref, lengths),
                                                advantages[sequence_of], weights, sequence_of, len(lengths), level,
                                                eps_low, eps_high, beta)
    units = G.loss_units(loss_type, len(lengths), weights, MAX_COMPLETION_LENGTH)
    return G.aggregate(token_loss, weights, sequence_of, len(lengths), loss_type) / units, (low | high) & (weights > 0)


@pytest.mark.parametrize("loss_type,level,beta,clip", list(itertools.product(
    G.LOSS_TYPES, G.IMPORTANCE_SAMPLING_LEVELS, [0.0, 0.04], [(0.2, 0.2), (0.2, 0.28)])))
def test_each_loss_equals_its_published_formula_in_value_and_gradient(loss_type, level, beta, clip):
    logps, old, ref, advantages, mask, lengths = padded_case()
    mine = logps.clone().requires_grad_(True)
    theirs = logps.clone().requires_grad_(True)
    ours, clipped = sfttool_loss(mine, old, ref, advantages, mask, lengths, loss_type, level, *clip, beta)
    expected = reference_loss(theirs, old, ref, advantages, mask, loss_type, level, *clip, beta)
    torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-14)
    ours.backward()
    expected.backward()
    torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-12, atol=1e-14)
    assert clipped.any() and not clipped.all()  # the case exercises the clip both ways round
    # tokens of the masked (truncated) completion 3 get no gradient
    assert torch.equal(mine.grad[3], torch.zeros_like(mine.grad[3]))


def test_asymmetric_clip_bounds_the_ratio_where_the_advantage_says():
    """DAPO's clip-higher: r is cut at 1 + epsilon_high for a positive advantage, at 1 - epsilon for a
    negative one; the other side is not clipped (min picks the unclipped term)."""
    ratio = torch.tensor([0.5, 0.5, 1.5, 1.5, 1.25, 1.25], dtype=torch.float64)
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    loss, low, high = G.clipped_surrogate(ratio, advantages, 0.2, 0.28)
    assert loss.tolist() == [-0.5, 0.8, -1.28, 1.5, -1.25, 1.25]
    assert low.tolist() == [False, True, False, False, False, False]
    assert high.tolist() == [False, False, True, False, False, False]


def test_sequence_level_ratio_is_one_per_completion():
    """GSPO: every token of a completion carries exp(mean log-ratio of its unmasked tokens)."""
    logps, old, _, _, mask, lengths = padded_case(loss_mask=(1, 1, 1, 1, 1, 1))
    sequence_of = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    log_ratio = G.importance_log_ratio(flat(logps, lengths), flat(old, lengths), flat(mask, lengths), sequence_of,
                                       len(lengths), "sequence")
    for b, n in enumerate(lengths.tolist()):
        expected = ((logps[b, :n] - old[b, :n]).mean())
        torch.testing.assert_close(log_ratio[sequence_of == b], expected.expand(n), rtol=1e-12, atol=1e-14)


def test_k3_estimator_is_zero_at_the_reference_and_positive_elsewhere():
    logps = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64)
    assert G.kl_k3(logps, logps).tolist() == [0.0, 0.0, 0.0]
    ref = logps + torch.tensor([0.3, -0.7, 1.1], dtype=torch.float64)
    d = ref - logps
    assert G.kl_k3(logps, ref).tolist() == (torch.exp(d) - d - 1).tolist()
    assert (G.kl_k3(logps, ref) > 0).all()


@pytest.mark.parametrize("level", G.IMPORTANCE_SAMPLING_LEVELS)
def test_first_pass_ratio_is_exactly_one_and_nothing_is_clipped(level):
    """On the first pass over a round (mu = 1) the sampling policy is the policy: old = logps.detach()."""
    logps, _, _, advantages, mask, lengths = padded_case(loss_mask=(1,) * 6)
    sequence_of = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    current = flat(logps, lengths).requires_grad_(True)
    weights = flat(mask, lengths)
    ratio = torch.exp(G.importance_log_ratio(current, current.detach(), weights, sequence_of, 6, level))
    assert torch.equal(ratio, torch.ones_like(ratio))
    loss, low, high, _ = G.per_token_loss(current, current.detach(), None, advantages[sequence_of], weights,
                                          sequence_of, 6, level, 0.2, 0.28)
    assert not low.any() and not high.any()
    assert torch.equal(loss, -advantages[sequence_of])


def group_reference(rewards, G_, scale, batch_std=None):
    out = []
    for g in rewards.view(-1, G_):
        mean = sum(g.tolist()) / G_
        std = (sum((x - mean) ** 2 for x in g.tolist()) / (G_ - 1)) ** 0.5
        divisor = {"group": std + 1e-4, "batch": (batch_std or 0) + 1e-4, "none": 1.0}[scale]
        out += [(x - mean) / divisor for x in g.tolist()]
    return torch.tensor(out, dtype=torch.float32)


@pytest.mark.parametrize("scale", G.SCALE_REWARDS)
def test_group_advantages(scale):
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.25, 2.0, 2.0, 2.0, 2.0, 0.1, 0.1, 0.7, 0.3], dtype=torch.float64)
    batch_std = float(rewards.std())
    got = G.group_advantages(rewards, 4, scale, batch_std)
    torch.testing.assert_close(got, group_reference(rewards, 4, scale, batch_std))
    assert got[4:8].tolist() == [0.0] * 4  # equal rewards: exactly 0


def test_a_group_of_equal_rewards_gets_exactly_zero_even_where_the_mean_rounds():
    """0.1 * 3 / 3 is not 0.1 in floating point: r - mean would leave ~1e-17, divided by a std of 0 + 1e-4."""
    rewards = torch.tensor([0.1, 0.1, 0.1], dtype=torch.float64)
    assert (rewards - rewards.mean()).abs().max() > 0  # the rounding the advantage must not keep
    for scale in G.SCALE_REWARDS:
        assert G.group_advantages(rewards, 3, scale, 0.0).tolist() == [0.0, 0.0, 0.0]


def test_loss_units_per_loss_type():
    weights = torch.tensor([1.0, 1.0, 0.0, 1.0])
    assert G.loss_units("grpo", 3, weights, 16) == 3
    assert G.loss_units("bnpo", 3, weights, 16) == 1
    assert G.loss_units("dr_grpo", 3, weights, 16) == 48
    assert G.loss_units("dapo", 3, weights, 16) == 3
    with pytest.raises(ValueError, match="loss_type must be one of"):
        G.loss_units("ppo", 3, weights, 16)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_micro_batch_split_gives_the_whole_steps_loss(loss_type):
    """Summing each micro-batch's numerator over the step's units equals the loss of the step in one piece
    (bnpo normalises per micro-batch by definition, so its step loss depends on the split, as in TRL)."""
    logps, old, ref, advantages, mask, lengths = padded_case()
    whole, _ = sfttool_loss(logps, old, ref, advantages, mask, lengths, loss_type, "token", 0.2, 0.28, 0.04)
    sequence_of = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    all_weights = flat(mask, lengths)
    units = G.loss_units(loss_type, len(lengths), all_weights, MAX_COMPLETION_LENGTH)
    total = 0
    for part in ([0, 1], [2], [3, 4, 5]):
        keep = torch.isin(sequence_of, torch.tensor(part))
        local_of = torch.searchsorted(torch.tensor(part), sequence_of[keep])
        token_loss = G.per_token_loss(flat(logps, lengths)[keep], flat(old, lengths)[keep], flat(ref, lengths)[keep],
                                      advantages[sequence_of[keep]], all_weights[keep], local_of, len(part), "token",
                                      0.2, 0.28, 0.04)[0]
        total = total + G.aggregate(token_loss, all_weights[keep], local_of, len(part), loss_type)
    torch.testing.assert_close(total / units, whole, rtol=1e-12, atol=1e-14)
