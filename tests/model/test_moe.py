"""Mixture-of-experts models (tiny random Qwen3-MoE, Mixtral, DeepSeek-V3 built offline): full, LoRA
and QLoRA training, where LoRA goes (attention, experts, never the router unless named), and the
router's load-balancing loss checked against the model's own ``output_router_logits=True`` loss."""
from __future__ import annotations

import pytest
import torch

from sfttool.model import moe
from sfttool.model.step_metrics import step_means
from sfttool.registry import ConfigBuildError

ARCHS = ("qwen3_moe", "mixtral", "deepseek_v3")
WITH_AUX_LOSS = ("qwen3_moe", "mixtral")  # DeepSeek-V3 balances by a bias correction, not a loss


def lora(**kwargs):
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, **kwargs)


def unpacked_batch(rows, n=2, length=12, seed=0):
    """``n`` rows of one sample each, all ``length`` tokens (no padding), every row trained."""
    samples = rows.make_samples(n, seed=seed, lengths=(length, length))
    return rows.collate([rows.as_row(s) for s in samples])


def trainable(model) -> list[str]:
    return [name for name, p in model.named_parameters() if p.requires_grad]


def one_step(model, data, lr=1e-2):
    """One SGD step; returns {name: change} of the trainable parameters."""
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    model(data, mode="loss")["loss"].backward()
    optimizer.step()
    return {n: (p.detach() - before[n]).abs().max().item() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("arch", ARCHS)
def test_full_fine_tuning_trains_experts_and_router(arch, tiny_moe_dir, make_sft, rows):
    model = make_sft(tiny_moe_dir(arch))
    changed = one_step(model, unpacked_batch(rows))
    moved = {n for n, v in changed.items() if v > 0}
    assert any(n.endswith("experts.gate_up_proj") for n in moved) and any(n.endswith("experts.down_proj") for n in moved)
    assert any(n.endswith(".mlp.gate.weight") for n in moved)  # the router learns through its routing weights
    if arch == "deepseek_v3":
        assert any("shared_experts" in n for n in moved)


@pytest.mark.parametrize("arch", ARCHS)
def test_lora_default_targets_attention_and_experts_not_the_router(arch, tiny_moe_dir, make_sft, rows):
    model = make_sft(tiny_moe_dir(arch), lora=lora())
    names = trainable(model)
    assert names and all("lora_" in n for n in names)
    assert any("self_attn" in n for n in names)
    assert any(".experts.lora_A" in n for n in names)  # the fused 3-D expert weights, through target_parameters
    assert not any(".gate.lora" in n or "router" in n for n in names)
    assert {"experts.gate_up_proj", "experts.down_proj"} <= set(model.llm.peft_config["default"].target_parameters)
    changed = one_step(model, unpacked_batch(rows))
    assert all(v > 0 for n, v in changed.items() if "lora_B" in n)  # every adapter got a gradient


@pytest.mark.parametrize("which, present, absent", [
    ("attention", ("self_attn",), (".experts.", "shared_experts", "mlp.")),
    ("experts", (".experts.", "shared_experts"), ("self_attn", "layers.0.mlp")),
])
def test_lora_targets_attention_or_experts(which, present, absent, tiny_moe_dir, make_sft):
    from sfttool.model.lora import chosen_targets

    model = make_sft(tiny_moe_dir("deepseek_v3"), lora=lora(), lora_targets=which)
    names = trainable(model)
    for part in present:
        assert any(part in n for n in names), (part, names)
    for part in absent:
        assert not any(part in n for n in names), (part, names)
    modules, parameters = chosen_targets(model.llm.get_base_model(), which)
    assert (parameters is None) == (which == "attention")


def test_lora_on_the_router_only_when_named(tiny_moe_dir, make_sft):
    model = make_sft(tiny_moe_dir("qwen3_moe"), lora=lora(target_modules=["q_proj"], target_parameters=["gate.weight"]))
    names = trainable(model)
    assert any(".mlp.gate.lora_A" in n for n in names) and any("q_proj.lora_A" in n for n in names)
    assert not any(".experts." in n for n in names)


@pytest.mark.parametrize("key, target, closest", [
    ("target_modules", "q_prj", "q_proj"),
    ("target_parameters", "experts.gate_up", "experts.gate_up_proj"),
])
def test_a_lora_target_matching_nothing_is_one_line_with_the_closest_names(key, target, closest, tiny_moe_dir,
                                                                          make_sft):
    with pytest.raises(ConfigBuildError) as err:
        make_sft(tiny_moe_dir("qwen3_moe"), lora=lora(**{key: [target]}))
    message = str(err.value)
    assert "\n" not in message and f"model.lora.{key}: {target!r} matches no" in message and closest in message


def test_expert_targets_on_a_dense_model_are_refused(tiny_qwen2_dir, make_sft):
    with pytest.raises(ConfigBuildError, match="lora_targets='experts'.*not a mixture-of-experts"):
        make_sft(tiny_qwen2_dir, lora=lora(), lora_targets="experts")


# ---------------------------------------------------------------------------
# The load-balancing loss.

@pytest.mark.parametrize("arch", WITH_AUX_LOSS)
@pytest.mark.parametrize("implementation", ["chunked", "unchunked"])
def test_training_loss_equals_the_models_own_with_router_logits(arch, implementation, tiny_moe_dir, make_sft, rows):
    """On an unpacked, unpadded batch the objective is the model's own loss with
    ``output_router_logits=True``: token-mean cross-entropy + coef x aux loss."""
    model = make_sft(tiny_moe_dir(arch), loss_implementation=implementation, router_aux_loss_coef=0.3)
    data = unpacked_batch(rows, n=3)
    out = model(data, mode="loss")
    reference = model.llm(input_ids=data["input_ids"], labels=data["labels"], output_router_logits=True,
                          use_cache=False)
    # the model's own loss uses its config's coefficient; ours the override
    expected = reference.loss - model.llm.config.router_aux_loss_coef * reference.aux_loss + 0.3 * reference.aux_loss
    torch.testing.assert_close(out["loss"], expected, rtol=1e-5, atol=1e-6)
    shown = step_means(out)
    assert shown["aux_loss"] == pytest.approx(reference.aux_loss.item(), rel=1e-5)
    assert shown["loss"] == pytest.approx((reference.loss - model.llm.config.router_aux_loss_coef
                                           * reference.aux_loss).item(), rel=1e-5)


def test_the_models_coefficient_is_the_default(tiny_moe_dir, make_sft, rows):
    model = make_sft(tiny_moe_dir("qwen3_moe"))
    data = unpacked_batch(rows)
    assert model.router_aux_loss_coef == model.llm.config.router_aux_loss_coef == 0.001
    reference = model.llm(input_ids=data["input_ids"], labels=data["labels"], output_router_logits=True)
    torch.testing.assert_close(model(data, mode="loss")["loss"], reference.loss, rtol=1e-5, atol=1e-6)


def test_coefficient_zero_leaves_the_loss_out(tiny_moe_dir, make_sft, rows):
    model = make_sft(tiny_moe_dir("mixtral"), router_aux_loss_coef=0)
    data = unpacked_batch(rows)
    out = model(data, mode="loss")
    assert "aux_loss" not in step_means(out)
    torch.testing.assert_close(out["loss"], model.llm(input_ids=data["input_ids"], labels=data["labels"]).loss)


def test_aux_loss_leaves_out_padding(tiny_moe_dir, make_sft, rows):
    """A padded batch's aux loss is the one of its real tokens: a short row padded beside a long one
    gives what the two rows give unpadded, each in a forward of its own, weighed by their tokens."""
    model = make_sft(tiny_moe_dir("qwen3_moe"), router_aux_loss_coef=0.5)
    short, long = rows.make_samples(2, seed=3, lengths=(6, 6))[0], rows.make_samples(1, seed=4, lengths=(14, 14))[0]
    padded = rows.collate([rows.as_row(short), rows.as_row(long)])
    with moe.recorded_router_logits(model.llm) as logits:
        model.llm(input_ids=padded["input_ids"], position_ids=padded["position_ids"], use_cache=False)
    real = torch.cat([torch.ones(2, 6), torch.tensor([[0.0] * 8, [1.0] * 8])], dim=1)
    expected = moe.load_balancing_loss(model.llm, logits, real)
    got = step_means(model(padded, mode="loss"))["aux_loss"]
    assert got == pytest.approx(expected.item(), rel=1e-6)
    with_padding = moe.load_balancing_loss(model.llm, logits, torch.ones(2, 14))
    assert abs(got - with_padding.item()) > 1e-4  # the padding would have changed it


def test_accumulation_weighs_each_micro_batch_by_its_tokens(tiny_moe_dir, make_sft, rows):
    """Two micro-batches with the step's normaliser: sum of their losses = token mean over the step of
    (cross-entropy + coef x the aux loss of the token's forward)."""
    coef = 0.2
    model = make_sft(tiny_moe_dir("qwen3_moe"), router_aux_loss_coef=coef)
    batches = [unpacked_batch(rows, n=1, length=10, seed=1), unpacked_batch(rows, n=2, length=16, seed=2)]
    units = [model.count_loss_units(b) for b in batches]
    total = sum(model(dict(b, loss_normalizer=sum(units)), mode="loss")["loss"] for b in batches)
    expected = 0.0
    for batch, n in zip(batches, units):
        own = model.llm(input_ids=batch["input_ids"], labels=batch["labels"], output_router_logits=True)
        ce = own.loss - model.llm.config.router_aux_loss_coef * own.aux_loss
        expected = expected + n * (ce + coef * own.aux_loss)
    torch.testing.assert_close(total, expected / sum(units), rtol=1e-5, atol=1e-6)


def test_a_model_without_a_balancing_loss_refuses_the_coefficient(tiny_moe_dir, make_sft):
    with pytest.raises(ConfigBuildError, match=r"router_aux_loss_coef=0.01: DeepseekV3ForCausalLM has no router"):
        make_sft(tiny_moe_dir("deepseek_v3"), router_aux_loss_coef=0.01)


def test_lora_all_on_shared_experts_and_dense_layers(tiny_moe_dir, make_sft):
    """DeepSeek-V3's shared experts and dense first layer keep their LoRA (peft would rename targets
    ending in gate_proj/up_proj/down_proj into expert parameters: ``compat.peft_targets_as_given``)."""
    names = trainable(make_sft(tiny_moe_dir("deepseek_v3"), lora=lora()))
    for module in ("layers.0.mlp.gate_proj", "layers.0.mlp.down_proj", "layers.1.mlp.shared_experts.up_proj",
                   "layers.1.mlp.shared_experts.down_proj", "layers.1.self_attn.kv_b_proj"):
        assert any(f"{module}.lora_A" in n for n in names), module


@pytest.mark.parametrize("arch", ARCHS)
def test_qlora_trains_adapters_on_quantized_attention_and_bf16_experts(arch, tiny_moe_dir, rows):
    """bitsandbytes quantizes the Linear layers only: the fused experts stay in the load dtype (bf16 here,
    not upcast to float32 as peft's kbit preparation would), and their adapters train."""
    pytest.importorskip("bitsandbytes")
    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from sfttool.model import SupervisedFinetune

    torch.manual_seed(0)
    quant = dict(type=BitsAndBytesConfig, load_in_4bit=True, bnb_4bit_quant_type="nf4",
                 bnb_4bit_compute_dtype="torch.bfloat16")
    model = SupervisedFinetune(llm=dict(type=AutoModelForCausalLM.from_pretrained, dtype="bfloat16",
                                        pretrained_model_name_or_path=str(tiny_moe_dir(arch)), quantization_config=quant),
                               lora=lora(), use_activation_checkpointing=True)
    base = model.llm.get_base_model()
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in base.modules())
    experts = [p for n, p in base.named_parameters() if n.endswith("experts.base_layer.weight") or p.dim() == 3]
    assert experts and all(p.dtype == torch.bfloat16 for p in experts)
    assert all(p.dtype == torch.float32 for n, p in base.named_parameters() if "norm" in n)
    changed = one_step(model, unpacked_batch(rows), lr=0.1)
    assert any(".experts.lora_B" in n for n in changed)
    assert all(v > 0 for n, v in changed.items() if "lora_B" in n)


