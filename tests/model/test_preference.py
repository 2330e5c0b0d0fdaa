"""DPO and ORPO on the tiny models: log-probs against a plain transformers forward, every loss type
against a formula written here, step 0 = ln 2, packed = unpacked, pairs isolated, micro-batch
invariance, and the LoRA reference (adapter disabled) = the base model loaded on its own."""
from __future__ import annotations

import math
import random

import pytest
import torch

from sfttool.dataset.collate_fns import preference_collate_fn
from sfttool.model.preference_loss import DPO_LOSS_TYPES
from sfttool.model.step_metrics import step_means

RTOL = 1e-5


def make_pairs(n: int, seed: int = 0, vocab: int = 500) -> list[dict]:
    """``n`` pairs: a shared random prompt (masked) and two different random answers (trained)."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 8))]
        sides = {}
        for side in ("chosen", "rejected"):
            answer = [rng.randrange(3, vocab) for _ in range(rng.randint(2, 9))]
            sides[side] = (prompt + answer, [-100] * len(prompt) + answer)
        pairs.append(sides)
    return pairs


def row_of(pairs: list[dict]) -> dict:
    """Pairs -> one dataset row (chosen, rejected, chosen, rejected, ...)."""
    row = {"input_ids": [], "labels": [], "position_ids": [], "sample_lengths": []}
    for pair in pairs:
        for ids, labels in (pair["chosen"], pair["rejected"]):
            row["input_ids"] += ids
            row["labels"] += labels
            row["position_ids"] += list(range(len(ids)))
            row["sample_lengths"].append(len(ids))
    return row


def batch(rows: list[dict]) -> dict:
    return preference_collate_fn(rows, pad_index=0)["data"]


def plain_logp(llm, ids: list[int], labels: list[int]) -> tuple[float, int]:
    """Summed log-prob of the trained tokens and their count, from a plain one-sequence forward."""
    with torch.no_grad():
        logp = llm(input_ids=torch.tensor([ids])).logits[0].double().log_softmax(-1)  # [seq, vocab]
    trained = [t for t in range(1, len(ids)) if labels[t] != -100]
    return float(sum(logp[t - 1, ids[t]] for t in trained)), len(trained)


def load_llm(model_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")


def make_model(cls_name: str, model_dir, seed: int = 0, **kwargs):
    from transformers import AutoModelForCausalLM

    from sfttool import model as M
    torch.manual_seed(seed)
    llm = dict(type=AutoModelForCausalLM.from_pretrained, pretrained_model_name_or_path=str(model_dir),
               dtype="float32", attn_implementation=kwargs.pop("attn", "sdpa"))
    kwargs.setdefault("use_activation_checkpointing", False)
    return getattr(M, cls_name)(llm=llm, **kwargs)


def perturb(module: torch.nn.Module, seed: int = 1, scale: float = 0.02) -> None:
    """Move the trainable weights, so that the policy differs from the reference."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=gen) * scale)


def grads_of(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_close(got, want, rtol=RTOL):
    assert torch.allclose(torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(want, dtype=torch.float64),
                          rtol=rtol, atol=1e-7), (got, want)


LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=None)


def lora_cfg():
    from peft import LoraConfig
    return dict(type=LoraConfig, **LORA)


# --- log-probs -------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_sequence_logps_equal_a_plain_forward_per_sequence(arch, tiny_llama_dir, tiny_qwen2_dir):
    model_dir = {"llama": tiny_llama_dir, "qwen2": tiny_qwen2_dir}[arch]
    model = make_model("DPO", model_dir)
    pairs = make_pairs(5, seed=3)
    data = batch([row_of(pairs[:3]), row_of(pairs[3:])])  # two packed rows, the second padded
    sums, counts = model.sequence_logps(data)
    plain = load_llm(model_dir)
    want = [plain_logp(plain, *pair[side]) for pair in pairs for side in ("chosen", "rejected")]
    assert_close(sums, [w[0] for w in want])
    assert counts.tolist() == [w[1] for w in want]


