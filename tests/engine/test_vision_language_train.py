"""`sfttool train` of a vision-language checkpoint on text rows, full and LoRA: the summary says what is
frozen, the export loads with the checkpoint's own class and holds the vision weights bit-identical to
the input's, and `sfttool convert merge` of the adapter gives the logits of base + adapter."""
from __future__ import annotations

import pytest
import torch
from engine_helpers import write_config

from sfttool import assets


@pytest.fixture(scope="module")
def qwen_vl_dir(tmp_path_factory, tiny_tokenizer_dir):
    return assets.build_tiny_vlm(tmp_path_factory.mktemp("tiny_qwen2_5_vl"), tiny_tokenizer_dir, "qwen2_5_vl")


def vlm_config(path, model_dir, data_file, lora: bool):
    write_config(path, model_dir, data_file, max_epochs=1, lora=lora)
    text = path.read_text().replace("AutoModelForCausalLM", "AutoModelForImageTextToText")
    path.write_text(text)
    return path


def vision_state(model) -> dict[str, torch.Tensor]:
    from sfttool.model.vision import vision_parameters
    return {name: p.detach().clone() for name, p in vision_parameters(model).items()}


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_vision_language_checkpoint_trains_on_text_and_keeps_its_vision_weights(
        tmp_path, qwen_vl_dir, tiny_sft_jsonl, capsys, lora):
    from transformers import AutoModelForImageTextToText

    from sfttool.engine.train import train
    from sfttool.model.vision import part_parameters
    from sfttool.tools.merge import load_merged, merge_adapter

    config = vlm_config(tmp_path / "vl.py", qwen_vl_dir, tiny_sft_jsonl, lora)
    out = train(str(config), work_dir=str(tmp_path / "work"), max_steps=2)
    summary = capsys.readouterr().out
    base = AutoModelForImageTextToText.from_pretrained(qwen_vl_dir)
    frozen = vision_state(base)
    sizes = {part: f"{sum(p.numel() for p in params.values()) / 1e6:.2f} M"
             for part, params in part_parameters(base).items()}
    assert (f"Vision tower ({sizes['vision tower']}): frozen; projector ({sizes['projector']}): frozen; "
            f"language model ({sizes['language model']}): {'LoRA' if lora else 'full'}.") in summary

    if not lora:
        exported = AutoModelForImageTextToText.from_pretrained(out / "hf_model")
        assert type(exported) is type(base)
        after = vision_state(exported)
        assert after.keys() == frozen.keys() and all(torch.equal(after[n], frozen[n]) for n in frozen)
        trained = dict(exported.get_decoder().named_parameters())
        assert any(not torch.equal(p, trained[n]) for n, p in base.get_decoder().named_parameters())
        return

    from peft import PeftModel
    adapter = out / "hf_adapter"
    merged = merge_adapter(qwen_vl_dir, adapter, tmp_path / "merged")
    loaded = AutoModelForImageTextToText.from_pretrained(merged)
    assert type(loaded) is type(base)
    after = vision_state(loaded)
    assert after.keys() == frozen.keys() and all(torch.equal(after[n], frozen[n]) for n in frozen)
    ids = torch.tensor([[5, 17, 42, 99, 7, 250]])
    with torch.no_grad():
        want = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(qwen_vl_dir), str(adapter))
        want_logits = want(input_ids=ids).logits
        assert not torch.allclose(want_logits, base(input_ids=ids).logits)  # the adapter changed something
        assert torch.allclose(loaded(input_ids=ids).logits, want_logits, atol=1e-5)
        assert torch.allclose(load_merged(qwen_vl_dir, adapter)(input_ids=ids).logits, want_logits, atol=1e-5)


@pytest.mark.slow
def test_a_vision_language_run_resumes_bit_identically(tmp_path, qwen_vl_dir, tiny_sft_jsonl):
    """--max-steps 2 (accumulation 2: a checkpoint after iteration 4), then --resume, ends where the
    uninterrupted run ends, bit for bit (LoRA, dropout on)."""
    from safetensors.torch import load_file

    from sfttool.engine.train import train

    config = vlm_config(tmp_path / "vl.py", qwen_vl_dir, tiny_sft_jsonl, lora=True)
    options = ["train_cfg.max_epochs=0.3"]
    full = train(str(config), work_dir=str(tmp_path / "full"), cfg_options=options)
    part = train(str(config), work_dir=str(tmp_path / "part"), cfg_options=options, max_steps=2)
    assert sorted(p.name for p in part.glob("iter_*")) == ["iter_4.pth"]
    resumed = train(str(config), work_dir=str(part), cfg_options=options, resume="auto")
    last = max(int(p.stem.split("_")[1]) for p in resumed.glob("iter_*.pth"))
    assert last > 4  # the resumed run trained on past the interruption
    a = load_file(full / "hf_adapter" / "adapter_model.safetensors")
    b = load_file(resumed / "hf_adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and a and all(torch.equal(a[k], b[k]) for k in a)
