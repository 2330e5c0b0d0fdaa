"""KTO on unpaired rows: each example is encoded as one side of a preference pair, its KL sequence is its
prompt with the next example's completion in the micro-batch, the loss equals the paper's formula written
here on a plain forward, step 0 costs half the weights, bad rows are one line, and a KTO config trains
through `sfttool train`."""
from __future__ import annotations

import json
import logging
import math
import random
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_preference import load_llm, lora_cfg, make_model, perturb, plain_logp  # noqa: E402

from sfttool.dataset import DatasetError, build_kto_dataset, build_preference_dataset  # noqa: E402
from sfttool.dataset.collate_fns import kto_collate_fn  # noqa: E402
from sfttool.model.step_metrics import step_means  # noqa: E402

BETA = 0.5


def unpaired_rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    words = "the cat sat on a mat and then it ran far away from home".split()
    rows = []
    for i in range(n):
        prompt = [{"role": "user", "content": " ".join(rng.choice(words) for _ in range(rng.randint(2, 6))) + "?"}]
        answer = " ".join(rng.choice(words) for _ in range(rng.randint(1, 7))) + f" {i}."
        rows.append({"prompt": prompt, "completion": [{"role": "assistant", "content": answer}], "label": i % 3 != 0})
    return rows


def kto_examples(tokenizer, rows, **kwargs):
    return build_kto_dataset(Dataset.from_list(rows), tokenizer, max_length=kwargs.pop("max_length", 128), **kwargs)


# --- data ---------------------------------------------------------------------------------------------


def test_an_example_is_encoded_as_one_side_of_a_pair(tiny_tokenizer):
    rows = unpaired_rows(6, seed=1)
    examples = kto_examples(tiny_tokenizer, rows)
    pairs = [{"prompt": r["prompt"], "chosen": r["completion"],
              "rejected": [{"role": "assistant", "content": "something else entirely"}]} for r in rows]
    packed = build_preference_dataset(Dataset.from_list(pairs), tiny_tokenizer, max_length=128,
                                      pack_to_max_length=False, shuffle_before_pack=False)
    assert len(examples) == len(packed) == 6
    for example, pair, row in zip(examples, packed, rows):
        chosen = pair["sample_lengths"][0]
        assert example["input_ids"] == pair["input_ids"][:chosen] and example["labels"] == pair["labels"][:chosen]
        assert example["kto_label"] == int(row["label"])
        p = example["prompt_length"]
        assert set(example["labels"][:p]) == {-100} and example["labels"][p] != -100


def test_strings_are_one_user_and_one_assistant_message(tiny_tokenizer):
    rows = unpaired_rows(2, seed=3)
    as_strings = [dict(r, prompt=r["prompt"][0]["content"], completion=r["completion"][0]["content"]) for r in rows]
    assert kto_examples(tiny_tokenizer, as_strings)[:] == kto_examples(tiny_tokenizer, rows)[:]


def test_bad_rows_name_the_row_and_the_field(tiny_tokenizer):
    rows = [dict(r, label="yes" if r["label"] else "no") for r in unpaired_rows(3)]
    with pytest.raises(DatasetError, match=r"row 0, field 'label': expected true \(desirable\) or false"):
        kto_examples(tiny_tokenizer, rows)
    with pytest.raises(DatasetError, match="KTO rows need prompt, completion, label; missing label"):
        kto_examples(tiny_tokenizer, [{k: v for k, v in r.items() if k != "label"} for r in unpaired_rows(2)])


def test_long_completions_are_cut_and_long_prompts_dropped_counted(tiny_tokenizer):
    from mmengine.logging import MMLogger

    rows = unpaired_rows(3, seed=4)
    rows[0]["completion"] = [{"role": "assistant", "content": "word " * 200}]
    rows[1]["prompt"] = [{"role": "user", "content": "word " * 200}]
    kept, keeper = [], logging.Handler()
    keeper.emit = lambda record: kept.append(record.getMessage())
    MMLogger.get_current_instance().addHandler(keeper)
    try:
        examples = kto_examples(tiny_tokenizer, rows, max_length=48)
    finally:
        MMLogger.get_current_instance().removeHandler(keeper)
    assert len(examples) == 2 and max(examples["length"]) == 48
    assert kept == ["KTO data: 3 rows in, 2 examples out (1 desirable, 1 undesirable)",
                    "KTO data: dropped 1 rows: prompt alone fills max_length (no room for the completion)",
                    "KTO data: 1 examples over max_length=48: completion cut at max_length"]