def test_lora_dropout_with_fused_experts_is_one_line(tiny_moe_dir, make_sft):
    from peft import LoraConfig

    with pytest.raises(ConfigBuildError, match=r"^model.lora.lora_dropout=0.1: LoRA on fused expert weights "
                                               r"\(experts.down_proj, experts.gate_up_proj\) runs without dropout"):
        make_sft(tiny_moe_dir("mixtral"), lora=LoraConfig(r=4, lora_dropout=0.1))
    make_sft(tiny_moe_dir("mixtral"), lora=LoraConfig(r=4, lora_dropout=0.1), lora_targets="attention")


def test_activation_checkpointing_gives_the_same_gradients_aux_loss_included(tiny_moe_dir, make_sft, rows):
    """The router logits are recorded in the forward; the recompute in backward records nothing more,
    and the aux loss's gradient reaches the router as without checkpointing."""
    data = unpacked_batch(rows, n=2)
    grads = []
    for checkpointing in (False, True):
        model = make_sft(tiny_moe_dir("mixtral"), router_aux_loss_coef=0.5, use_activation_checkpointing=checkpointing)
        model.train()
        model(data, mode="loss")["loss"].backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7)
    assert grads[0]["llm.model.layers.0.mlp.gate.weight"].abs().max() > 0