def test_chunked_log_probs_and_gradients_equal_the_unchunked_ones(tiny_llama_dir):
    """The default path runs the head over chunks of trained positions (no [n, vocab] logits);
    'unchunked' computes every trained position's logits at once. Same sums, same gradients."""
    data = batch([row_of(make_pairs(3, seed=5)), row_of(make_pairs(2, seed=6))])
    results = []
    for implementation, chunk in (("chunked", 7), ("unchunked", 512)):
        model = make_model("DPO", tiny_llama_dir, loss_implementation=implementation, loss_chunk_size=chunk)
        sums, _ = model.sequence_logps(data)
        sums.sum().backward()
        results.append((sums.detach(), grads_of(model)))
    (chunked, chunked_grads), (plain, plain_grads) = results
    assert_close(chunked, plain.tolist())
    for name, grad in plain_grads.items():
        torch.testing.assert_close(chunked_grads[name], grad, rtol=1e-5, atol=1e-6)


# --- step 0 ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_step0_sigmoid_loss_is_ln2_and_rewards_are_zero(tiny_llama_dir, lora):
    model = make_model("DPO", tiny_llama_dir, lora=lora_cfg() if lora else None)
    out = model(batch([row_of(make_pairs(4, seed=5))]), mode="loss")
    shown = step_means(out)
    assert abs(out["loss"].item() - math.log(2)) < 1e-6 and abs(shown["loss"] - math.log(2)) < 1e-6
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert abs(shown[key]) < 1e-6, key
    assert shown["rewards/accuracies"] == 0.0  # no pair has chosen > rejected when all rewards are 0


# --- every loss type against its formula ----------------------------------------------------------


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def formula(loss_type, pc, pr, rc, rr, beta, ls, gamma=0.5):
    """Per-pair losses written out from the papers / XTuner's definitions, one pair at a time."""
    n = len(pc)
    if loss_type == "kto_pair":
        ckl = max(sum(pc[i] - rc[i] for i in range(n)) / n, 0.0)
        rkl = max(sum(pr[i] - rr[i] for i in range(n)) / n, 0.0)
    out = []
    for i in range(n):
        if loss_type == "simpo":
            z = beta * (pc[i] - pr[i]) - gamma
            out.append(-(1 - ls) * log_sigmoid(z) - ls * log_sigmoid(-z))
            continue
        h = (pc[i] - rc[i]) - (pr[i] - rr[i])
        if loss_type == "sigmoid":
            out.append(-(1 - ls) * log_sigmoid(beta * h) - ls * log_sigmoid(-beta * h))
        elif loss_type == "robust":
            out.append((-(1 - ls) * log_sigmoid(beta * h) + ls * log_sigmoid(-beta * h)) / (1 - 2 * ls))
        elif loss_type == "hinge":
            out.append(max(0.0, 1 - beta * h))
        elif loss_type == "ipo":
            out.append((h - 1 / (2 * beta)) ** 2)
        elif loss_type == "kto_pair":
            chosen, rejected = pc[i] - rc[i], pr[i] - rr[i]
            out.append(((1 - sigmoid(beta * (chosen - rkl))) + (1 - sigmoid(beta * (ckl - rejected)))) / 2)
        elif loss_type == "sppo_hard":
            out.append(((pc[i] - rc[i]) - 0.5 / beta) ** 2 + ((pr[i] - rr[i]) + 0.5 / beta) ** 2)
        elif loss_type == "nca_pair":
            a, b = beta * (pc[i] - rc[i]), beta * (pr[i] - rr[i])
            out.append(-log_sigmoid(a) - 0.5 * log_sigmoid(-a) - 0.5 * log_sigmoid(-b))
    return out


def plain_pair_logps(llm, pairs, average: bool):
    values = {"chosen": [], "rejected": []}
    for pair in pairs:
        for side in values:
            total, count = plain_logp(llm, *pair[side])
            values[side].append(total / count if average else total)
    return values["chosen"], values["rejected"]


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory, tiny_llama_dir):
    """The tiny Llama with moved weights: a policy that differs from the reference (the tiny Llama)."""
    llm = load_llm(tiny_llama_dir)
    perturb(llm, seed=7, scale=0.05)
    path = tmp_path_factory.mktemp("policy")
    llm.save_pretrained(path)
    return path