def test_the_kl_sequence_is_the_prompt_with_the_next_examples_completion(tiny_tokenizer):
    examples = [dict(e) for e in kto_examples(tiny_tokenizer, unpaired_rows(3, seed=5))]
    data = kto_collate_fn(examples)["data"]
    assert data["kto_labels"].tolist() == [False, True, True]
    for i, example in enumerate(examples):
        other = examples[(i + 1) % 3]
        p, q = example["prompt_length"], other["prompt_length"]
        want = example["input_ids"][:p] + other["input_ids"][q:]
        row = data["input_ids"][i][data["sequence_ids"][i] == 2 * i + 1].tolist()
        assert row == want
        labels = data["labels"][i][data["sequence_ids"][i] == 2 * i + 1].tolist()
        assert labels == [-100] * p + other["labels"][q:]
        assert data["input_ids"][i][data["sequence_ids"][i] == 2 * i].tolist() == example["input_ids"]
    with pytest.raises(ValueError, match="set train_dataloader.batch_size to 2 or more"):
        kto_collate_fn(examples[:1])


# --- the loss -----------------------------------------------------------------------------------------


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory, tiny_llama_dir):
    llm = load_llm(tiny_llama_dir)
    perturb(llm, seed=11, scale=0.05)
    path = tmp_path_factory.mktemp("kto_policy")
    llm.save_pretrained(path)
    return path


def test_the_loss_is_the_papers_formula(tiny_llama_dir, policy_dir):
    """KTO (Ethayarajh et al., 2024), per example x with completion y and label:
    r = log π(y|x) - log π_ref(y|x);  z = max(0, mean over the batch of log π(y'|x) - log π_ref(y'|x)) for
    mismatched completions y';  loss = λ_D (1 - σ(β(r - z))) if desirable, λ_U (1 - σ(β(z - r))) if not;
    the batch's loss is the mean over its examples."""
    from transformers import AutoTokenizer

    weights = dict(desirable_weight=1.5, undesirable_weight=0.7)
    ref = dict(type="transformers.AutoModelForCausalLM.from_pretrained",
               pretrained_model_name_or_path=str(tiny_llama_dir), dtype="float32", attn_implementation="sdpa")
    model = make_model("KTO", policy_dir, ref_llm=ref, beta=BETA, **weights)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    examples = [dict(e) for e in kto_examples(tokenizer, unpaired_rows(5, seed=6))]
    out = model(kto_collate_fn(examples)["data"], mode="loss")

    policy, reference = load_llm(policy_dir), load_llm(tiny_llama_dir)
    r, kl_terms = [], []
    for i, example in enumerate(examples):
        other = examples[(i + 1) % 5]
        p, q = example["prompt_length"], other["prompt_length"]
        kl_ids = example["input_ids"][:p] + other["input_ids"][q:]
        kl_labels = [-100] * p + other["labels"][q:]
        r.append(plain_logp(policy, example["input_ids"], example["labels"])[0]
                 - plain_logp(reference, example["input_ids"], example["labels"])[0])
        kl_terms.append(plain_logp(policy, kl_ids, kl_labels)[0] - plain_logp(reference, kl_ids, kl_labels)[0])
    z = max(0.0, sum(kl_terms) / 5)
    labels = [bool(e["kto_label"]) for e in examples]
    losses = [weights["desirable_weight"] * (1 - sigmoid(BETA * (r[i] - z))) if labels[i]
              else weights["undesirable_weight"] * (1 - sigmoid(BETA * (z - r[i]))) for i in range(5)]
    assert out["loss"].item() == pytest.approx(sum(losses) / 5, rel=1e-5)
    shown = step_means(out)
    assert shown["loss"] == pytest.approx(sum(losses) / 5, rel=1e-5)
    assert shown["kl"] == pytest.approx(z, abs=1e-5)
    desirable = [BETA * r[i] for i in range(5) if labels[i]]
    undesirable = [BETA * r[i] for i in range(5) if not labels[i]]
    # float32 log-prob sums, whose rounding depends on the CPU's kernels (AVX-512 or not): 1e-5, as for kl
    assert shown["rewards/chosen"] == pytest.approx(sum(desirable) / len(desirable), abs=1e-5)
    assert shown["rewards/rejected"] == pytest.approx(sum(undesirable) / len(undesirable), abs=1e-5)


def test_step_0_costs_half_the_weights_and_the_kl_baseline_is_0(tiny_llama_dir):
    from transformers import AutoTokenizer

    model = make_model("KTO", tiny_llama_dir, lora=lora_cfg(), beta=BETA, desirable_weight=2.0)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    examples = [dict(e) for e in kto_examples(tokenizer, unpaired_rows(6, seed=8))]  # 4 desirable, 2 not
    out = model(kto_collate_fn(examples)["data"], mode="loss")
    assert out["loss"].item() == pytest.approx((4 * 2.0 * 0.5 + 2 * 1.0 * 0.5) / 6, abs=1e-6)
    assert step_means(out)["kl"] == 0.0


