"""Vision-language checkpoints (image-text-to-text classes) trained on text rows: a packed row equals its
samples run one by one through the checkpoint's own forward (loss, and gradients against sfttool's own
unpacked path), the vision tower and projector are frozen and out of LoRA, and what cannot be asked for is
refused in one line. On tiny random Qwen2.5-VL (multimodal rotary positions), Gemma 3 and LLaVA models."""
from __future__ import annotations

import pytest
import torch

from sfttool import assets
from sfttool.model.vision import (language_model_class, part_parameters, trained_parts, unread_tower_modules,
                                  vision_modules, vision_parameters)
from sfttool.registry import ConfigBuildError

ATOL = 1e-5


@pytest.fixture(scope="session")
def vlm_dirs(tmp_path_factory, tiny_tokenizer_dir):
    return {arch: assets.build_tiny_vlm(tmp_path_factory.mktemp(f"tiny_{arch}"), tiny_tokenizer_dir, arch)
            for arch in assets.VLM_ARCHS}


def make_vlm(model_dir, quantization_config=None, **kwargs):
    from transformers import AutoModelForImageTextToText

    from sfttool.model import SupervisedFinetune
    torch.manual_seed(0)
    llm = dict(type=AutoModelForImageTextToText.from_pretrained, pretrained_model_name_or_path=str(model_dir),
               dtype="float32", attn_implementation="sdpa")
    if quantization_config is not None:
        llm["quantization_config"] = quantization_config
    return SupervisedFinetune(llm=llm, use_activation_checkpointing=False, **kwargs)


def own_loss(model, rows, samples) -> torch.Tensor:
    """The checkpoint's own forward (its positions, its loss) on each sample alone, token-weighted."""
    total, count = 0.0, 0
    for s in samples:
        data = rows.collate([rows.as_row(s)])
        labels = data["labels"]
        units = int((labels[:, 1:] != -100).sum())
        with torch.no_grad():
            total += model.llm(input_ids=data["input_ids"], labels=labels).loss * units
        count += units
    return total / count


@pytest.mark.parametrize("arch", assets.VLM_ARCHS)
def test_a_packed_row_trains_like_its_samples_through_the_checkpoints_own_forward(vlm_dirs, rows, arch):
    model = make_vlm(vlm_dirs[arch])
    samples = rows.make_samples(3, seed=21)
    want = own_loss(model, rows, samples)

    model.zero_grad()
    separate, count = 0.0, 0
    for s in samples:  # sfttool's path, one sample at a time: the gradients to compare with
        data = rows.collate([rows.as_row(s)])
        units = model.count_loss_units(data)
        separate = separate + model(data, mode="loss")["loss"] * units
        count += units
    (separate / count).backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    model.zero_grad()
    loss = model(rows.collate([rows.pack(samples)]), mode="loss")["loss"]
    loss.backward()
    assert torch.allclose(loss.detach(), want, atol=ATOL)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads.keys() == want_grads.keys() and grads
    assert all(torch.allclose(grads[n], want_grads[n], atol=ATOL) for n in grads)
    assert not any(p.requires_grad for p in vision_parameters(model.llm).values())  # frozen, so no gradient


@pytest.mark.parametrize("arch", assets.VLM_ARCHS)
def test_lora_targets_the_language_model_only(vlm_dirs, arch):
    model = make_vlm(vlm_dirs[arch], lora=dict(r=4, lora_alpha=8, lora_dropout=0.0))
    from transformers import AutoModelForImageTextToText
    adapted = {name.split(".lora_A")[0] for name, _ in model.llm.named_parameters() if ".lora_A." in name}
    plain = AutoModelForImageTextToText.from_pretrained(vlm_dirs[arch]).get_decoder()
    in_decoder = {name for name, module in plain.named_modules() if isinstance(module, torch.nn.Linear)}
    # every linear layer of the language model is adapted, and nothing else (the vision tower shares names)
    assert len(adapted) == len(in_decoder) > 0
    assert all(".language_model." in name for name in adapted)
    assert model.frozen_vision_parameters == sum(p.numel() for p in vision_parameters(model.llm).values()) > 0


