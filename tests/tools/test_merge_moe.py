"""`sfttool convert merge` with LoRA on mixture-of-experts models: adapters on the fused 3-D experts,
the shared experts, the dense layers and attention fold into the weights, and the merged model's
logits equal base + adapter."""
from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from sfttool.cli.main import cli


def trained_adapter(model_dir, save_dir):
    """A LoRA (default targets) whose B matrices are non-zero, as after training, saved as peft saves it;
    returns the in-memory peft model."""
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    from sfttool.model import SupervisedFinetune

    torch.manual_seed(0)
    model = SupervisedFinetune(llm=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                               lora=LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0), use_activation_checkpointing=False)
    with torch.no_grad():
        for name, param in model.llm.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.05)
    model.llm.save_pretrained(save_dir)
    return model.llm.eval()


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_merged_moe_logits_equal_base_plus_adapter(arch, tiny_moe_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    base_dir = tiny_moe_dir(arch)
    peft_llm = trained_adapter(base_dir, tmp_path / "adapter")
    result = CliRunner().invoke(cli, ["convert", "merge", str(base_dir), str(tmp_path / "adapter"), str(tmp_path / "m")])
    assert result.exit_code == 0, result.output

    ids = torch.randint(3, 500, (2, 16), generator=torch.Generator().manual_seed(1))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    with torch.no_grad():
        expected, got, plain = peft_llm(input_ids=ids).logits, merged(input_ids=ids).logits, base(input_ids=ids).logits
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=0)
    assert (expected - plain).abs().max() > 1e-2  # the adapter changes the model, so the match means something
    assert not any("lora" in name for name, _ in merged.named_parameters())
    changed = {n for n, p in merged.named_parameters() if not torch.equal(p, base.get_parameter(n))}
    assert any(n.endswith("experts.gate_up_proj") for n in changed) and any(n.endswith("experts.down_proj") for n in changed)
    assert not any(n.endswith("mlp.gate.weight") for n in changed)  # the router was not adapted
    if arch == "deepseek_v3":
        assert {"model.layers.0.mlp.gate_proj.weight", "model.layers.1.mlp.shared_experts.up_proj.weight"} <= changed
