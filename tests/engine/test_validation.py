"""Validation loss: the token mean over the whole validation set, whatever the packing, batch size
or process count, equal to a plain per-sample reference from the same model."""
from __future__ import annotations

import json
import math
import socket

import pytest
import torch

from validation_helpers import reference_loss, run_validation, tiny_model, two_process_worker, val_rows


@pytest.fixture(scope="module")
def model(tiny_qwen2_dir):
    return tiny_model(tiny_qwen2_dir)


@pytest.fixture(scope="module")
def unpacked(tiny_qwen2_dir, tiny_sft_jsonl):
    return val_rows(tiny_qwen2_dir, tiny_sft_jsonl, pack=False)


@pytest.fixture(scope="module")
def packed(tiny_qwen2_dir, tiny_sft_jsonl):
    return val_rows(tiny_qwen2_dir, tiny_sft_jsonl, pack=True)


def test_val_loss_is_the_token_mean_packed_or_not_whatever_the_batch(tmp_path, model, unpacked, packed):
    assert len(packed) < len(unpacked)  # several samples share a row
    reference = reference_loss(model, unpacked)
    runs = {(pack, bs): run_validation(model, rows, tmp_path, bs)
            for pack, rows in (("packed", packed), ("unpacked", unpacked)) for bs in (1, 3)}
    for key, metrics in runs.items():
        assert set(metrics) == {"val/loss", "val/ppl"}, key
        assert metrics["val/loss"] == pytest.approx(reference, rel=1e-6), key
        assert metrics["val/ppl"] == pytest.approx(math.exp(metrics["val/loss"]), rel=1e-12), key
    # a mean of per-row means weighs short rows up: it misses the tolerance above (a random model's
    # losses are all near ln(vocab), so the gap is small, but 100x the tolerance)
    assert _mean_of_row_means(model, unpacked) != pytest.approx(reference, rel=1e-5)


def _mean_of_row_means(model, rows) -> float:
    means = []
    for row in rows:
        sums, tokens = model.summed_row_losses({"input_ids": torch.tensor([row["input_ids"]]),
                                                "labels": torch.tensor([row["labels"]])})
        means.append(sums.item() / tokens.item())
    return sum(means) / len(means)


def test_summed_row_losses_match_the_training_loss(model, packed):
    """The per-row sums add up to what compute_loss gives the same batch, times its token count."""
    from sfttool.dataset.collate_fns import default_collate_fn

    data = default_collate_fn([packed[i] for i in range(3)])["data"]
    with torch.no_grad():
        sums, tokens = model.summed_row_losses(data)
        loss = model.compute_loss(dict(data))["loss"]
    assert sums.shape == tokens.shape == (3,)
    assert int(tokens.sum()) == model.count_loss_units(data)
    assert sums.sum().item() / tokens.sum().item() == pytest.approx(loss.item(), rel=1e-6)


@pytest.mark.slow
def test_two_processes_give_the_one_process_loss(tmp_path, tiny_qwen2_dir, tiny_sft_jsonl, model):
    """7 rows over 2 ranks: the sampler pads rank 1 with a repeat, which must not count."""
    import torch.multiprocessing as mp

    single = run_validation(model, val_rows(tiny_qwen2_dir, tiny_sft_jsonl, pack=True, rows=7), tmp_path / "one", 1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    work = tmp_path / "two"
    work.mkdir()
    mp.start_processes(two_process_worker, args=(str(tiny_qwen2_dir), str(tiny_sft_jsonl), str(work), 7, port),
                       nprocs=2, start_method="spawn")
    assert json.loads((work / "metrics.json").read_text()) == single