def test_training_the_vision_tower_of_a_text_model_or_with_lora_is_refused(vlm_dirs, tiny_qwen2_dir, make_sft):
    with pytest.raises(ConfigBuildError, match="model.freeze_vision_tower=False: Qwen2ForCausalLM has no vision "
                                               "tower or projector to train or freeze; remove the setting"):
        make_sft(tiny_qwen2_dir, freeze_vision_tower=False)
    with pytest.raises(ConfigBuildError, match="model.freeze_llm=True: Qwen2ForCausalLM has no vision tower"):
        make_sft(tiny_qwen2_dir, freeze_llm=True)
    with pytest.raises(ConfigBuildError, match="model.freeze_vision_tower=False with model.lora: set "
                                               "model.lora_vision_tower=True for LoRA on the vision tower"):
        make_vlm(vlm_dirs["llava"], lora=dict(r=4), freeze_vision_tower=False)
    with pytest.raises(ConfigBuildError, match="model.lora_vision_tower=True needs model.lora"):
        make_vlm(vlm_dirs["llava"], lora_vision_tower=True)
    with pytest.raises(ConfigBuildError, match="model.freeze_llm=True with model.lora: LoRA would adapt nothing"):
        make_vlm(vlm_dirs["llava"], lora=dict(r=4), freeze_llm=True)
    with pytest.raises(ConfigBuildError, match="model.freeze_llm=True with the vision tower and projector frozen: "
                                               "nothing trains"):
        make_vlm(vlm_dirs["llava"], freeze_llm=True)
    full = make_vlm(vlm_dirs["llava"], freeze_vision_tower=False)  # full fine-tuning may train it
    unread = tuple(f"{module}." for module in unread_tower_modules(full.llm))  # but for what LLaVA never reads
    frozen = {n: p for n, p in vision_parameters(full.llm).items() if not p.requires_grad}
    assert unread and set(frozen) == {n for n in vision_parameters(full.llm) if n.startswith(unread)}
    assert full.frozen_vision_parameters == sum(p.numel() for p in frozen.values())


def test_the_parts_are_the_vision_tower_the_projector_and_the_language_model(vlm_dirs):
    from transformers import AutoModelForImageTextToText
    models = {arch: AutoModelForImageTextToText.from_pretrained(vlm_dirs[arch]) for arch in assets.VLM_ARCHS}
    assert vision_modules(models["qwen2_5_vl"]) == (["model.visual"], ["model.visual.merger"])
    assert vision_modules(models["llava"]) == (["model.vision_tower"], ["model.multi_modal_projector"])
    assert vision_modules(models["gemma3"]) == (["model.vision_tower"], ["model.multi_modal_projector"])
    for model in models.values():
        parts = part_parameters(model)
        names = [set(p) for p in parts.values()]
        assert all(names) and set.union(*names) == {n for n, _ in model.named_parameters()}
        assert sum(map(len, names)) == len(set.union(*names))  # each parameter in exactly one part


def sizes(model):
    return {part: sum(p.numel() for p in params.values()) for part, params in part_parameters(model.llm).items()}


@pytest.mark.parametrize("switches, want", [
    (dict(), ("frozen", "frozen", "full")),
    (dict(freeze_projector=False), ("frozen", "full", "full")),
    (dict(freeze_vision_tower=False, freeze_projector=True), ("full", "frozen", "full")),
    (dict(freeze_llm=True, freeze_projector=False), ("frozen", "full", "frozen")),  # LLaVA's pretraining stage
    (dict(lora=dict(r=4)), ("frozen", "frozen", "LoRA")),
    (dict(lora=dict(r=4), freeze_projector=False), ("frozen", "full", "LoRA")),
    (dict(lora=dict(r=4), lora_vision_tower=True), ("LoRA", "frozen", "LoRA")),
    (dict(lora=dict(r=4), lora_vision_tower=True, freeze_llm=True), ("LoRA", "frozen", "frozen")),
], ids=["default", "projector", "tower", "projector-only", "lora", "lora+projector", "lora-both", "lora-tower"])
@pytest.mark.parametrize("arch", assets.VLM_ARCHS)
def test_freeze_switches_and_lora_decide_what_trains(vlm_dirs, arch, switches, want):
    model = make_vlm(vlm_dirs[arch], **switches)
    parts = trained_parts(model.llm)
    assert tuple(mode for mode, _ in parts.values()) == want
    assert {part: size for part, (_, size) in parts.items()} == sizes(make_vlm(vlm_dirs[arch]))
    for part, params in part_parameters(model.llm).items():
        trained = {n for n, p in params.items() if p.requires_grad}
        if parts[part][0] == "LoRA":  # adapters on every linear layer of the part, nothing else trains there
            assert trained and all(".lora_" in n for n in trained)
            adapted = {n.split(".lora_")[0] for n in trained}
            linear = {n for n in params if n.endswith(".base_layer.weight")}
            assert {n.removesuffix(".base_layer.weight") for n in linear} == adapted
        elif parts[part][0] == "full":  # every weight of it (under LoRA: peft's trained copy of the projector)
            assert trained and all(".original_module." not in n for n in trained)
        else:
            assert not trained


