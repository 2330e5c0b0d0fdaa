"""DeepSpeed presets: names, "auto" filling, contradictions."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from sfttool.config import ConfigError
from sfttool.engine.deepspeed import deepspeed_optim_wrapper, fill_auto, find_preset

PRESETS = ["zero1", "zero2", "zero2_offload", "zero3", "zero3_offload"]


def cfg(batch_size=2, accum=8, max_norm=1.0, wrapper="AmpOptimWrapper", dtype="bfloat16", clip_grad=None):
    return dict(train_dataloader=dict(batch_size=batch_size),
                optim_wrapper=dict(type=wrapper, dtype=dtype, accumulative_counts=accum,
                                   clip_grad=clip_grad or dict(max_norm=max_norm),
                                   optimizer=dict(type="AdamW", lr=1e-4)))


def problems(ds: dict, config: dict, on_gpu: bool = True, world_size: int = 1) -> list[str]:
    """The lines of fill_auto's ConfigError after its header."""
    with pytest.raises(ConfigError) as err:
        fill_auto(ds, config, Path("mine.json"), on_gpu=on_gpu, world_size=world_size)
    header, *lines = str(err.value).split("\n")
    assert header == "the DeepSpeed config mine.json does not fit the training config:"
    return [line.strip() for line in lines]


ZERO2 = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
         "gradient_clipping": "auto", "zero_optimization": {"stage": 2}}


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
    assert ds["train_batch_size"] == 16
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


def test_train_batch_size_is_micro_times_accumulation_times_processes():
    """HF/TRL JSONs say "train_batch_size": "auto"; DeepSpeed itself cannot compare "auto" to a number."""
    hf = dict(ZERO2, train_batch_size="auto")
    ds = fill_auto(hf, cfg(batch_size=2, accum=8), Path("hf.json"), on_gpu=False, world_size=4)
    assert ds["train_batch_size"] == 2 * 8 * 4
    assert fill_auto(dict(ZERO2, train_batch_size=64), cfg(), Path("hf.json"), on_gpu=False,
                     world_size=4)["train_batch_size"] == 64
    assert problems(dict(ZERO2, train_batch_size=32), cfg(), on_gpu=False, world_size=4) == [
        "train_batch_size is 32 but the config's train_dataloader.batch_size × optim_wrapper.accumulative_counts "
        "× 4 processes gives 64; set train_batch_size to \"auto\" in the DeepSpeed JSON or change "
        "train_dataloader.batch_size × optim_wrapper.accumulative_counts × 4 processes"]


def test_an_auto_nothing_fills_is_named_by_its_key_path():
    ds = dict(ZERO2, steps_per_print="auto",
              zero_optimization={"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                 "stage3_param_persistence_threshold": "auto",
                                 "offload_optimizer": {"device": "auto"}, "stage3_max_live_parameters": "auto"})
    fills = ("sfttool fills train_micro_batch_size_per_gpu, gradient_accumulation_steps, train_batch_size, "
             "gradient_clipping, fp16.enabled, bf16.enabled; DeepSpeed zero_optimization.reduce_bucket_size, "
             "zero_optimization.stage3_prefetch_bucket_size, zero_optimization.stage3_param_persistence_threshold")
    assert problems(ds, cfg()) == [
        f'zero_optimization.offload_optimizer.device is "auto" but nothing fills it; set a value ({fills})',
        f'zero_optimization.stage3_max_live_parameters is "auto" but nothing fills it; set a value ({fills})',
        f'steps_per_print is "auto" but nothing fills it; set a value ({fills})']