def inline_moe(kind: str):
    """Tiny random Qwen2-MoE (a shared expert behind a one-output gate) or GLM-4-MoE (shared experts,
    a dense first layer, no aux loss), float32."""
    from transformers import AutoModelForCausalLM, Glm4MoeConfig, Qwen2MoeConfig

    common = dict(vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=2, moe_intermediate_size=32)
    torch.manual_seed(0)
    if kind == "qwen2_moe":
        config = Qwen2MoeConfig(**common, num_experts=4, shared_expert_intermediate_size=64)
    else:
        config = Glm4MoeConfig(**common, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
                               topk_group=1, head_dim=16)
    return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("kind", ["qwen2_moe", "glm4_moe"])
def test_other_shared_expert_families_keep_routers_and_gates_out_of_lora(kind):
    from sfttool.model.lora import chosen_targets

    llm = inline_moe(kind)
    modules, parameters = chosen_targets(llm, "all")
    assert parameters == ["experts.down_proj", "experts.gate_up_proj"]
    shared = "shared_expert" if kind == "qwen2_moe" else "shared_experts"
    assert {f"{shared}.gate_proj", f"{shared}.up_proj", f"{shared}.down_proj", "self_attn.q_proj"} <= set(modules)
    assert not any("gate" in m and not m.endswith("gate_proj") for m in modules)  # no router, no shared_expert_gate
    assert (moe.aux_loss_function(llm) is not None) == (kind == "qwen2_moe")


