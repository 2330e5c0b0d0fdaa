"""DeepSpeed presets: names, "auto" filling, contradictions."""
from __future__ import annotations

import json

import pytest

from sfttool.config import ConfigError
from sfttool.engine.deepspeed import deepspeed_optim_wrapper, fill_auto, find_preset

PRESETS = ["zero1", "zero2", "zero2_offload", "zero3", "zero3_offload"]


def cfg(batch_size=2, accum=8, max_norm=1.0, wrapper="AmpOptimWrapper", dtype="bfloat16"):
    return dict(train_dataloader=dict(batch_size=batch_size),
                optim_wrapper=dict(type=wrapper, dtype=dtype, accumulative_counts=accum,
                                   clip_grad=dict(max_norm=max_norm), optimizer=dict(type="AdamW", lr=1e-4)))


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_ships_and_fills(name):
    for spelling in (name, f"deepspeed_{name}", f"{name}.json"):
        assert find_preset(spelling).name == f"{name}.json"
    preset = find_preset(name)
    ds = fill_auto(json.loads(preset.read_text()), cfg(), preset, on_gpu=True)
    assert ds["train_micro_batch_size_per_gpu"] == 2
    assert ds["gradient_accumulation_steps"] == 8
    assert ds["gradient_clipping"] == 1.0
    assert ds["bf16"]["enabled"] is True and ds["fp16"]["enabled"] is False
    assert ds["zero_optimization"]["stage"] == int(name[4])
    assert "auto" not in json.dumps(ds)


def test_precision_follows_the_optim_wrapper():
    preset = find_preset("zero2")
    raw = json.loads(preset.read_text())
    fp16 = fill_auto(raw, cfg(dtype="float16"), preset, on_gpu=True)
    assert fp16["fp16"]["enabled"] is True and fp16["bf16"]["enabled"] is False
    plain = fill_auto(raw, cfg(wrapper="OptimWrapper"), preset, on_gpu=True)
    assert plain["fp16"]["enabled"] is False and plain["bf16"]["enabled"] is False
    cpu = fill_auto(raw, cfg(), preset, on_gpu=False)  # AmpOptimWrapper falls back to fp32 on CPU
    assert cpu["fp16"]["enabled"] is False and cpu["bf16"]["enabled"] is False


def test_contradictions_are_reported_together(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
                                "gradient_clipping": "auto", "zero_optimization": {"stage": 2}}))
    with pytest.raises(ConfigError) as err:
        fill_auto(json.loads(path.read_text()), cfg(), path, on_gpu=False)
    message = str(err.value)
    assert "train_micro_batch_size_per_gpu is 4" in message and "train_dataloader.batch_size gives 2" in message
    assert "gradient_accumulation_steps is 2" in message and "optim_wrapper.accumulative_counts" in message
    # agreeing explicit values are fine
    ok = fill_auto(json.loads(path.read_text()), cfg(batch_size=4, accum=2), path, on_gpu=False)
    assert ok["gradient_clipping"] == 1.0


def test_unknown_preset_lists_the_choices():
    with pytest.raises(ConfigError, match="zero2_offload"):
        find_preset("zero5")


def test_optim_wrapper_keeps_the_torch_optimizer():
    wrapper = deepspeed_optim_wrapper(cfg()["optim_wrapper"])
    assert wrapper == dict(type="DeepSpeedOptimWrapper", optimizer=dict(type="AdamW", lr=1e-4))
