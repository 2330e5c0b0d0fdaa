"""SupervisedFinetune: building, forward modes, the loss, checkpoints."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sfttool.model import loss as L


def batch_of(rows, samples_per_row):
    return rows.collate([rows.pack(s) for s in samples_per_row])


def reference_loss(model, data, reduction="token"):
    """Plain per-row shifted CE, computed sample by sample on the unpacked samples."""
    per_sample = []
    for ids, labels, pos in zip(data["input_ids"], data["labels"], data["position_ids"]):
        starts = (pos == 0).nonzero().flatten().tolist() + [len(pos)]
        for a, b in zip(starts, starts[1:]):
            logits = model.llm(input_ids=ids[None, a:b], use_cache=False).logits[0]
            ce = F.cross_entropy(logits[:-1], labels[a + 1:b], reduction="none", ignore_index=-100)
            n = int((labels[a + 1:b] != -100).sum())
            if n:
                per_sample.append((ce.sum(), n))
    if reduction == "token":
        return sum(s for s, _ in per_sample) / sum(n for _, n in per_sample)
    return sum(s / n for s, n in per_sample) / len(per_sample)


def test_shift_targets_never_cross_a_sample_start():
    labels = torch.tensor([[-100, 5, 6, 7, 8, 9, -100]])
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 0]])  # two samples, then a padding pseudo-sample
    assert L.shift_targets(labels, positions).tolist() == [[5, 6, -100, 8, 9, -100, -100]]
    assert L.count_loss_units(labels, positions, "token") == 4
    assert L.count_loss_units(labels, positions, "sample") == 2
    # A sample whose only labelled token is its first one trains nothing.
    assert L.count_loss_units(torch.tensor([[1, -100, 2, -100]]), torch.tensor([[0, 1, 0, 1]]), "sample") == 0


@pytest.mark.parametrize("reduction", ["token", "sample"])
def test_loss_matches_per_sample_reference(tiny_llama_dir, make_sft, rows, reduction):
    model = make_sft(tiny_llama_dir, loss_reduction=reduction)
    samples = rows.make_samples(5, seed=1)
    data = batch_of(rows, [samples[:3], samples[3:]])
    loss = model(data, mode="loss")["loss"]
    assert torch.allclose(loss, reference_loss(model, data, reduction), atol=1e-5)
    units = model.count_loss_units(data)
    expected_units = 5 if reduction == "sample" else sum(
        sum(1 for x in s["labels"][1:] if x != -100) for s in samples)
    assert units == expected_units


def test_loss_normalizer_replaces_the_local_count(tiny_llama_dir, make_sft, rows):
    model = make_sft(tiny_llama_dir)
    data = batch_of(rows, [rows.make_samples(3, seed=2)])
    local = model(data, mode="loss")["loss"]
    scaled = model({**data, "loss_normalizer": 2.5}, mode="loss")["loss"]
    assert torch.allclose(scaled, local * model.count_loss_units(data) / 2.5, rtol=1e-6)


def test_forward_modes(tiny_llama_dir, make_sft, rows):
    model = make_sft(tiny_llama_dir)
    data = batch_of(rows, [rows.make_samples(2, seed=3), rows.make_samples(1, seed=4)])
    batch, seq = data["input_ids"].shape
    logits = model(data, mode="tensor")
    assert logits.shape == (batch, seq, model.llm.config.vocab_size)
    predicted = model(data, mode="predict")
    assert len(predicted) == batch and torch.equal(predicted[0]["logits"], logits[0])
    with pytest.raises(NotImplementedError, match="mode must be"):
        model(data, mode="bogus")


def test_bad_loss_reduction_is_a_clear_error(tiny_llama_dir, make_sft):
    from sfttool.registry import ConfigBuildError

    with pytest.raises(ConfigBuildError, match="loss_reduction must be one of"):
        make_sft(tiny_llama_dir, loss_reduction="mean")


@pytest.mark.parametrize("dtype", ["bfloat16", "torch.bfloat16", torch.bfloat16])
def test_dtype_spellings_build(tiny_llama_dir, dtype):
    from sfttool.model import SupervisedFinetune

    # The dotted type name and a dtype string are what Config.dump writes back.
    model = SupervisedFinetune(llm=dict(type="transformers.AutoModelForCausalLM.from_pretrained",
                                        pretrained_model_name_or_path=str(tiny_llama_dir), torch_dtype=dtype))
    assert model.llm.dtype == torch.bfloat16
    assert model.llm.config.use_cache is False


def test_unknown_dtype_names_the_fix():
    from sfttool.model import to_torch_dtype

    from sfttool.registry import ConfigBuildError

    with pytest.raises(ConfigBuildError, match="dtype: unknown dtype 'bf16x'; use 'bfloat16'"):
        to_torch_dtype("bf16x")


def test_full_finetune_state_dict_is_the_llm(tiny_llama_dir, make_sft):
    model = make_sft(tiny_llama_dir)
    keys = set(model.state_dict())
    assert keys == {"llm." + k for k in model.llm.state_dict()}


def test_lora_targets_all_linear_layers_but_the_head(tiny_llama_dir, make_sft):
    from peft import LoraConfig

    model = make_sft(tiny_llama_dir, lora=dict(type=LoraConfig, r=4, lora_alpha=8))
    assert set(model.lora.target_modules) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                         "down_proj"}
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert not any("lm_head" in n for n in trainable)
    assert model.lora.task_type == "CAUSAL_LM"


def test_lora_state_dict_holds_only_the_adapter_and_loads_back(tiny_llama_dir, make_sft):
    from peft import LoraConfig

    lora = dict(type=LoraConfig, r=4, lora_alpha=8, lora_dropout=0.0)
    trained = make_sft(tiny_llama_dir, lora=lora, seed=0)
    with torch.no_grad():
        for name, p in trained.named_parameters():
            if "lora_B" in name:
                p.add_(0.01)  # make the adapter non-trivial
    state = trained.state_dict()
    assert state and all("lora_" in k for k in state)
    assert len(state) == 2 * 7 * trained.llm.config.num_hidden_layers  # A and B per linear layer
    fresh = make_sft(tiny_llama_dir, lora=lora, seed=1)
    result = fresh.load_state_dict(state, strict=False)
    assert not result.unexpected_keys
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, state[k])


def test_peft_model_loads_an_adapter_folder_and_a_checkpoint(tiny_llama_dir, make_sft, rows, tmp_path):
    from peft import LoraConfig

    lora = dict(type=LoraConfig, r=4, lora_alpha=8, lora_dropout=0.0)
    trained = make_sft(tiny_llama_dir, lora=lora)
    with torch.no_grad():
        for name, p in trained.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)
    data = batch_of(rows, [rows.make_samples(2, seed=5)])
    want = trained(data, mode="tensor")
    trained.llm.save_pretrained(tmp_path / "adapter")
    torch.save({"state_dict": trained.state_dict(), "meta": {"epoch": 1}}, tmp_path / "iter_1.pth")
    for source in (tmp_path / "adapter", tmp_path / "iter_1.pth"):
        loaded = make_sft(tiny_llama_dir, lora=lora, seed=7, peft_model=str(source))
        assert torch.allclose(loaded(data, mode="tensor"), want, atol=1e-6)


def test_peft_model_errors(tiny_llama_dir, make_sft, tmp_path):
    from peft import LoraConfig

    from sfttool.registry import ConfigBuildError

    with pytest.raises(ConfigBuildError, match="model.lora is None"):
        make_sft(tiny_llama_dir, peft_model=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        make_sft(tiny_llama_dir, lora=dict(type=LoraConfig, r=4), peft_model=str(tmp_path / "nope"))


def test_tokenizer_growth_resizes_embeddings(tiny_llama_dir, tiny_tokenizer_bos_dir, make_sft):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_bos_dir)
    tokenizer.add_tokens(["<tool_call>", "</tool_call>"], special_tokens=True)
    model = make_sft(tiny_llama_dir, tokenizer=tokenizer)
    assert model.llm.get_input_embeddings().num_embeddings == len(tokenizer)
    assert model.llm.get_output_embeddings().out_features == len(tokenizer)


def test_max_position_embeddings_scales_rope(tiny_llama_dir, make_sft):
    model = make_sft(tiny_llama_dir, max_position_embeddings=3000)  # fixture context: 1024
    rope = model.llm.config.rope_parameters
    assert rope["rope_type"] == "linear" and rope["factor"] == 3.0


def test_activation_checkpointing_keeps_gradients(tiny_llama_dir, make_sft, rows):
    data = batch_of(rows, [rows.make_samples(3, seed=6)])
    grads = []
    for checkpointing in (False, True):
        model = make_sft(tiny_llama_dir, use_activation_checkpointing=checkpointing)
        assert model.llm.is_activation_checkpointing is checkpointing
        model.train()
        model(data, mode="loss")["loss"].backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6)
    model.gradient_checkpointing_disable()
    assert model.llm.is_activation_checkpointing is False


def test_init_weights_leaves_pretrained_weights(tiny_llama_dir, make_sft):
    model = make_sft(tiny_llama_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.init_weights()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("use_lora", [False, True])
def test_a_few_steps_lower_the_loss(tiny_qwen2_dir, make_sft, rows, use_lora):
    from peft import LoraConfig

    lora = dict(type=LoraConfig, r=8, lora_alpha=16, lora_dropout=0.0) if use_lora else None
    model = make_sft(tiny_qwen2_dir, lora=lora, use_activation_checkpointing=True)
    model.train()
    data = batch_of(rows, [rows.make_samples(4, seed=8)])
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(6):
        loss = model(data, mode="loss")["loss"]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses


def test_mmengine_train_step_with_collated_batch(tiny_llama_dir, make_sft, rows):
    """The path the runner takes: {'data': ..., 'data_samples': None} through the
    data preprocessor into forward(mode='loss'), a float normaliser riding along."""
    from mmengine.optim import OptimWrapper

    model = make_sft(tiny_llama_dir)
    data = batch_of(rows, [rows.make_samples(3, seed=9)])
    optim_wrapper = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1))
    before = model(data, mode="loss")["loss"].item()
    normalizer = float(model.count_loss_units(data))
    log_vars = model.train_step({"data": {**data, "loss_normalizer": normalizer}, "data_samples": None},
                                optim_wrapper)
    assert log_vars["loss"].item() == pytest.approx(before, rel=1e-6)
    assert model(data, mode="loss")["loss"].item() < before


def test_unchunked_loss_computes_logits_only_where_trained(tiny_llama_dir, make_sft, rows):
    """The head runs on trained positions only (transformers' boolean logits_to_keep)."""
    model = make_sft(tiny_llama_dir, loss_implementation="unchunked")
    data = batch_of(rows, [rows.make_samples(3, seed=10)])
    seen = []
    model.llm.lm_head.register_forward_hook(lambda m, args, out: seen.append(tuple(out.shape)))
    model(data, mode="loss")
    assert seen == [(model.count_loss_units(data), model.llm.config.vocab_size)]


def test_quantization_dict_becomes_bitsandbytes_config():
    from transformers import BitsAndBytesConfig

    from sfttool.model.build import build_quantization_config

    cfg = build_quantization_config(dict(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                         bnb_4bit_compute_dtype="torch.bfloat16"))
    assert isinstance(cfg, BitsAndBytesConfig)
    assert cfg.load_in_4bit and cfg.bnb_4bit_compute_dtype == torch.bfloat16


@pytest.mark.parametrize("gpu, flash_attn", [(False, False), (False, True), (True, False), (True, True)])
def test_attention_backend_choice(monkeypatch, caplog, gpu, flash_attn):
    """Flash-attention 2 only when varlen attention is asked for and both a GPU and the package are
    there; SDPA (which isolates packed samples too) otherwise, with a warning when varlen was asked for.
    The two probes the choice reads are set, so every case runs on every machine, GPU or not."""
    import transformers.utils

    from sfttool.model.build import default_attn_implementation, normalise_llm_args

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda: flash_attn)
    with caplog.at_level("WARNING", logger="sfttool.model.build"):
        assert default_attn_implementation(False) == "sdpa"
        assert caplog.records == []
        want = "flash_attention_2" if gpu and flash_attn else "sdpa"
        assert default_attn_implementation(True) == want
        assert normalise_llm_args({}, True, None)["attn_implementation"] == want
    assert len(caplog.records) == (0 if want == "flash_attention_2" else 2)
    assert all("flash-attention 2 is not usable here; using SDPA" in r.getMessage() for r in caplog.records)
    # A backend the config names is kept, whatever the machine has.
    assert normalise_llm_args({"attn_implementation": "eager"}, True, None)["attn_implementation"] == "eager"