@pytest.mark.parametrize("kwargs,message", [
    (dict(desirable_weight=0), "model.desirable_weight must be a positive number"),
    (dict(precompute_ref_log_probs=True), "model.precompute_ref_log_probs: KTO's KL sequences are made per micro"),
])
def test_bad_arguments_name_the_key(tiny_llama_dir, kwargs, message):
    from sfttool.registry import ConfigBuildError
    with pytest.raises(ConfigBuildError, match=message):
        make_model("KTO", tiny_llama_dir, **kwargs)


# --- through `sfttool train` ----------------------------------------------------------------------------

KTO_CONFIG = '''
from datasets import load_dataset
from mmengine.dataset import DefaultSampler
from mmengine.hooks import CheckpointHook, IterTimerHook, LoggerHook, ParamSchedulerHook
from mmengine.optim import AmpOptimWrapper, ConstantLR
from peft import LoraConfig
from torch.optim import AdamW
from transformers import AutoModelForCausalLM, AutoTokenizer

from sfttool.dataset import build_kto_dataset
from sfttool.dataset.collate_fns import kto_collate_fn
from sfttool.engine.runner import TrainLoop
from sfttool.model import KTO

model_dir = {model_dir!r}
tokenizer = dict(type=AutoTokenizer.from_pretrained, pretrained_model_name_or_path=model_dir)
model = dict(type=KTO, beta=0.1, desirable_weight=1.0, undesirable_weight=1.0, use_activation_checkpointing=False,
             llm=dict(type=AutoModelForCausalLM.from_pretrained, pretrained_model_name_or_path=model_dir,
                      dtype='float32'),
             lora=dict(type=LoraConfig, r=8, lora_alpha=16, lora_dropout=0.0, task_type='CAUSAL_LM'))
train_dataloader = dict(
    batch_size=4, num_workers=0,
    dataset=dict(type=build_kto_dataset, dataset=dict(type=load_dataset, path='json', data_files={data!r}),
                 tokenizer=tokenizer, max_length=128, num_proc=1),
    sampler=dict(type=DefaultSampler, shuffle=True, seed=3),
    collate_fn=dict(type=kto_collate_fn, max_length=128))
optim_wrapper = dict(type=AmpOptimWrapper, dtype='bfloat16', loss_scale='dynamic',
                     optimizer=dict(type=AdamW, lr=1e-3, weight_decay=0), accumulative_counts=1)
param_scheduler = [dict(type=ConstantLR, factor=1.0, by_epoch=False, begin=0)]
train_cfg = dict(type=TrainLoop, max_epochs=1)
default_hooks = dict(timer=dict(type=IterTimerHook), logger=dict(type=LoggerHook, interval=1),
                     param_scheduler=dict(type=ParamSchedulerHook),
                     checkpoint=dict(type=CheckpointHook, interval=100, by_epoch=False))
env_cfg = dict(dist_cfg=dict(backend='gloo'))
randomness = dict(seed=3)
'''


