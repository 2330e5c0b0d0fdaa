"""`sfttool convert merge`: the merged model, loaded with plain transformers,
computes what base + adapter computes."""
from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from sfttool.cli.main import cli
from sfttool.tools.merge import MergeError, merge_adapter

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def adapter_dir(lora_run, lora_cfg_path, tmp_path_factory):
    """The run's checkpoint converted with `pth_to_hf` (it carries the config)."""
    out = tmp_path_factory.mktemp("converted") / "adapter"
    result = CliRunner().invoke(cli, ["convert", "pth_to_hf", str(lora_cfg_path), str(lora_run / "iter_4.pth"),
                                      str(out)])
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def merged_dir(adapter_dir, tiny_llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("merged") / "model"
    result = CliRunner().invoke(cli, ["convert", "merge", str(tiny_llama_dir), str(adapter_dir), str(out)])
    assert result.exit_code == 0, result.output
    return out


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.fixture(scope="module")
def probe_ids(tiny_tokenizer_bos) -> torch.Tensor:
    text = "<|im_start|>user\nthe model is good<|im_end|>\n<|im_start|>assistant\nhello world"
    return torch.tensor([tiny_tokenizer_bos(text).input_ids])  # [1, seq]


def test_merged_logits_equal_base_plus_adapter(merged_dir, adapter_dir, tiny_llama_dir, probe_ids):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(merged_dir)
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    base_logits = logits(base, probe_ids)
    with_adapter = PeftModel.from_pretrained(base, str(adapter_dir))
    expected = logits(with_adapter, probe_ids)
    torch.testing.assert_close(logits(merged, probe_ids), expected, atol=1e-5, rtol=0)
    # The adapter really changes the model, so the comparison above means something.
    assert (expected - base_logits).abs().max() > 1e-2
    assert not any("lora" in name for name, _ in merged.named_parameters())


def test_merged_folder_has_tokenizer_and_config(merged_dir):
    from transformers import AutoTokenizer

    names = sorted(p.name for p in merged_dir.iterdir())
    assert names == ["chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
                     "sfttool_config.py", "tokenizer.json", "tokenizer_config.json"]
    tok = AutoTokenizer.from_pretrained(merged_dir)
    assert (tok.bos_token, tok.eos_token) == ("<s>", "<|im_end|>")


def test_bin_output_loads_to_the_same_logits(adapter_dir, tiny_llama_dir, merged_dir, tmp_path, probe_ids):
    from transformers import AutoModelForCausalLM

    out = merge_adapter(tiny_llama_dir, adapter_dir, tmp_path / "bin", safe_serialization=False)
    assert (out / "pytorch_model.bin").is_file() and not (out / "model.safetensors").exists()
    torch.testing.assert_close(logits(AutoModelForCausalLM.from_pretrained(out), probe_ids),
                               logits(AutoModelForCausalLM.from_pretrained(merged_dir), probe_ids),
                               atol=0, rtol=0)


def test_a_folder_without_adapter_is_a_one_line_error(tiny_llama_dir, tmp_path):
    with pytest.raises(MergeError, match="not a peft adapter folder"):
        merge_adapter(tiny_llama_dir, tiny_llama_dir, tmp_path / "out")
    result = CliRunner().invoke(cli, ["convert", "merge", str(tiny_llama_dir), str(tiny_llama_dir),
                                      str(tmp_path / "out")])
    assert result.exit_code == 1
    assert result.output.startswith(f"Error: {tiny_llama_dir}: not a peft adapter folder")