def test_a_named_attention_backend_is_what_the_model_runs(tiny_llama_dir, make_sft):
    assert make_sft(tiny_llama_dir, attn="eager").llm.config._attn_implementation == "eager"


def test_a_built_module_is_used_as_is(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    from sfttool.model import SupervisedFinetune

    llm = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    model = SupervisedFinetune(llm=llm, use_activation_checkpointing=False)
    assert model.llm is llm and llm.config.use_cache is False


def test_count_loss_units_takes_the_dataloader_batch_too(tiny_llama_dir, make_sft, rows):
    model = make_sft(tiny_llama_dir)
    data = batch_of(rows, [rows.make_samples(3, seed=15)])
    assert model.count_loss_units({"data": data, "data_samples": None}) == model.count_loss_units(data) > 0


def test_bfloat16_model_gets_a_float32_loss(tiny_llama_dir, make_sft, rows):
    from transformers import AutoModelForCausalLM

    from sfttool.model import SupervisedFinetune

    data = batch_of(rows, [rows.make_samples(3, seed=17)])
    want = make_sft(tiny_llama_dir)(data, mode="loss")["loss"]
    llm = dict(type=AutoModelForCausalLM.from_pretrained, pretrained_model_name_or_path=str(tiny_llama_dir),
               dtype="bfloat16")
    got = SupervisedFinetune(llm=llm, use_activation_checkpointing=False)(data, mode="loss")["loss"]
    assert got.dtype == torch.float32
    assert got.item() == pytest.approx(want.item(), rel=2e-2)
