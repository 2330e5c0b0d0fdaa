"""Held-out validation of preference runs: ``val/loss`` and the rewards are means over every held-out
pair, equal to the per-pair formulas on a plain forward, whatever the packing, batch size or number of
processes; the same numbers training shows for a batch holding the whole set; with precomputed reference
log-probs the same as with a reference forward."""
from __future__ import annotations

import functools
import itertools
import json
import math
import os
import re
import socket
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from test_preference import (formula, load_llm, lora_cfg, make_model, make_pairs, perturb,  # noqa: E402
                             plain_pair_logps, row_of)

from sfttool.dataset.collate_fns import preference_collate_fn  # noqa: E402
from sfttool.model.step_metrics import step_means  # noqa: E402

BETA = 0.5
REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")
_names = itertools.count()


def pair_rows(pairs, per_row: int) -> Dataset:
    """Rows as build_preference_dataset makes them: ``per_row`` pairs per row (1: unpacked)."""
    rows = [row_of(pairs[i:i + per_row]) for i in range(0, len(pairs), per_row)]
    return Dataset.from_list([dict(row, length=len(row["input_ids"])) for row in rows])


def run_pair_validation(model, dataset, work_dir, batch_size: int) -> dict:
    """``Runner.val()`` with sfttool's ValLoop and PairValMetric: the metrics dict."""
    from mmengine.dataset import DefaultSampler
    from mmengine.runner import Runner

    from sfttool.engine.validation import PairValMetric, ValLoop

    runner = Runner(model=model, work_dir=str(work_dir), experiment_name=f"pval_{os.getpid()}_{next(_names)}",
                    val_dataloader=dict(batch_size=batch_size, num_workers=0, dataset=dataset,
                                        sampler=dict(type=DefaultSampler, shuffle=False),
                                        collate_fn=functools.partial(preference_collate_fn)),
                    val_cfg=dict(type=ValLoop), val_evaluator=dict(type=PairValMetric),
                    default_hooks=dict(logger=None, checkpoint=None), log_level="WARNING")
    return runner.val()


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory, tiny_llama_dir):
    """The tiny Llama with moved weights: a policy whose rewards against the tiny Llama are not 0."""
    llm = load_llm(tiny_llama_dir)
    perturb(llm, seed=7, scale=0.05)
    path = tmp_path_factory.mktemp("val_policy")
    llm.save_pretrained(path)
    return path


def full_dpo(policy_dir, reference_dir, **kwargs):
    ref = dict(type="transformers.AutoModelForCausalLM.from_pretrained",
               pretrained_model_name_or_path=str(reference_dir), dtype="float32", attn_implementation="sdpa")
    return make_model("DPO", policy_dir, ref_llm=ref, beta=BETA, **kwargs)


def test_val_metrics_are_pair_means_of_the_formula_packed_or_not_whatever_the_batch(tmp_path, tiny_llama_dir,
                                                                                    policy_dir):
    model = full_dpo(policy_dir, tiny_llama_dir)
    pairs = make_pairs(7, seed=12)
    pc, pr = plain_pair_logps(load_llm(policy_dir), pairs, average=False)
    rc, rr = plain_pair_logps(load_llm(tiny_llama_dir), pairs, average=False)
    losses = formula("sigmoid", pc, pr, rc, rr, BETA, 0.0)
    chosen = [BETA * (pc[i] - rc[i]) for i in range(7)]
    rejected = [BETA * (pr[i] - rr[i]) for i in range(7)]
    accurate = sum(c > r for c, r in zip(chosen, rejected))
    assert 0 < accurate < 7  # the accuracy test below can fail either way
    runs = {(per_row, bs): run_pair_validation(model, pair_rows(pairs, per_row), tmp_path, bs)
            for per_row in (1, 3) for bs in (1, 2)}
    for key, metrics in runs.items():
        assert set(metrics) == {"val/loss"} | {f"val/{name}" for name in REWARDS}, key
        assert metrics["val/loss"] == pytest.approx(sum(losses) / 7, rel=1e-6), key
        # the rewards are differences of float32 log-prob sums (~-40): equal to their float32 rounding
        assert metrics["val/rewards/chosen"] == pytest.approx(sum(chosen) / 7, abs=2e-6), key
        assert metrics["val/rewards/margins"] == pytest.approx((sum(chosen) - sum(rejected)) / 7, abs=2e-6), key
        assert metrics["val/rewards/accuracies"] == accurate / 7, key
    # Pair-weighted: rows of 3, 3 and 1 pairs weigh their pairs alike; a mean of the rows' means does not.
    row_means = [sum(losses[i:i + 3]) / len(losses[i:i + 3]) for i in range(0, 7, 3)]
    assert sum(row_means) / 3 != pytest.approx(runs[(3, 1)]["val/loss"], rel=1e-4)


