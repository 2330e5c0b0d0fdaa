"""`sfttool convert pth_to_hf`: mmengine .pth files and DeepSpeed ZeRO folders
become the same HF folders the training run exported itself."""
from __future__ import annotations

import json
import os

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from sfttool.cli.main import cli
from sfttool.config import load_config
from sfttool.tools.convert import ConvertError, load_checkpoint_state_dict, pth_to_hf

pytestmark = pytest.mark.slow


def convert(cfg_path, ckpt, out, *extra):
    result = CliRunner().invoke(cli, ["convert", "pth_to_hf", str(cfg_path), str(ckpt), str(out), *extra])
    assert result.exit_code == 0, result.output
    return out


def assert_same_tensors(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_lora_pth_gives_the_adapter_the_run_exported(lora_run, lora_cfg_path, tmp_path):
    out = convert(lora_cfg_path, lora_run / "iter_4.pth", tmp_path / "adapter")
    adapter = load_file(out / "adapter_model.safetensors")
    assert_same_tensors(adapter, load_file(lora_run / "hf_adapter" / "adapter_model.safetensors"))
    # 2 layers x 7 linear layers x (A, B), and training moved B away from its zero init.
    assert len(adapter) == 28
    assert max(v.abs().max().item() for k, v in adapter.items() if "lora_B" in k) > 1e-3
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (8, 16, "LORA")
    assert (out / "tokenizer.json").is_file() and (out / "sfttool_config.py").is_file()
    assert load_config(out / "sfttool_config.py").model.lora.r == 8


def test_the_adapter_loads_with_peft(lora_run, lora_cfg_path, tmp_path, tiny_llama_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = convert(lora_cfg_path, lora_run / "iter_4.pth", tmp_path / "adapter")
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_llama_dir), str(out))
    state = load_checkpoint_state_dict(lora_run / "iter_4.pth")
    key = "llm.base_model.model.model.layers.1.mlp.down_proj.lora_B.default.weight"
    assert torch.equal(model.base_model.model.model.layers[1].mlp.down_proj.lora_B["default"].weight, state[key])


