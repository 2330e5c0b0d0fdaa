"""``RunSpec``: the run decided once, from the checked config and the flags; every PART 1 setting sfttool
reads reaches it."""
from __future__ import annotations

import dataclasses

import pytest

from engine_helpers import write_config
from sfttool.config import load_config
from sfttool.config.settings import SETTINGS
from sfttool.engine.spec import TrainOptions, build_spec

# How the spec shows each PART 1 setting once overridden (a setting the spec does not read fails here).
OVERRIDDEN = {
    "seed": ("seed=11", lambda spec: spec.seed == 11),
    "sequence_parallel_size": ("sequence_parallel_size=2", lambda spec: spec.sequence_parallel_size == 2),
    "val_ratio": ("val_ratio=0.5", lambda spec: spec.validation),
    "val_data_path": ("val_data_path='val.jsonl'", lambda spec: spec.validation),
    "report_to": ("report_to=['tensorboard']", lambda spec: spec.trackers == ("tensorboard",)),
    "export_best": ("export_best=True", lambda spec: spec.export_best),
    "experiment_name": ("experiment_name='mine'", lambda spec: spec.name.startswith("mine")),
    "work_dir": ("work_dir='/tmp/sfttool-spec-test'", lambda spec: str(spec.work_dir) == "/tmp/sfttool-spec-test"),
    "router_aux_loss_coef": ("router_aux_loss_coef=0.01", lambda spec: spec.router_aux_loss_coef == 0.01),
}

PART_1 = "\n".join(f"{name} = None" for name in SETTINGS)


@pytest.fixture
def xtuner_style(tmp_path, tiny_qwen2_dir, tiny_sft_jsonl):
    """A config with every PART 1 setting assigned and nothing else reading them, a validation loader ready."""
    path = write_config(tmp_path / "cfg.py", tiny_qwen2_dir, tiny_sft_jsonl)
    path.write_text(path.read_text() + f"\n{PART_1}\nval_dataloader = dict(batch_size=1)\nrandomness = None\n")
    return path


def test_the_settings_list_and_the_spec_agree():
    assert set(OVERRIDDEN) == set(SETTINGS)


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_each_part1_setting_reaches_the_spec(xtuner_style, name):
    option, holds = OVERRIDDEN[name]
    before = build_spec(load_config(xtuner_style), TrainOptions(), world_size=2)
    after = build_spec(load_config(xtuner_style, [option]), TrainOptions(), world_size=2)
    assert holds(after) and not holds(before)


def test_the_spec_reads_the_loop_and_the_flags(tmp_path, tiny_qwen2_dir, tiny_sft_jsonl):
    cfg = load_config(write_config(tmp_path / "cfg.py", tiny_qwen2_dir, tiny_sft_jsonl, accumulative_counts=4,
                                   batch_size=2, max_epochs=0.5))
    spec = build_spec(cfg, TrainOptions(work_dir=str(tmp_path / "w"), seed=5, max_steps=3, strict=True), 1)
    assert (spec.accumulation, spec.batch_size, spec.max_epochs, spec.max_iters) == (4, 2, 0.5, None)
    assert (spec.seed, spec.max_steps, spec.strict, spec.work_dir) == (5, 3, True, tmp_path / "w")
    assert spec.max_length == 128 and spec.method == "SupervisedFinetune" and spec.launcher == "none"
    assert spec.this_run_iters(100) == 12 and dataclasses.replace(spec, dry_run=True).this_run_iters(100) == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.accumulation = 1


def test_half_precision_is_decided_once_in_the_spec(tmp_path, tiny_qwen2_dir, tiny_sft_jsonl, monkeypatch):
    """The dtype the model loads in and the note saying why (on a machine without a GPU)."""
    import torch

    monkeypatch.delenv("SFTTOOL_CPU_HALF_PRECISION", raising=False)
    cfg = load_config(write_config(tmp_path / "cfg.py", tiny_qwen2_dir, tiny_sft_jsonl, dtype="bfloat16"))
    spec = build_spec(cfg, TrainOptions(), 1)
    if torch.cuda.is_available():
        assert (spec.precision, spec.precision_note) == ("bfloat16", None)
    else:
        assert spec.precision == "float32" and spec.precision_note.startswith("no GPU: the model is loaded in float32")


def test_options_are_the_train_flags():
    """Every flag of `sfttool train` but --nproc-per-node is an option, and nothing else."""
    from sfttool.cli.train import train

    flags = {p.name for p in train.params} - {"config", "nproc_per_node"}
    assert flags == {f.name for f in dataclasses.fields(TrainOptions)}