def test_validating_a_batch_gives_what_training_shows_for_it(tiny_llama_dir, policy_dir):
    """DPO, ORPO and the reward model: the per-pair values validation averages are the ones whose
    step means training shows (loss, rewards or scores, accuracy)."""
    from sfttool.model.reward import RewardModel

    pairs = make_pairs(5, seed=3)
    data = preference_collate_fn([row_of(pairs[:2]), row_of(pairs[2:])])["data"]
    reward_llm = dict(type="transformers.AutoModelForSequenceClassification.from_pretrained",
                      pretrained_model_name_or_path=str(tiny_llama_dir), num_labels=1, dtype="float32")
    torch.manual_seed(0)
    models = [full_dpo(policy_dir, tiny_llama_dir), make_model("ORPO", policy_dir, beta=BETA),
              RewardModel(llm=reward_llm, penalty_type="L2", use_activation_checkpointing=False)]
    for model in models:
        rows = model.validation_rows(data)
        assert [len(row) for row in rows] == [2, 3]
        with torch.no_grad():
            shown = step_means(model(dict(data), mode="loss"))
        for name, values in {k: [p[k] for row in rows for p in row] for k in rows[0][0]}.items():
            assert math.fsum(values) / 5 == pytest.approx(shown[name], rel=1e-6, abs=1e-9), (type(model), name)
    assert set(models[2].validation_rows(data)[0][0]) == {"loss", "accuracy", "scores/chosen", "scores/rejected",
                                                          "scores/margins"}


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_precomputed_reference_gives_the_same_validation(tmp_path, tiny_llama_dir, lora):
    """The train entry hands the validation set to the same pre-pass: its rows get ``ref_logps`` before
    the reference is freed, and validation gives what a reference forward gives."""
    models = []
    for precompute in (False, True):
        model = make_model("DPO", tiny_llama_dir, lora=lora_cfg() if lora else None, beta=BETA,
                           precompute_ref_log_probs=precompute)
        perturb(model.llm, seed=5, scale=0.05)
        models.append(model)
    pairs = make_pairs(6, seed=21)
    train, val = pair_rows(pairs[:3], 2), pair_rows(pairs[3:], 2)
    assert models[0].prepare_train_data(train, val_dataset=val) == (train, val)  # not asked: no pass
    train_ref, val_ref = models[1].prepare_train_data(train, val_dataset=val)
    assert "ref_logps" in train_ref.column_names and "ref_logps" in val_ref.column_names
    assert models[1].reference_freed == (not lora)
    want = run_pair_validation(models[0], val, tmp_path, 1)
    got = run_pair_validation(models[1], val_ref, tmp_path, 1)
    assert want["val/rewards/margins"] != 0
    assert got == pytest.approx(want, rel=1e-6, abs=1e-9)