@pytest.mark.parametrize("loss_type", DPO_LOSS_TYPES)
def test_every_dpo_loss_type_equals_its_formula(loss_type, tiny_llama_dir, policy_dir):
    beta, ls = 0.5, (0.1 if loss_type in ("sigmoid", "robust", "simpo") else 0.0)
    ref = dict(type="transformers.AutoModelForCausalLM.from_pretrained",
               pretrained_model_name_or_path=str(tiny_llama_dir), dtype="float32", attn_implementation="sdpa")
    model = make_model("DPO", policy_dir, ref_llm=ref, beta=beta, loss_type=loss_type, label_smoothing=ls)
    pairs = make_pairs(6, seed=9)
    out = model(batch([row_of(pairs[:4]), row_of(pairs[4:])]), mode="loss")

    average = loss_type in ("ipo", "simpo")
    pc, pr = plain_pair_logps(load_llm(policy_dir), pairs, average)
    rc, rr = plain_pair_logps(load_llm(tiny_llama_dir), pairs, average)
    want = formula(loss_type, pc, pr, rc, rr, beta, ls)
    assert_close(out["loss"], sum(want) / len(want))
    if loss_type == "simpo":  # reference-free: the rewards are the scaled log-probs themselves
        rc, rr = [0.0] * 6, [0.0] * 6
    chosen = [beta * (pc[i] - rc[i]) for i in range(6)]
    rejected = [beta * (pr[i] - rr[i]) for i in range(6)]
    shown = step_means(out)
    assert_close(shown["loss"], sum(want) / len(want))
    assert_close(shown["rewards/chosen"], sum(chosen) / 6)
    assert_close(shown["rewards/margins"], (sum(chosen) - sum(rejected)) / 6)
    assert shown["rewards/accuracies"] == pytest.approx(sum(c > r for c, r in zip(chosen, rejected)) / 6)


def test_orpo_loss_equals_its_formula(policy_dir):
    beta = 0.25
    model = make_model("ORPO", policy_dir, beta=beta)
    pairs = make_pairs(5, seed=2)
    out = model(batch([row_of(pairs)]), mode="loss")
    pc, pr = plain_pair_logps(load_llm(policy_dir), pairs, average=True)
    want = []
    for c, r in zip(pc, pr):
        log_odds = (c - math.log(1 - math.exp(c))) - (r - math.log(1 - math.exp(r)))
        want.append(-c - beta * log_sigmoid(log_odds))
    assert_close(out["loss"], sum(want) / len(want))
    shown = step_means(out)
    assert_close(shown["nll"], -sum(pc) / len(pc))
    assert_close(shown["rewards/rejected"], beta * sum(pr) / len(pr))


# --- packing and micro-batches ------------------------------------------------------------------------


def per_pair_run(model, rows_list, total_pairs):
    """Loss and gradients of a step made of micro-batches (each a list of rows), as the train loop
    runs it: every micro-batch divided by the step's pair count."""
    model.zero_grad()
    total = 0.0
    for rows in rows_list:
        data = batch(rows)
        data["loss_normalizer"] = total_pairs
        loss = model(data, mode="loss")["loss"]
        loss.backward()
        total += loss.item()
    return total, grads_of(model)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_packed_equals_unpacked_and_any_micro_batch_split(tiny_llama_dir, lora):
    model = make_model("DPO", tiny_llama_dir, lora=lora_cfg() if lora else None)
    perturb(model.llm, seed=3)
    pairs = make_pairs(6, seed=4)
    unpacked = [[row_of([p]) for p in pairs]]                      # one pair per row, one micro-batch
    packed = [[row_of(pairs[:3]), row_of(pairs[3:])]]              # three pairs per row
    split = [[row_of(pairs[:1])], [row_of(pairs[1:4])], [row_of(pairs[4:])]]  # three micro-batches
    want_loss, want_grads = per_pair_run(model, unpacked, 6)
    assert want_loss > 0 and want_grads
    for layout in (packed, split):
        loss, grads = per_pair_run(model, layout, 6)
        assert_close(loss, want_loss)
        assert grads.keys() == want_grads.keys()
        for name in want_grads:
            assert torch.allclose(grads[name], want_grads[name], rtol=RTOL, atol=1e-7), name

    sums_unpacked, _ = model.sequence_logps(batch(unpacked[0]))
    sums_packed, _ = model.sequence_logps(batch(packed[0]))
    assert_close(sums_packed, sums_unpacked)