def test_deepspeed_resolves_its_bucket_size_autos_itself():
    """DeepSpeed 0.19 drops "auto" in these and uses its defaults: the config it builds holds no "auto"."""
    from deepspeed.runtime.config import DeepSpeedConfig

    hf = dict(ZERO2, train_batch_size="auto",
              zero_optimization={"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                 "stage3_param_persistence_threshold": "auto"})
    built = DeepSpeedConfig(fill_auto(hf, cfg(), Path("hf.json"), on_gpu=False))
    zero = built.zero_config
    assert (zero.reduce_bucket_size, zero.prefetch_bucket_size, zero.param_persistence_threshold) == (
        5e8, 5e7, 1e5)
    assert built.train_batch_size == 16


def test_optimizer_and_scheduler_sections_are_refused_auto_or_not():
    ds = dict(ZERO2, optimizer={"type": "AdamW", "params": {"lr": "auto"}},
              scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 100}})
    assert problems(ds, cfg()) == [
        "optimizer: sfttool hands DeepSpeed the config's torch optimizer, so DeepSpeed ignores this section; "
        "remove it and set optim_wrapper.optimizer",
        "scheduler: DeepSpeed would step this learning-rate schedule on top of the config's param_scheduler; "
        "remove it and set param_scheduler"]


@pytest.mark.parametrize("section, enabled, wrapper, dtype, trains_in", [
    ("bf16", True, "AmpOptimWrapper", "float16", "float16"),
    ("bf16", False, "AmpOptimWrapper", "bfloat16", "bfloat16"),
    ("fp16", True, "AmpOptimWrapper", "bfloat16", "bfloat16"),
    ("fp16", False, "AmpOptimWrapper", "float16", "float16"),
    ("bf16", True, "OptimWrapper", None, "float32"),
])
def test_explicit_precision_that_disagrees_is_an_error(section, enabled, wrapper, dtype, trains_in):
    ds = dict(ZERO2, **{section: {"enabled": enabled}})
    assert problems(ds, cfg(wrapper=wrapper, dtype=dtype)) == [
        f"{section}.enabled is {json.dumps(enabled)} but the config's optim_wrapper trains in {trains_in}; "
        f"set {section}.enabled to \"auto\" in the DeepSpeed JSON or change optim_wrapper "
        f"(type AmpOptimWrapper, dtype 'bfloat16' or 'float16')"]


def test_explicit_precision_that_agrees_is_kept():
    ds = dict(ZERO2, bf16={"enabled": True}, fp16={"enabled": False})
    filled = fill_auto(ds, cfg(dtype="bfloat16"), Path("mine.json"), on_gpu=True)
    assert filled["bf16"]["enabled"] is True and filled["fp16"]["enabled"] is False
    assert fill_auto(dict(ZERO2, bf16={"enabled": False}), cfg(), Path("mine.json"),
                     on_gpu=False)["bf16"]["enabled"] is False
    assert problems(dict(ZERO2, bf16={"enabled": True}), cfg(), on_gpu=False) == [
        'bf16.enabled is true but this machine has no GPU; set it to "auto" or false']


@pytest.mark.parametrize("clip_grad, what", [
    (dict(type="value", clip_value=0.5), "type='value'"),
    (dict(max_norm=1.0, norm_type=1), "norm_type=1"),
    (dict(max_norm=1.0, norm_type="inf"), "norm_type='inf'"),
])
def test_clipping_deepspeed_cannot_do_is_refused(clip_grad, what):
    assert problems(ZERO2, cfg(clip_grad=clip_grad)) == [
        f"optim_wrapper.clip_grad has {what} but DeepSpeed clips only by the L2 norm of the gradients; "
        f"use clip_grad=dict(max_norm=...) or train without --deepspeed"]


def test_clipping_by_l2_norm_or_none():
    filled = fill_auto(ZERO2, cfg(clip_grad=dict(max_norm=0.5, norm_type=2.0)), Path("m.json"), on_gpu=False)
    assert filled["gradient_clipping"] == 0.5
    unclipped = cfg()
    unclipped["optim_wrapper"]["clip_grad"] = None
    assert fill_auto(ZERO2, unclipped, Path("m.json"), on_gpu=False)["gradient_clipping"] == 0.0
    assert problems(ZERO2, cfg(clip_grad=dict(norm_type=2))) == [
        "optim_wrapper.clip_grad has no max_norm; set clip_grad=dict(max_norm=...) or clip_grad=None for no clipping"]