def test_qwen2_moe_aux_loss_equals_the_models_own():
    from sfttool.model import SupervisedFinetune

    model = SupervisedFinetune(llm=inline_moe("qwen2_moe"), use_activation_checkpointing=False)
    ids = torch.randint(3, 500, (2, 12), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[:, :4] = -100
    out = model({"input_ids": ids, "labels": labels}, mode="loss")
    reference = model.llm(input_ids=ids, labels=labels, output_router_logits=True, use_cache=False)
    torch.testing.assert_close(out["loss"], reference.loss, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arch", ARCHS)
def test_packed_rows_give_the_unpacked_lm_loss(arch, tiny_moe_dir, make_sft, rows):
    """Routing is per token, so packing changes nothing in the LM loss (the aux loss, left out here, is
    per forward by design: docs/moe.md)."""
    model = make_sft(tiny_moe_dir(arch), router_aux_loss_coef=0 if arch in WITH_AUX_LOSS else None)
    samples = rows.make_samples(4, seed=5)
    packed = step_means(model(rows.collate([rows.pack(samples[:3]), rows.as_row(samples[3])]), mode="loss"))["loss"]
    each = [model(rows.collate([rows.as_row(s)]), mode="loss") for s in samples]
    totals = [step_means(o)["loss"] * model.count_loss_units(rows.collate([rows.as_row(s)]))
              for o, s in zip(each, samples)]
    units = sum(model.count_loss_units(rows.collate([rows.as_row(s)])) for s in samples)
    assert packed == pytest.approx(sum(totals) / units, rel=1e-5)


def test_lora_targets_without_lora_is_one_line(tiny_moe_dir, make_sft):
    with pytest.raises(ConfigBuildError, match=r"^model.lora_targets='experts' chooses where LoRA goes, but "
                                               r"model.lora is None"):
        make_sft(tiny_moe_dir("qwen3_moe"), lora_targets="experts")
