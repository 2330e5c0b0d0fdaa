"""DPO with precomputed reference log-probs (``precompute_ref_log_probs=True``): the pre-pass stores
each sequence's reference log-prob as the column ``ref_logps``; with them the loss, rewards and
gradients equal the on-the-fly ones (fp32, packed and unpacked, LoRA and full fine-tuning), the frozen
reference copy is freed, and a batch without them is refused once it is gone."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_preference import batch, grads_of, lora_cfg, make_model, make_pairs, perturb, row_of  # noqa: E402

from sfttool.dataset.collate_fns import preference_collate_fn  # noqa: E402
from sfttool.model.step_metrics import step_means  # noqa: E402

EXACT = 1e-6


def pair_dataset(pairs, per_row: int) -> Dataset:
    """The rows build_preference_dataset makes: ``per_row`` pairs per row (1: unpacked)."""
    rows = [row_of(pairs[i:i + per_row]) for i in range(0, len(pairs), per_row)]
    return Dataset.from_list([dict(row, length=len(row["input_ids"])) for row in rows])


def twin_models(model_dir, lora: bool):
    """The same policy twice, the second set to precompute its reference; the policy moved away
    from the reference, so rewards and gradients are not trivially zero."""
    models = []
    for precompute in (False, True):
        model = make_model("DPO", model_dir, seed=0, lora=lora_cfg() if lora else None,
                           precompute_ref_log_probs=precompute)
        perturb(model.llm, seed=5, scale=0.05)
        models.append(model)
    return models


def step(model, rows: list[dict]) -> tuple[dict, dict]:
    model.zero_grad()
    out = model(preference_collate_fn(rows)["data"], mode="loss")
    out["loss"].backward()
    return {"backward loss": out["loss"].item(), **step_means(out)}, grads_of(model)


@pytest.mark.parametrize("per_row", [1, 3], ids=["unpacked", "packed"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_precomputed_loss_rewards_and_gradients_equal_the_on_the_fly_ones(tiny_llama_dir, lora, per_row):
    on_the_fly, precomputed = twin_models(tiny_llama_dir, lora)
    dataset = pair_dataset(make_pairs(6, seed=11), per_row)
    with_ref = precomputed.prepare_train_data(dataset)
    assert with_ref.column_names == dataset.column_names + ["ref_logps"]
    assert [len(r) for r in with_ref["ref_logps"]] == [len(s) for s in dataset["sample_lengths"]]
    assert on_the_fly.prepare_train_data(dataset) is dataset  # not asked: no pass
    assert precomputed.ref_llm is None  # a full fine-tune's frozen copy is freed (LoRA holds none)
    assert precomputed.reference_freed == (not lora)

    rows = [with_ref[i] for i in range(len(with_ref))]
    precomputed.reference_logps = lambda data: pytest.fail("a training step ran the reference forward")
    want, want_grads = step(on_the_fly, [{k: v for k, v in r.items() if k != "ref_logps"} for r in rows])
    got, got_grads = step(precomputed, rows)
    assert want["rewards/margins"] != 0 and want_grads
    assert got.keys() == want.keys()
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=EXACT, abs=1e-9), key
    assert got_grads.keys() == want_grads.keys()
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=EXACT, atol=1e-9)


def test_the_stored_values_are_the_reference_forward_of_each_row(tiny_llama_dir):
    on_the_fly, precomputed = twin_models(tiny_llama_dir, lora=True)
    dataset = pair_dataset(make_pairs(5, seed=2), per_row=2)  # rows of 2, 2 and 1 pairs
    with_ref = precomputed.prepare_train_data(dataset)
    for i in range(len(dataset)):
        want, _ = on_the_fly.reference_logps(batch([dataset[i]]))
        assert with_ref[i]["ref_logps"] == want.tolist()
    assert precomputed.training  # the pass puts the model back in train mode


def test_the_collate_fn_hands_the_values_over_in_sequence_order():
    rows = [row_of(make_pairs(2, seed=1)), row_of(make_pairs(1, seed=2))]
    rows[0]["ref_logps"], rows[1]["ref_logps"] = [-1.0, -2.0, -3.0, -4.0], [-5.0, -6.0]
    data = preference_collate_fn(rows)["data"]
    assert data["ref_logps"].tolist() == [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0]
    assert int(data["sequence_ids"].max()) == 5
    rows[1]["ref_logps"] = [-5.0]
    with pytest.raises(ValueError, match="rows hold 6 sequences but 5 ref_logps"):
        preference_collate_fn(rows)


def test_a_batch_without_the_values_is_refused_once_the_reference_is_freed(tiny_llama_dir):
    from sfttool.registry import ConfigBuildError
    _, precomputed = twin_models(tiny_llama_dir, lora=False)
    dataset = pair_dataset(make_pairs(2, seed=3), per_row=1)
    precomputed.prepare_train_data(dataset)
    with pytest.raises(ConfigBuildError, match="the batch has no `ref_logps`, and the reference model was freed"):
        precomputed(batch([dataset[0]]), mode="loss")


def test_reference_free_losses_and_other_datasets(tiny_llama_dir):
    from sfttool.model.preference_precompute import PrecomputeError
    simpo = make_model("DPO", tiny_llama_dir, loss_type="simpo", beta=2.0, precompute_ref_log_probs=True)
    dataset = pair_dataset(make_pairs(2, seed=3), per_row=1)
    assert simpo.prepare_train_data(dataset) is dataset  # no reference: nothing to compute
    model = make_model("DPO", tiny_llama_dir, lora=lora_cfg(), precompute_ref_log_probs=True)
    with pytest.raises(PrecomputeError, match="needs the training set that build_preference_dataset builds"):
        model.prepare_train_data([dataset[0]])


def test_a_non_boolean_setting_names_the_key(tiny_llama_dir):
    from sfttool.registry import ConfigBuildError
    with pytest.raises(ConfigBuildError, match="model.precompute_ref_log_probs must be True or False"):
        make_model("DPO", tiny_llama_dir, precompute_ref_log_probs="yes")