def test_changing_one_pair_leaves_the_others_in_its_row_unchanged(tiny_llama_dir):
    model = make_model("DPO", tiny_llama_dir)
    pairs = make_pairs(3, seed=6)
    changed = [dict(p) for p in pairs]
    ids, labels = changed[1]["chosen"]
    changed[1]["chosen"] = ([(t + 1) % 500 for t in ids] + [7, 8], labels + [7, 8])
    before, _ = model.sequence_logps(batch([row_of(pairs)]))
    after, _ = model.sequence_logps(batch([row_of(changed)]))
    assert torch.equal(after[[0, 1, 4, 5]], before[[0, 1, 4, 5]])
    assert not torch.allclose(after[2], before[2])


def test_count_loss_units_is_the_pair_count(tiny_llama_dir):
    model = make_model("DPO", tiny_llama_dir)
    pairs = make_pairs(5, seed=1)
    wrapped = preference_collate_fn([row_of(pairs[:2]), row_of(pairs[2:])])
    assert model.count_loss_units(wrapped) == 5
    assert model.count_loss_units(wrapped["data"]) == 5


# --- the reference model ----------------------------------------------------------------------------


def test_lora_reference_is_the_base_model_loaded_on_its_own(tiny_llama_dir):
    model = make_model("DPO", tiny_llama_dir, lora=lora_cfg())
    perturb(model.llm, seed=2, scale=0.1)  # the adapter now changes the outputs
    pairs = make_pairs(4, seed=8)
    data = batch([row_of(pairs)])
    ref, _ = model.reference_logps(data)
    policy, _ = model.sequence_logps(data)
    base = load_llm(tiny_llama_dir)
    want = [plain_logp(base, *pair[side])[0] for pair in pairs for side in ("chosen", "rejected")]
    assert_close(ref, want)
    assert not torch.allclose(policy, ref)
    assert not ref.requires_grad


def test_full_finetune_reference_is_frozen_and_left_out_of_checkpoints(tiny_llama_dir):
    model = make_model("DPO", tiny_llama_dir)
    assert model.ref_llm is not None and not any(p.requires_grad for p in model.ref_llm.parameters())
    model.train()
    assert model.llm.training and not model.ref_llm.training
    state = model.state_dict()
    assert set(state) == {f"llm.{k}" for k in model.llm.state_dict()}


def test_reference_free_losses_hold_no_reference(tiny_llama_dir):
    assert make_model("DPO", tiny_llama_dir, loss_type="simpo", beta=2.0).ref_llm is None
    assert not hasattr(make_model("ORPO", tiny_llama_dir), "ref_llm")


@pytest.mark.parametrize("kwargs,message", [
    (dict(loss_type="dpo"), "model.loss_type must be one of sigmoid"),
    (dict(beta=0), "model.beta must be a positive number"),
    (dict(label_smoothing=0.5), "model.label_smoothing must be in [0, 0.5)"),
])
def test_bad_arguments_name_the_key(tiny_llama_dir, kwargs, message):
    from sfttool.registry import ConfigBuildError
    with pytest.raises(ConfigBuildError, match=message.replace("[", r"\[").replace(")", r"\)")):
        make_model("DPO", tiny_llama_dir, **kwargs)


def test_lora_with_a_ref_llm_is_refused(tiny_llama_dir):
    from sfttool.registry import ConfigBuildError
    with pytest.raises(ConfigBuildError, match="model.ref_llm: with LoRA the reference is the base model"):
        make_model("DPO", tiny_llama_dir, lora=lora_cfg(), ref_llm=dict(type="x"))


def test_a_batch_without_pairs_names_the_collate_fn(tiny_llama_dir):
    from sfttool.dataset.collate_fns import default_collate_fn
    from sfttool.registry import ConfigBuildError
    model = make_model("ORPO", tiny_llama_dir)
    data = default_collate_fn([{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}])["data"]
    with pytest.raises(ConfigBuildError, match=r"set train_dataloader.collate_fn=dict\(type=preference_collate_fn\)"):
        model(data, mode="loss")
