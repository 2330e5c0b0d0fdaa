"""`sfttool convert merge`: the merged model, loaded with plain transformers,
computes what base + adapter computes."""
from __future__ import annotations

import re
import subprocess
import sys

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


def test_an_adapter_folder_as_base_is_refused_and_nothing_is_written(adapter_dir, tmp_path):
    import json

    named = json.loads((adapter_dir / "adapter_config.json").read_text())["base_model_name_or_path"]
    result = CliRunner().invoke(cli, ["convert", "merge", str(adapter_dir), str(adapter_dir), str(tmp_path / "m")])
    assert result.exit_code == 1
    assert result.output.splitlines()[-1] == (
        f"Error: {adapter_dir}: BASE is a LoRA adapter folder; give the base model it was trained from "
        f"(adapter_config.json names it: {named})")
    assert list(tmp_path.iterdir()) == []


def test_a_failed_save_leaves_no_partial_output(adapter_dir, tiny_llama_dir, tmp_path, monkeypatch):
    from sfttool.tools import merge

    def save_then_fail(model, save_dir, **kwargs):
        (save_dir / "config.json").write_text("{}")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(merge, "save_model", save_then_fail)
    with pytest.raises(MergeError) as info:
        merge_adapter(tiny_llama_dir, adapter_dir, tmp_path / "new")
    assert str(info.value) == (f"could not save {tmp_path / 'new'}: [Errno 28] No space left on device; "
                               "the partial output was removed")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "notes.txt").write_text("mine")
    with pytest.raises(MergeError, match="No space left"):
        merge_adapter(tiny_llama_dir, adapter_dir, tmp_path / "old")
    assert [p.name for p in tmp_path.rglob("*")] == ["old", "notes.txt"]


def test_merging_into_a_folder_with_an_earlier_sharded_save_leaves_no_stale_shards(adapter_dir, tiny_llama_dir,
                                                                                    tmp_path):
    out = tmp_path / "merged"
    out.mkdir()
    for stale in ("model-00001-of-00002.safetensors", "model.safetensors.index.json", "pytorch_model.bin"):
        (out / stale).write_text("old")
    (out / "notes.txt").write_text("mine")
    merge_adapter(tiny_llama_dir, adapter_dir, out)
    names = sorted(p.name for p in out.iterdir())
    assert "model.safetensors" in names and "notes.txt" in names
    assert not {"model-00001-of-00002.safetensors", "model.safetensors.index.json", "pytorch_model.bin"} & set(names)


def test_training_outputs_given_as_base_or_adapter_are_one_line(lora_run, tiny_llama_dir, tmp_path):
    def error(base, adapter):
        result = CliRunner().invoke(cli, ["convert", "merge", str(base), str(adapter), str(tmp_path / "m")])
        assert result.exit_code == 1 and not (tmp_path / "m").exists()
        return result.output.splitlines()[-1]

    adapter = lora_run / "hf_adapter"
    ckpt = lora_run / "iter_4.pth"
    assert error(lora_run, adapter) == (
        f"Error: {lora_run}: a training work dir, not an HF model folder; give the base model it was trained "
        f"from as BASE ({adapter / 'adapter_config.json'} names it: {tiny_llama_dir}) and {adapter} as ADAPTER")
    assert error(ckpt, adapter) == (
        f"Error: {ckpt}: a training checkpoint, not an HF model folder; convert it first: "
        f"sfttool convert pth_to_hf {lora_run / 'tiny_lora.py'} {ckpt} OUT")
    assert error(tmp_path / "nowhere", adapter) == f"Error: {tmp_path / 'nowhere'}: no such folder"
    assert error(tiny_llama_dir, lora_run) == (
        f"Error: {lora_run}: not a peft adapter folder (no adapter_config.json); pass {adapter}")


def test_a_missing_base_that_could_be_a_hub_name_is_one_line(adapter_dir, tmp_path):
    # The tests run with HF_HUB_OFFLINE=1: the hub cannot provide it.
    result = CliRunner().invoke(cli, ["convert", "merge", "nonexistent-model", str(adapter_dir), str(tmp_path / "m")])
    assert result.exit_code == 1
    assert re.fullmatch(r"Error: nonexistent-model: no such folder, and the model hub did not provide it \(.+\); "
                        r"without access to the model hub, give a local folder", result.output.splitlines()[-1])
    assert list(tmp_path.iterdir()) == []


def test_merge_prints_no_bitsandbytes_kernel_warning(adapter_dir, tiny_llama_dir, tmp_path):
    # A fresh process: bitsandbytes warns when peft first imports it (on CPUs with AVX512-BF16).
    proc = subprocess.run([sys.executable, "-m", "sfttool.cli.main", "convert", "merge", str(tiny_llama_dir),
                           str(adapter_dir), str(tmp_path / "m")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "gemm_4bit_forward" not in proc.stderr and "pip install kernels" not in proc.stderr


def test_an_adapter_trained_with_added_tokens_merges_and_chats(tiny_llama_dir, tiny_tokenizer_bos_dir, tmp_path):
    """Training grew the embeddings for the added tokens and the adapter holds those rows: merge and chat
    grow the base to the adapter's tokenizer first (plain PeftModel.from_pretrained fails on the sizes)."""
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sfttool.model import SupervisedFinetune
    from sfttool.tools.chat import load_chat_model
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_bos_dir)
    tok.add_special_tokens({"additional_special_tokens": ["<tool>", "</tool>", "<think>"]})
    model = SupervisedFinetune(llm=AutoModelForCausalLM.from_pretrained(tiny_llama_dir), tokenizer=tok,
                               lora=LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM"),
                               use_activation_checkpointing=False)
    adapter = tmp_path / "adapter"
    model.llm.save_pretrained(str(adapter))
    tok.save_pretrained(str(adapter))
    merged = merge_adapter(tiny_llama_dir, adapter, tmp_path / "merged")
    assert AutoModelForCausalLM.from_pretrained(merged).get_input_embeddings().num_embeddings == len(tok)
    chat_model, chat_tok = load_chat_model(tiny_llama_dir, adapter=adapter)
    assert chat_model.get_input_embeddings().num_embeddings == len(chat_tok) == len(tok)
