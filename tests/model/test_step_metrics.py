"""What a run shows per optimizer step (``sfttool.model.step_metrics``): the step metrics its
micro-batches return, added up as the train loop adds them (over micro-batches and ranks: the
all-reduce is a sum), equal what one batch holding the whole step gives, and for SFT the loss
transformers itself computes on that batch. The micro-batch's backward loss, which the progress
line used to show, is not that number."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from engine_helpers import transformers_loss as hf_loss  # noqa: E402
from test_preference import batch, make_model, make_pairs, perturb, row_of  # noqa: E402
from test_preference_reward import make_reward  # noqa: E402

from sfttool.model.step_metrics import STEP_METRICS, StepAccumulator, step_means, step_metrics  # noqa: E402

EXACT = 1e-6


def shown_step(model, batches_per_rank: list[list[dict]]) -> tuple[dict, list[dict]]:
    """One optimizer step as the train loop takes it (normaliser over every rank's micro-batches):
    the values it shows, and each micro-batch's output."""
    global_count = sum(model.count_loss_units(b) for rank in batches_per_rank for b in rank)
    world_size = len(batches_per_rank)
    accumulator, outputs = StepAccumulator(), []
    for rank in batches_per_rank:
        for b in rank:
            normalizer = global_count / (len(rank) * world_size)
            with torch.no_grad():
                out = model({**b, "loss_normalizer": normalizer}, mode="loss")
            _, log_vars = model.parse_losses(out)  # what train_step hands the loop
            accumulator.add(log_vars)
            outputs.append(out)
    return accumulator.reduce(), outputs


# --- SFT --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("split", ["accumulation", "two_ranks", "packed_with_a_partial_window"])
def test_the_shown_sft_loss_is_transformers_loss_on_one_batch_of_the_step(tiny_llama_dir, make_sft, rows, split):
    model = make_sft(tiny_llama_dir)
    samples = rows.make_samples(6, seed=22, lengths=(4, 20))  # very different trained-token counts
    one = [[s] for s in samples]
    micro_batches = {"accumulation": [[rows.collate([rows.pack(r)]) for r in one]],
                     "two_ranks": [[rows.collate([rows.pack(r)]) for r in one[:3]],
                                   [rows.collate([rows.pack(r)]) for r in one[3:]]],
                     "packed_with_a_partial_window": [[rows.collate([rows.pack(samples[:2]), rows.pack(samples[2:5])]),
                                                       rows.collate([rows.pack(samples[5:])])]]}[split]
    shown, outputs = shown_step(model, micro_batches)
    want = hf_loss(tiny_llama_dir, samples)
    assert shown["loss"] == pytest.approx(want, rel=EXACT)
    # What the progress line showed (one micro-batch's share of the step loss) is not the loss.
    assert abs(outputs[0]["loss"].item() - want) > 1e-3


def test_the_shown_sample_mean_is_the_mean_of_the_samples_losses(tiny_llama_dir, make_sft, rows):
    model = make_sft(tiny_llama_dir, loss_reduction="sample")
    samples = rows.make_samples(5, seed=4, lengths=(4, 20))
    shown, _ = shown_step(model, [[rows.collate([rows.pack(samples[:2])]), rows.collate([rows.pack(samples[2:])])]])
    want = sum(hf_loss(tiny_llama_dir, [s]) for s in samples) / len(samples)
    assert shown["loss"] == pytest.approx(want, rel=EXACT)


# --- preference models ------------------------------------------------------------------------------


def _preference_model(kind: str, model_dir):
    if kind == "reward":
        model = make_reward(model_dir, penalty_type="L2", penalty_weight=0.1)
        perturb(model.llm, seed=4, scale=0.3)  # scores away from 0
        return model
    model = make_model({"dpo": "DPO", "orpo": "ORPO"}[kind], model_dir, beta=0.5)
    perturb(model.llm, seed=7, scale=0.05)  # the policy moves away from the (frozen copy) reference
    return model


@pytest.mark.parametrize("kind", ["dpo", "orpo", "reward"])
def test_the_shown_preference_metrics_are_means_over_the_steps_pairs(tiny_llama_dir, kind):
    model = _preference_model(kind, tiny_llama_dir)
    pairs = make_pairs(7, seed=12)
    # Micro-batches of 1, 4 and 2 pairs on two ranks: a mean of micro-batch means would weigh them alike.
    split = [[batch([row_of(pairs[:1])]), batch([row_of(pairs[1:3]), row_of(pairs[3:5])])],
             [batch([row_of(pairs[5:])])]]
    shown, _ = shown_step(model, split)
    with torch.no_grad():
        whole = step_means(model(batch([row_of(pairs)]), mode="loss"))
    assert shown.keys() == whole.keys() and "loss" in shown
    for name in whole:  # rewards are differences of float32 log-prob sums: packing changes them by ~1e-7
        assert shown[name] == pytest.approx(whole[name], rel=EXACT, abs=1e-6), name
    names = {"dpo": "rewards/margins", "orpo": "nll", "reward": "scores/margins"}
    assert abs(whole[names[kind]]) > 1e-3  # the values compared are not all zero


def test_dpo_at_step_zero_shows_ln2_whatever_the_split(tiny_llama_dir):
    """Policy == reference: every pair's loss is ln 2, so is the step's, in any micro-batch split
    (the first micro-batch's share used to be printed as the loss: ln 2 x 10/9 for 10 of 18 pairs)."""
    model = make_model("DPO", tiny_llama_dir)
    pairs = make_pairs(6, seed=5)
    shown, outputs = shown_step(model, [[batch([row_of(pairs[:4])]), batch([row_of(pairs[4:])])]])
    assert shown["loss"] == pytest.approx(math.log(2), abs=1e-6)
    # The first micro-batch's share: its 4 pairs' losses over the normaliser 6 pairs / 2 micro-batches.
    assert outputs[0]["loss"].item() == pytest.approx(4 * math.log(2) / 3, abs=1e-5)


# --- the accumulator ---------------------------------------------------------------------------------


def test_the_accumulator_adds_sums_and_counts_and_averages_other_values():
    acc = StepAccumulator()
    acc.add({"loss": torch.tensor(5.0), "extra": torch.tensor(2.0), **step_metrics(loss=(torch.tensor(6.0), 4))})
    acc.add({"loss": torch.tensor(7.0), "extra": torch.tensor(4.0),
             **step_metrics(loss=(torch.tensor(1.0), torch.tensor(1)))})
    assert acc.reduce() == {"extra": 3.0, "loss": 1.4}  # (6 + 1) / (4 + 1); extra: mean of 2 and 4
    assert acc.reduce() == {}  # the next step starts empty
    acc.add({STEP_METRICS: {"accuracy": (torch.tensor(0.0), 0)}})
    assert math.isnan(acc.reduce()["accuracy"])  # nothing to average over