@pytest.mark.parametrize("switches", [dict(freeze_projector=False, freeze_vision_tower=False),
                                      dict(lora=dict(r=4), lora_vision_tower=True, freeze_projector=False)],
                         ids=["full", "lora-both"])
@pytest.mark.parametrize("arch", assets.VLM_ARCHS)
def test_every_trained_parameter_gets_a_gradient_from_an_image(vlm_dirs, arch, switches, tmp_path):
    """What DDP needs (it stops on a trained parameter that took no part in the loss): a forward and backward
    on an image-text input reaches every trained parameter. Gemma 3's SigLIP tower has a pooling head whose
    output the model discards, LLaVA reads its CLIP tower's hidden states before the last layer
    (``vision_feature_layer=-2``): those stay frozen, without LoRA (``unread_tower_modules``)."""
    from transformers import AutoProcessor
    model = make_vlm(vlm_dirs[arch], **switches)
    image = str(assets.write_png(tmp_path / "a.png", 56, 56))
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "what is it?"}]}]
    inputs = AutoProcessor.from_pretrained(vlm_dirs[arch]).apply_chat_template(
        messages, tokenize=True, return_dict=True, return_tensors="pt")
    model.llm(**inputs, labels=inputs["input_ids"]).loss.backward()
    trained = {n: p for n, p in model.llm.named_parameters() if p.requires_grad}
    assert trained and [n for n, p in trained.items() if p.grad is None] == []
    unread = unread_tower_modules(model.llm)
    assert unread == {"qwen2_5_vl": [], "gemma3": ["model.vision_tower.head"],  # the tiny LLaVA: 2 CLIP layers
                      "llava": ["model.vision_tower.encoder.layers.1", "model.vision_tower.post_layernorm"]}[arch]
    assert not any(f"{module}." in n for module in unread for n in trained)


def test_qlora_quantizes_the_language_model_only(vlm_dirs):
    pytest.importorskip("bitsandbytes")
    import bitsandbytes as bnb
    from transformers import BitsAndBytesConfig
    quant = dict(type=BitsAndBytesConfig, load_in_4bit=True, bnb_4bit_quant_type="nf4",
                 bnb_4bit_compute_dtype="torch.float32")
    model = make_vlm(vlm_dirs["qwen2_5_vl"], lora=dict(r=4, lora_alpha=8, lora_dropout=0.0),
                     quantization_config=quant)
    quantized = {n for n, m in model.llm.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    from transformers import AutoModelForImageTextToText
    plain = AutoModelForImageTextToText.from_pretrained(vlm_dirs["qwen2_5_vl"]).get_decoder()
    linear = {n for n, m in plain.named_modules() if isinstance(m, torch.nn.Linear)}
    assert len(quantized) == len(linear) > 0 and all(".language_model.layers." in n for n in quantized)
    assert not any(isinstance(p, bnb.nn.Params4bit) for p in vision_parameters(model.llm).values())
    assert type(model.llm.get_base_model().get_output_embeddings()) is torch.nn.Linear
    assert tuple(mode for mode, _ in trained_parts(model.llm).values()) == ("frozen", "frozen", "LoRA")


def test_the_auto_class_follows_the_checkpoint(vlm_dirs, tiny_qwen2_dir, tmp_path):
    """What `sfttool chat` and `convert merge` load a folder with; an adapter folder by its base model's."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    assert language_model_class(tiny_qwen2_dir) is AutoModelForCausalLM
    assert {language_model_class(d) for d in vlm_dirs.values()} == {AutoModelForImageTextToText}
    make_vlm(vlm_dirs["llava"], lora=dict(r=4)).llm.save_pretrained(tmp_path / "adapter")
    assert language_model_class(tmp_path / "adapter") is AutoModelForImageTextToText


def test_sequence_parallelism_is_refused_for_a_vision_language_checkpoint(vlm_dirs):
    from sfttool.engine.checks import check_built_model
    from sfttool.parallel.groups import SequenceParallelError
    with pytest.raises(SequenceParallelError, match="sequence_parallel_size=2: sequence parallelism is not available "
                                                    "for vision-language checkpoints \\(Gemma3ForConditionalGeneration"):
        check_built_model(make_vlm(vlm_dirs["gemma3"]), 2)