def _two_process_worker(rank: int, policy_dir: str, reference_dir: str, work_dir: str, port: int) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        model = full_dpo(policy_dir, reference_dir)
        metrics = run_pair_validation(model, pair_rows(make_pairs(7, seed=12), 2), work_dir, 1)
        if rank == 0:
            Path(work_dir, "metrics.json").write_text(json.dumps(metrics))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_processes_validate_like_one(tmp_path, tiny_llama_dir, policy_dir):
    """4 rows over 2 ranks (each rank its own rows, rank by rank); every pair counted once."""
    import torch.multiprocessing as mp

    single = run_pair_validation(full_dpo(policy_dir, tiny_llama_dir), pair_rows(make_pairs(7, seed=12), 2),
                                 tmp_path / "one", 1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    work = tmp_path / "two"
    work.mkdir()
    mp.start_processes(_two_process_worker, args=(str(policy_dir), str(tiny_llama_dir), str(work), port),
                       nprocs=2, start_method="spawn")
    assert json.loads((work / "metrics.json").read_text()) == pytest.approx(single, rel=1e-12)


# --- through `sfttool train` --------------------------------------------------------------------------

DEMO = "demo_smollm2_135m_lora_dpo_helpful_e3"


def demo_on_tiny_llama(folder, tiny_llama_dir) -> Path:
    """`sfttool copy-cfg` of the DPO demo, its PART 1 pointed at the tiny Llama, one epoch."""
    from click.testing import CliRunner

    from sfttool.cli.main import cli

    assert CliRunner().invoke(cli, ["copy-cfg", DEMO, str(folder)]).exit_code == 0
    path = folder / f"{DEMO}_copy.py"
    text = path.read_text()
    for old, new in [("pretrained_model_name_or_path = dict(type=export_smollm2)",
                      f"pretrained_model_name_or_path = {str(tiny_llama_dir)!r}"),
                     ("max_epochs = 3", "max_epochs = 1"),
                     ("max_length = 128", "max_length = 256"),  # the tiny tokenizer's pieces are shorter
                     ("max_packed_length = 256", "max_packed_length = 512")]:
        assert old in text, old
        text = text.replace(old, new)
    path.write_text(text)
    return path


@pytest.mark.slow
def test_a_dpo_run_holds_out_pairs_and_keeps_the_best_held_out_accuracy(tmp_path, tiny_llama_dir):
    """val_ratio carves 13 of the demo's 52 pairs off before packing; every validation's metrics reach the
    log, the scalars (trackers) and `sfttool plot`; save_best on val/rewards/accuracies (rule 'greater')
    keeps the first validation with the highest accuracy."""
    from sfttool.engine.train import train
    from sfttool.tools.plot import read_run

    config = demo_on_tiny_llama(tmp_path, tiny_llama_dir)
    work = train(str(config), work_dir=str(tmp_path / "work"),
                 cfg_options=["val_data_path=None", "val_ratio=0.25", "val_interval=2", "lr=0.02",
                              "best_metric=val/rewards/accuracies", "best_metric_rule=greater"])
    log = next(work.rglob("*.log")).read_text()
    assert "Dataset: 13 of 52 rows held out for validation (val_ratio=0.25, seed 42); 39 to train on" in log
    assert "Preference data: 39 rows in, 39 pairs in" in log and "Preference data: 13 rows in, 13 pairs in" in log
    assert re.search(r"Validation: \d+ rows \(13 pairs\)", log)
    assert re.search(r"Reference log-probs: 13 pairs in \d+ validation rows", log)
    (scalars,) = work.rglob("scalars.json")
    validations = [r for r in map(json.loads, scalars.read_text().splitlines()) if "val/loss" in r]
    steps = [r["step"] for r in validations]
    assert len(steps) >= 3 and steps[:2] == [2, 4]
    for record in validations:
        assert set(record) >= {f"val/{k}" for k in ("loss",) + REWARDS}
        assert record["val/rewards/accuracies"] * 13 == pytest.approx(round(record["val/rewards/accuracies"] * 13))
    accuracies = [r["val/rewards/accuracies"] for r in validations]
    best = steps[accuracies.index(max(accuracies))]
    assert sorted(p.name for p in work.glob("best_*.pth")) == [f"best_val_rewards_accuracies_iter_{best}.pth"]
    assert read_run(work).val_accuracy == {s: a for s, a in zip(steps, accuracies)}


@pytest.mark.slow
def test_early_stopping_watches_the_held_out_accuracy(tmp_path, tiny_llama_dir):
    """best_metric = 'val/rewards/accuracies', rule 'greater', patience 1: the run stops at the first
    validation that does not beat the best accuracy so far."""
    from sfttool.engine.train import train

    config = demo_on_tiny_llama(tmp_path, tiny_llama_dir)
    work = train(str(config), work_dir=str(tmp_path / "work"),
                 cfg_options=["val_data_path=None", "val_ratio=0.25", "val_interval=2", "lr=0.02",
                              "best_metric=val/rewards/accuracies", "best_metric_rule=greater",
                              "early_stopping_patience=1"])
    (scalars,) = work.rglob("scalars.json")
    validations = [r for r in map(json.loads, scalars.read_text().splitlines()) if "val/loss" in r]
    accuracies = [r["val/rewards/accuracies"] for r in validations]
    stop = next(i for i in range(1, len(accuracies)) if accuracies[i] <= max(accuracies[:i]))
    assert len(validations) == stop + 1  # nothing validated after it
    log = next(work.rglob("*.log")).read_text()
    assert (f"Early stopping at iteration {validations[stop]['step']}: val/rewards/accuracies has not improved on "
            f"{max(accuracies[:stop]):.4f}") in log
