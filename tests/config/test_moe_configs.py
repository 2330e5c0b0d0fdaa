"""The built-in mixture-of-experts configs, pointed at tiny offline MoE models of their family: the model
they build has LoRA (r=8) on attention and the fused experts, not the router, and its training loss
carries the router's load-balancing loss; `list-cfg -p moe` lists them."""
from __future__ import annotations

import functools

import pytest
import torch

from sfttool.config import load_config
from sfttool.config.loader import list_configs
from sfttool.model.step_metrics import step_means
from sfttool.registry import build

MOE_CONFIGS = {"qwen3_30b_a3b_moe_lora_alpaca_e3": "qwen3_moe", "qwen3_30b_a3b_moe_qlora_alpaca_e3": "qwen3_moe",
               "mixtral_8x7b_instruct_v0_1_moe_lora_alpaca_e3": "mixtral"}


def test_list_cfg_moe_lists_them():
    assert list_configs("moe") == sorted(MOE_CONFIGS)


@pytest.mark.parametrize("name", sorted(MOE_CONFIGS))
def test_moe_config_builds_and_takes_a_step_on_a_tiny_model_of_its_family(name, tiny_moe_dir, tmp_path):
    from sfttool import assets

    if "qlora" in name:
        pytest.importorskip("bitsandbytes")
    rows = [dict(instruction=f"Name the colour number {i}.", input="", output=f"Colour {i} is blue.") for i in range(8)]
    data = assets.write_jsonl(tmp_path / "alpaca.jsonl", rows)
    cfg = load_config(name, [f"pretrained_model_name_or_path={tiny_moe_dir(MOE_CONFIGS[name])}", f"data_path={data}",
                             "max_length=256", "model.llm.dtype=float32", "val_ratio=0",
                             "train_dataloader.dataset.map_num_proc=1"])
    dataset = build(cfg.train_dataloader.dataset, "train_dataloader.dataset")
    collate_cfg = dict(cfg.train_dataloader.collate_fn)
    collate = functools.partial(collate_cfg.pop("type"), **collate_cfg)
    model = build(cfg.model, "model")
    adapter = model.llm.peft_config["default"]
    assert adapter.r == 8 and {"experts.gate_up_proj", "experts.down_proj"} <= set(adapter.target_parameters)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any(".experts.lora_A" in n for n in trained) and not any(".gate.lora" in n for n in trained)
    assert model.router_aux_loss_coef == model.llm.config.router_aux_loss_coef > 0
    out = model(**collate([dataset[0]]), mode="loss")
    out["loss"].backward()
    assert torch.isfinite(out["loss"]) and step_means(out)["aux_loss"] > 0