@pytest.mark.slow
def test_a_kto_config_trains_through_sfttool_train(tmp_path, tiny_llama_dir):
    from sfttool.engine.train import train

    data = tmp_path / "unpaired.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in unpaired_rows(12, seed=9)))
    config = tmp_path / "kto.py"
    config.write_text(KTO_CONFIG.format(model_dir=str(tiny_llama_dir), data=str(data)))
    work = train(str(config), work_dir=str(tmp_path / "work"))
    (scalars,) = work.rglob("scalars.json")
    steps = [json.loads(line) for line in scalars.read_text().splitlines()]
    assert len(steps) == 3 and all({"loss", "kl", "rewards/chosen", "rewards/rejected"} <= set(s) for s in steps)
    assert steps[0]["loss"] == pytest.approx(0.5, abs=1e-6)  # the policy starts as the reference
    assert steps[-1]["loss"] < 0.5
    log = next(work.rglob("*.log")).read_text()
    assert "KTO data: 12 rows in, 12 examples out (8 desirable, 4 undesirable)" in log
    assert (work / "hf_adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.slow
def test_two_ranks_sharing_each_row_train_like_one_rank(tmp_path, tiny_qwen2_dir):
    """sequence_parallel_size = 2 on 2 processes: each rank runs its slice of every example and KL sequence;
    the summed log-probs are added over the group before the loss, so the run equals one process."""
    from safetensors.torch import load_file

    from sfttool.engine.train import train

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
    from engine_helpers import logged
    from test_distributed import run_sfttool

    data = tmp_path / "unpaired.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in unpaired_rows(12, seed=9)))
    whole = tmp_path / "one.py"
    whole.write_text(KTO_CONFIG.format(model_dir=str(tiny_qwen2_dir), data=str(data)))
    split = tmp_path / "sp.py"
    split.write_text(whole.read_text().replace("sampler=dict(type=DefaultSampler,", "sampler=dict(type="
                                               "'sfttool.parallel.sequence.SequenceParallelSampler',")
                     + "sequence_parallel_size = 2\n")
    result = run_sfttool([str(split), "--work-dir", str(tmp_path / "sp"), "--nproc-per-node", "2"], timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    one = train(str(whole), work_dir=str(tmp_path / "one"))
    assert len(logged(tmp_path / "sp")) == len(logged(one)) == 3
    torch.testing.assert_close(logged(tmp_path / "sp"), logged(one), rtol=1e-5, atol=0)
    torch.testing.assert_close(logged(tmp_path / "sp", "kl"), logged(one, "kl"), rtol=1e-5, atol=1e-7)
    a = load_file(tmp_path / "sp" / "hf_adapter" / "adapter_model.safetensors")
    b = load_file(one / "hf_adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and len(a) > 0
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_the_shipped_kto_config_trains_on_tiny_assets(tmp_path, tiny_qwen2_dir):
    """`qwen2_5_7b_instruct_lora_kto_mix14k_e1` pointed at a tiny model and a local file the way a user would
    (PART 1 settings from the command line): its rows load, encode and train two optimizer steps."""
    from sfttool.engine.train import train

    data = tmp_path / "unpaired.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in unpaired_rows(12, seed=9)))
    options = [f"pretrained_model_name_or_path={tiny_qwen2_dir}", f"data_path={data}", "data_split=train",
               "max_length=128", "model.llm.dtype=float32", "batch_size=2", "accumulative_counts=2",
               "evaluation_max_new_tokens=2", "report_to=[]", "log_interval=1"]
    work = train("qwen2_5_7b_instruct_lora_kto_mix14k_e1", work_dir=str(tmp_path / "work"), cfg_options=options,
                 max_steps=2)
    (scalars,) = work.rglob("scalars.json")
    steps = [json.loads(line) for line in scalars.read_text().splitlines()]
    assert len(steps) == 2 and all({"loss", "kl", "rewards/chosen", "rewards/rejected"} <= set(s) for s in steps)
    assert steps[0]["loss"] == pytest.approx(0.5, abs=1e-6)  # the policy starts as the reference
    log = next(work.rglob("*.log")).read_text()
    assert "KTO data: 12 rows in, 12 examples out (8 desirable, 4 undesirable)" in log
    assert (work / "hf_adapter" / "adapter_model.safetensors").is_file()


def test_check_custom_dataset_shows_an_example_and_the_counts_of_a_kto_config(tmp_path, tiny_qwen2_dir):
    from transformers import AutoTokenizer

    from sfttool.tools.check_dataset import check_dataset

    data = tmp_path / "unpaired.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in unpaired_rows(10)))
    lines: list[str] = []
    options = [f"pretrained_model_name_or_path={tiny_qwen2_dir}", f"data_path={data}", "max_length=24"]
    assert check_dataset("qwen2_5_7b_instruct_lora_kto_mix14k_e1", options, echo=lines.append) == 0
    out = "\n".join(lines)
    encoded = kto_examples(AutoTokenizer.from_pretrained(tiny_qwen2_dir), unpaired_rows(10), max_length=24)
    desirable = sum(encoded["kto_label"])
    assert f"rows in: 10   examples: 10 ({desirable} desirable, {10 - desirable} undesirable)" in out
    assert "== example 0 (undesirable: " in out and "[MASKED:<|im_start|>user" in out  # row 0's label is false
    cut = sum(length == 24 for length in encoded["length"])
    assert cut > 0 and f"over max_length=24: {cut} examples (completion cut at max_length)" in out
    assert "iterations per epoch (batch_size=4, one process): 3" in out and out.endswith("OK: 0 errors, 0 warnings")


def test_check_custom_dataset_lists_every_bad_kto_row(tmp_path, tiny_qwen2_dir):
    from sfttool.tools.check_dataset import check_dataset

    rows = unpaired_rows(6)
    rows[2]["label"] = "yes"
    del rows[4]["completion"]
    data = tmp_path / "unpaired.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines: list[str] = []
    options = [f"pretrained_model_name_or_path={tiny_qwen2_dir}", f"data_path={data}"]
    assert check_dataset("qwen2_5_7b_instruct_lora_kto_mix14k_e1", options, echo=lines.append) == 1
    out = "\n".join(lines)
    assert f"{data}, row 2, field 'label': expected true (desirable) or false (undesirable), got 'yes'" in out
    assert (f"{data}, row 4, field 'completion': expected a string or one assistant message "
            "{'role': 'assistant', 'content': ...}, got None") in out
    assert "== statistics ==" not in out  # nothing is encoded from a set with bad rows
