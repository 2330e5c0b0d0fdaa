"""Validation inside `train`: a held-out split, val/loss in the log and scalars, the best checkpoint,
early stopping at the right validation, and its count surviving --resume."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from engine_helpers import Interrupted, logged
from validation_helpers import validation_config

from sfttool.cli.main import cli
from sfttool.tools.plot import read_run

pytestmark = pytest.mark.timeout(900)  # tests here launch several processes


def val_records(work_dir) -> list[dict]:
    runs = sorted(work_dir.glob("*/vis_data/scalars.json"))
    return [r for r in map(json.loads, runs[-1].read_text().splitlines()) if "val/loss" in r]


def log_text(work_dir) -> str:
    return sorted(work_dir.glob("*/*.log"))[-1].read_text()


@pytest.mark.slow
def test_a_plateau_stops_at_the_patience_th_validation(tmp_path, tiny_config):
    """lr 1e-30: the validation loss does not move (by more than rounding). Validations at steps 2 (the
    best), 4, 6: the second without an improvement of min_delta (patience 2) stops the run at step 6."""
    from sfttool.utils.checkpoint_file import find_best_checkpoint
    from sfttool.engine.train import train

    cfg = validation_config(tiny_config, lr=1e-30, patience=2, save_steps=100, extra="export_best = True\n",
                            custom_hooks="[dict(type='engine_helpers.DumpWeightsHook')]")
    work = train(str(cfg), work_dir=str(tmp_path / "w"))
    vals = val_records(work)
    assert [r["step"] for r in vals] == [2, 4, 6]
    assert all(r["val/loss"] == pytest.approx(vals[0]["val/loss"], abs=1e-9) for r in vals)
    assert len(logged(work)) == 6  # the train loss of iterations 1..6, nothing after the stop
    text = log_text(work)
    assert "Early stopping at iteration 6" in text
    assert "Dataset: 6 of 64 rows held out for validation (val_ratio=0.1, seed 7); 58 to train on" in text
    assert "Validation: " in text and "val/loss: " in text
    assert find_best_checkpoint(work) == work / "best_val_loss_iter_2.pth"
    assert (work / "hf_adapter" / "adapter_model.safetensors").is_file()
    _assert_the_export_holds_the_best_weights(work)
    curves = read_run(work)  # what loss.png, written at the end, draws: the logged values
    assert curves.train == dict(enumerate(logged(work), start=1))
    assert curves.val == {r["step"]: r["val/loss"] for r in vals}
    assert (work / "loss.png").stat().st_size > 10_000
    converted = CliRunner().invoke(cli, ["convert", "pth_to_hf", str(cfg), str(work), str(tmp_path / "best"), "--best"])
    assert converted.exit_code == 0, converted.output
    assert (tmp_path / "best" / "adapter_model.safetensors").is_file()


def _assert_the_export_holds_the_best_weights(work):
    """export_best: hf_adapter/ is the best checkpoint's adapter (validation 2), not the last weights
    (lr 1e-30 still moves lora_B off zero, so the two differ)."""
    import torch
    from safetensors.torch import load_file

    from sfttool.utils.checkpoint_file import load_checkpoint

    exported = {k.replace(".weight", ""): v for k, v in
                load_file(work / "hf_adapter" / "adapter_model.safetensors").items()}
    best = {k.removeprefix("llm.").replace(".default.weight", ""): v
            for k, v in load_checkpoint(work / "best_val_loss_iter_2.pth")["state_dict"].items()}
    last = {k.removeprefix("llm.").replace(".default.weight", ""): v
            for k, v in torch.load(work / "weights_rank0.pt").items()}
    assert exported.keys() == best.keys() == last.keys()
    assert all(torch.equal(exported[k], best[k]) for k in best)
    assert not all(torch.equal(exported[k], last[k]) for k in last)


def test_convert_best_without_a_best_checkpoint_is_one_line(tmp_path, tiny_config):
    result = CliRunner().invoke(cli, ["convert", "pth_to_hf", str(tiny_config()), str(tmp_path), str(tmp_path / "o"),
                                      "--best"])
    assert result.exit_code == 1
    assert result.output.strip() == (f"Error: --best: {tmp_path} has no best_checkpoint file naming an existing "
                                     "checkpoint (the run validated nothing with save_best='val/loss'); pass a "
                                     "checkpoint path instead of --best")


@pytest.mark.slow
def test_the_patience_count_survives_resume(tmp_path, tiny_config):
    """Patience 3: validations at 2 (best), 4, 6, 8 -> stop at 8. Interrupted after iteration 7, the
    run resumes from iter_6.pth: that checkpoint, written before validation 6, was re-saved after it,
    so the count is 2 and validation 8 is the third without improvement."""
    from sfttool.engine.train import train

    common = dict(lr=1e-30, patience=3, save_steps=2, keep=1)
    stop = validation_config(tiny_config, "stop.py", custom_hooks="[dict(type='engine_helpers.StopAfterIter', n=7)]",
                             **common)
    with pytest.raises(Interrupted):
        train(str(stop), work_dir=str(tmp_path / "w"))
    assert "Early stopping" not in log_text(tmp_path / "w")
    work = train(str(validation_config(tiny_config, **common)), work_dir=str(tmp_path / "w"), resume="auto")
    assert "Early stopping at iteration 8" in log_text(work)
    assert [r["step"] for r in val_records(work)] == [8]


def test_validation_is_off_without_val_data(tmp_path, tiny_config):
    from mmengine.config import Config

    from sfttool.engine.spec import RunSpec, validation_enabled
    from sfttool.engine.validation import validation_runner_args

    cfg = Config.fromfile(str(validation_config(tiny_config)))
    assert validation_enabled(cfg)
    cfg.val_ratio = 0
    cfg.val_data_path = None
    assert not validation_enabled(cfg)
    assert validation_runner_args(cfg, RunSpec(work_dir=tmp_path, validation=False)) == {}


def test_seed_reseeds_both_parts_of_the_split(tiny_config):
    """--seed must move the training and validation parts together, or rows would land in both."""
    from mmengine.config import Config

    from sfttool.engine.preflight import apply_seed

    cfg = Config.fromfile(str(validation_config(tiny_config)))
    apply_seed(cfg, 99)
    assert cfg.train_dataloader.dataset.dataset.seed == 99
    assert cfg.val_dataloader.dataset.dataset.seed == 99
    assert cfg.val_dataloader.dataset.dataset.part == "val"


@pytest.mark.slow
def test_two_processes_validate_like_one(tmp_path, tiny_config):
    """`sfttool train --nproc-per-node 2` (DDP, gloo): the validation set is built and split alike on
    both ranks and each val/loss is the one-process value (lr 1e-30: the weights stay put)."""
    from test_distributed import run_sfttool

    from sfttool.engine.train import train

    cfg = validation_config(tiny_config, lr=1e-30, val_interval=4, save_steps=100, dropout=0.0)
    result = run_sfttool([str(cfg), "--work-dir", str(tmp_path / "two"), "--nproc-per-node", "2"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    one = train(str(cfg), work_dir=str(tmp_path / "one"), max_steps=4)  # its first validation is the reference
    two = val_records(tmp_path / "two")
    assert [r["step"] for r in two] == [4, 8, 12, 16, 19]  # 37 rows / 2 ranks = 19 iterations
    assert [r["step"] for r in val_records(one)][:1] == [4]
    assert [r["val/loss"] for r in two] == pytest.approx([r["val/loss"] for r in val_records(one)][:1] * 5,
                                                         rel=1e-9)