def test_full_pth_gives_a_model_folder(full_run, full_cfg_path, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = convert(full_cfg_path, full_run / "iter_4.pth", tmp_path / "model")
    assert_same_tensors(load_file(out / "model.safetensors"), load_file(full_run / "hf_model" / "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.use_cache is True  # switched back on for inference
    assert AutoTokenizer.from_pretrained(out).eos_token == "<|im_end|>"


def test_no_safe_serialization_writes_bin_files(lora_run, lora_cfg_path, full_run, full_cfg_path, tmp_path):
    adapter = convert(lora_cfg_path, lora_run / "iter_4.pth", tmp_path / "a", "--no-safe-serialization")
    assert (adapter / "adapter_model.bin").is_file() and not (adapter / "adapter_model.safetensors").exists()
    model = convert(full_cfg_path, full_run / "iter_4.pth", tmp_path / "m", "--no-safe-serialization")
    state = torch.load(model / "pytorch_model.bin", weights_only=True)
    assert_same_tensors(state, load_file(full_run / "hf_model" / "model.safetensors"))


def test_deepspeed_checkpoint_folder_gives_the_adapter_the_run_exported(lora_deepspeed_run, lora_cfg_path,
                                                                        tmp_path):
    ckpt = lora_deepspeed_run / "iter_4.pth"
    assert ckpt.is_dir()  # DeepSpeed writes a folder of (partitioned) states
    out = convert(lora_cfg_path, ckpt, tmp_path / "adapter")
    adapter = load_file(out / "adapter_model.safetensors")
    assert_same_tensors(adapter, load_file(lora_deepspeed_run / "hf_adapter" / "adapter_model.safetensors"))
    assert max(v.abs().max().item() for k, v in adapter.items() if "lora_B" in k) > 1e-3


def test_a_deepspeed_run_in_this_process_leaves_no_rank_variables_behind(lora_deepspeed_run):
    # Left behind, LOCAL_RANK makes a later `sfttool train --nproc-per-node 2` started from here run alone.
    assert {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT"}.isdisjoint(os.environ)


def test_a_full_checkpoint_with_a_lora_config_is_refused(full_run, lora_cfg_path, tmp_path):
    with pytest.raises(ConvertError, match="lacks 28 of the model's 28 weights.*LoRA config but a full"):
        pth_to_hf(load_config(lora_cfg_path), full_run / "iter_4.pth", tmp_path / "x")


def test_cli_errors_are_one_line(lora_cfg_path, tmp_path):
    bad = tmp_path / "bad.pth"
    torch.save({"state_dict": {}}, bad)
    result = CliRunner().invoke(cli, ["convert", "pth_to_hf", str(lora_cfg_path), str(bad), str(tmp_path / "o")])
    assert result.exit_code == 1
    assert result.output.startswith(f"Error: {bad}: no weights found")
    result = CliRunner().invoke(cli, ["convert", "pth_to_hf", str(lora_cfg_path), str(tmp_path / "missing.pth"),
                                      str(tmp_path / "o")])
    assert result.exit_code == 2 and "does not exist" in result.output


def test_a_checkpoint_of_other_shapes_is_one_line_naming_the_dumped_config(lora_run, lora_cfg_path, tmp_path):
    ckpt, out = lora_run / "iter_4.pth", tmp_path / "o"
    result = CliRunner().invoke(cli, ["convert", "pth_to_hf", str(lora_cfg_path), str(ckpt), str(out),
                                      "--cfg-options", "model.lora.r=4"])
    assert result.exit_code == 1
    key = "llm.base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    assert result.output.splitlines()[-1] == (
        f"Error: {ckpt}: 28 of the model's 28 weights have another shape in the checkpoint, e.g. {key}: "
        "[8, 64] in the checkpoint, [4, 64] in the model this config builds; convert with the config the run "
        f"dumped in its work dir ({lora_run / 'tiny_lora.py'}), or with this config and the --cfg-options used "
        "for training")
    assert not out.exists()
    # The config the error names converts the checkpoint.
    convert(lora_run / "tiny_lora.py", ckpt, out)
    assert_same_tensors(load_file(out / "adapter_model.safetensors"),
                        load_file(lora_run / "hf_adapter" / "adapter_model.safetensors"))


@pytest.mark.parametrize("content, why", [
    (b"hello\n", "torch.load cannot read it"),
    (b"", "the file is empty"),
    ("half", "a zip file torch cannot read: truncated or corrupt"),
])
def test_a_file_that_is_not_a_checkpoint_is_one_line(lora_run, lora_cfg_path, tmp_path, content, why):
    bad = tmp_path / "notes.pth"
    whole = (lora_run / "iter_4.pth").read_bytes()
    bad.write_bytes(whole[:len(whole) // 2] if content == "half" else content)
    result = CliRunner().invoke(cli, ["convert", "pth_to_hf", str(lora_cfg_path), str(bad), str(tmp_path / "o")])
    assert result.exit_code == 1
    assert result.output.splitlines()[-1] == (
        f"Error: {bad}: not an sfttool/mmengine checkpoint ({why}); give an iter_<n>.pth file or DeepSpeed "
        "checkpoint folder from a training work dir")


def test_a_checkpoint_with_objects_outside_the_allow_list_is_one_line(tmp_path):
    import argparse

    bad = tmp_path / "other.pth"
    torch.save({"state_dict": {"w": torch.zeros(1)}, "args": argparse.Namespace(lr=1)}, bad)
    with pytest.raises(ConvertError) as info:
        load_checkpoint_state_dict(bad)
    assert str(info.value) == (f"{bad}: holds objects outside the safe-loading allow-list (argparse.Namespace); "
                               "it was not written by `sfttool train`, or by a newer version")
