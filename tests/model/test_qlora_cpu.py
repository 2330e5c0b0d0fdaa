"""QLoRA on CPU: bitsandbytes 4-bit (nf4) base + LoRA on every linear layer.

The trap (bitsandbytes 0.50 on CPUs with AVX512-BF16): an eval-mode forward or
``generate()`` repacks 4-bit weights into an inference-only layout, after which
LoRA gradients are silently wrong or None. ``compat.disable_bnb_cpu_weight_repacking``
(applied when the model is built) prevents it; training must keep learning
after an evaluation.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("bitsandbytes")


def build_qlora(model_dir, **kwargs):
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from sfttool.model import SupervisedFinetune

    torch.manual_seed(0)
    quant = dict(type=BitsAndBytesConfig, load_in_4bit=True, bnb_4bit_quant_type="nf4",
                 bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype="torch.float32")
    llm = dict(type=AutoModelForCausalLM.from_pretrained, pretrained_model_name_or_path=str(model_dir),
               dtype="float32", quantization_config=quant)
    return SupervisedFinetune(llm=llm, lora=dict(type=LoraConfig, r=8, lora_alpha=16, lora_dropout=0.0),
                              **kwargs)


def linear4bit_layers(model):
    import bitsandbytes as bnb

    return [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]


def train_steps(model, optimizer, data, n):
    """n optimizer steps; returns the losses and how many LoRA params lacked a grad."""
    model.train()
    losses, missing = [], 0
    for _ in range(n):
        loss = model(data, mode="loss")["loss"]
        loss.backward()
        missing += sum(p.grad is None for p in model.parameters() if p.requires_grad)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, missing


def evaluate_and_generate(model, data):
    model.eval()
    with torch.no_grad():
        model(data, mode="tensor")
        out = model.llm.generate(input_ids=data["input_ids"][:, :6], max_new_tokens=4, do_sample=False,
                                 use_cache=True)
    assert out.shape == (1, 10)


@pytest.fixture
def batch(rows):
    return rows.collate([rows.pack(rows.make_samples(3, seed=31))])


def test_qlora_builds_4bit_with_adapters_on_every_linear(tiny_llama_dir):
    model = build_qlora(tiny_llama_dir)
    layers = linear4bit_layers(model)
    assert len(layers) == 7 * model.llm.config.num_hidden_layers  # every linear layer but the head
    assert all(m.weight.dtype == torch.uint8 for m in layers)
    assert not isinstance(model.llm.get_output_embeddings(), type(layers[0]))
    assert model.llm.device.type == "cpu"
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert set(model.state_dict()) == {n for n in trainable}


def test_qlora_keeps_learning_after_evaluation_and_generate(tiny_llama_dir, batch):
    model = build_qlora(tiny_llama_dir, use_activation_checkpointing=True)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    before, missing = train_steps(model, optimizer, batch, 4)
    assert missing == 0 and before[-1] < before[0]
    evaluate_and_generate(model, batch)
    after, missing = train_steps(model, optimizer, batch, 4)
    assert missing == 0, "LoRA gradients vanished after an eval-mode forward"
    assert after[0] < before[-1] and after[-1] < after[0], (before, after)


def lora_grads(model, data):
    model.train()
    model.zero_grad()
    model(data, mode="loss")["loss"].backward()
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def grads_after_evaluation(model_dir, data, guard):
    model = build_qlora(model_dir, use_activation_checkpointing=False)
    if not guard:
        for layer in linear4bit_layers(model):
            layer.support_avx512bf16_for_cpu = True
    evaluate_and_generate(model, data)
    return lora_grads(model, data)


def test_gradients_after_evaluation_equal_those_before(tiny_llama_dir, batch):
    want = lora_grads(build_qlora(tiny_llama_dir, use_activation_checkpointing=False), batch)
    got = grads_after_evaluation(tiny_llama_dir, batch, guard=True)
    assert all(got[n] is not None and torch.equal(got[n], want[n]) for n in want)


def test_without_the_guard_the_trap_is_real(tiny_llama_dir, batch):
    """Sensitivity check: with bnb's CPU repacking left on, the gradients after
    an evaluation are wrong (the repacked kernel has no backward: no gradient
    flows through the frozen 4-bit weights, or none at all)."""
    from bitsandbytes.nn.modules import has_avx512bf16

    if not has_avx512bf16():
        pytest.skip("this CPU has no AVX512-BF16: bitsandbytes never repacks here")
    want = lora_grads(build_qlora(tiny_llama_dir, use_activation_checkpointing=False), batch)
    got = grads_after_evaluation(tiny_llama_dir, batch, guard=False)
    broken = [n for n in want if got[n] is None or (got[n] - want[n]).abs().max() > 1e-3]
    assert broken


def test_qlora_adapter_saves_and_loads_with_peft(tiny_llama_dir, batch, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = build_qlora(tiny_llama_dir)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    train_steps(model, optimizer, batch, 2)
    model.llm.save_pretrained(tmp_path / "adapter")
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, tmp_path / "adapter")
    names = {n for n, _ in loaded.named_parameters() if "lora_" in n}
    assert len(names) == 2 * 7 * base.config.num_hidden_layers


def test_dumped_config_builds_through_the_registry(tiny_llama_dir):
    """What ``Config.dump`` writes back (dotted type names, dtype strings) builds
    with ``sfttool.registry.build``, the way the train entry builds the model."""
    from sfttool.registry import build

    cfg = dict(
        type="sfttool.model.SupervisedFinetune",
        llm=dict(type="transformers.AutoModelForCausalLM.from_pretrained",
                 pretrained_model_name_or_path=str(tiny_llama_dir), torch_dtype="torch.float32",
                 quantization_config=dict(type="transformers.BitsAndBytesConfig", load_in_4bit=True,
                                          bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype="torch.float32")),
        lora=dict(type="peft.LoraConfig", r=4, lora_alpha=8, target_modules="all-linear"),
        tokenizer=dict(type="transformers.AutoTokenizer.from_pretrained",
                       pretrained_model_name_or_path=str(tiny_llama_dir)))
    model = build(cfg, "model")
    assert len(linear4bit_layers(model)) == 7 * model.llm.config.num_hidden_layers
    assert model.llm.get_output_embeddings().weight.dtype == torch.float32
    assert all("lora_" in k for k in model.state_dict())
