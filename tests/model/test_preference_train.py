"""The preference configs against the real components: the shipped DPO demo trains through
`sfttool train` on the tiny Llama (loss from ln 2, rewards logged, adapter exported, resume), its
checkpoint converts and merges like an SFT one, `sfttool chat` runs with its adapter, and every
shipped DPO/ORPO/reward config builds on tiny assets and takes a step."""
from __future__ import annotations

import functools
import json
import math
import re

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from sfttool.cli.main import cli
from sfttool.config import list_configs, load_config
from sfttool.registry import build

DEMO = "demo_smollm2_135m_lora_dpo_helpful_e3"
REWARD_DEMO = "demo_smollm2_135m_lora_reward_helpful_e3"
PREFERENCE_CONFIGS = [n for n in list_configs() if any(f"_{kind}_" in n for kind in ("dpo", "orpo", "reward"))]


def run_cli(*args):
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result


@pytest.fixture(scope="module")
def demo_copy(tmp_path_factory, tiny_llama_dir):
    """`sfttool copy-cfg` of the demo, its PART 1 pointed at the tiny Llama, one short epoch."""
    folder = tmp_path_factory.mktemp("cfg")
    run_cli("copy-cfg", DEMO, folder)
    path = folder / f"{DEMO}_copy.py"
    text = path.read_text()
    for old, new in [("pretrained_model_name_or_path = dict(type=export_smollm2)",
                      f"pretrained_model_name_or_path = {str(tiny_llama_dir)!r}"),
                     ("max_epochs = 3", "max_epochs = 1"),
                     ("max_length = 128", "max_length = 256"),  # the tiny tokenizer's pieces are shorter
                     ("max_packed_length = 256", "max_packed_length = 1024")]:
        assert old in text, old
        text = text.replace(old, new)
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory, demo_copy):
    work = tmp_path_factory.mktemp("dpo_run")
    (work / "terminal.txt").write_text(run_cli("train", demo_copy, "--work-dir", work).output)
    return work


def logged_scalars(work) -> list[dict]:
    """The per-iteration scalars mmengine wrote to work_dir/<time>/vis_data/scalars.json."""
    (path,) = work.rglob("scalars.json")
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_the_demo_trains_and_logs_the_rewards(demo_run):
    scalars = logged_scalars(demo_run)
    assert scalars and all(k in scalars[0] for k in ("loss", "rewards/chosen", "rewards/rejected",
                                                     "rewards/margins", "rewards/accuracies"))
    assert (demo_run / "hf_adapter" / "adapter_config.json").is_file()
    log = next(demo_run.rglob("*.log")).read_text()
    assert re.search(r"Preference data: 52 rows in, 52 pairs in \d+ rows out", log)
    # The demo precomputes its reference log-probs: one pass, logged with its count and time.
    assert re.search(r"Reference log-probs: 52 pairs in \d+ rows in [\d.]+ s", log)
    # The terminal's progress shows the reward margin beside the loss, from the first optimizer step.
    progress = [line for line in (demo_run / "terminal.txt").read_text().splitlines() if line.startswith("iter ")]
    assert progress[0].startswith("iter 1/")
    assert progress and all(re.search(r"\| loss [\d.]+ \| margin -?[\d.]+ \| lr ", line) for line in progress)


def first_printed_loss(terminal: str) -> float:
    line = next(line for line in terminal.splitlines() if line.startswith("iter ") and " | loss " in line)
    return float(re.search(r" \| loss (-?[\d.]+) ", line).group(1))


@pytest.mark.slow
@pytest.mark.parametrize("accumulation", [1, 2])
def test_the_first_printed_dpo_loss_is_ln2(demo_run, demo_copy, tmp_path, accumulation):
    """At step 0 the policy is the reference (LoRA's B starts at 0): every pair's loss is ln 2, so the step's
    is too, however its pairs fall into micro-batches (a packed row holds several). With accumulation 2
    the first line used to show the first micro-batch's share of the step's loss instead."""
    if accumulation == 1:
        terminal = (demo_run / "terminal.txt").read_text()
    else:
        terminal = run_cli("train", demo_copy, "--work-dir", tmp_path / "acc2", "--max-steps", 1,
                           "--cfg-options", f"optim_wrapper.accumulative_counts={accumulation}").output
        assert "| step 1/" in terminal
    assert abs(first_printed_loss(terminal) - math.log(2)) < 1e-4


@pytest.mark.slow
def test_a_dpo_checkpoint_converts_and_merges_like_an_sft_one(demo_run, demo_copy, tiny_llama_dir, tmp_path):
    (ckpt,) = sorted(demo_run.glob("iter_*.pth"))
    out = tmp_path / "adapter"
    run_cli("convert", "pth_to_hf", demo_copy, ckpt, out)
    converted = load_file(out / "adapter_model.safetensors")
    exported = load_file(demo_run / "hf_adapter" / "adapter_model.safetensors")
    assert sorted(converted) == sorted(exported) and all(torch.equal(converted[k], exported[k]) for k in exported)
    assert max(v.abs().max().item() for k, v in converted.items() if "lora_B" in k) > 0  # trained
    merged = tmp_path / "merged"
    run_cli("convert", "merge", tiny_llama_dir, out, merged)
    assert (merged / "config.json").is_file()


@pytest.mark.slow
def test_chat_runs_with_the_dpo_adapter_and_the_training_template(demo_run, tiny_llama_dir):
    result = run_cli("chat", tiny_llama_dir, "--adapter", demo_run / "hf_adapter", "--prompt", "Who are you?",
                     "--max-new-tokens", 4, "--temperature", 0, "--no-streamer")
    assert f"Prompt template: {demo_run / 'hf_adapter' / 'sfttool_config.py'}" in result.output


@pytest.mark.slow
def test_resuming_a_finished_dpo_run_ends_at_once(demo_run, demo_copy):
    before = sorted(p.name for p in demo_run.glob("iter_*.pth"))
    run_cli("train", demo_copy, "--work-dir", demo_run, "--resume")
    assert sorted(p.name for p in demo_run.glob("iter_*.pth")) == before


@pytest.mark.slow
def test_the_reward_demo_trains_and_sfttool_score_scores_its_output(tmp_path, tiny_llama_dir):
    """The reward demo, copied and pointed at the tiny Llama (one epoch), trains through `sfttool train`;
    `sfttool score` on its adapter gives exactly the scores of the merged sequence classifier on the
    sequences training built (template and reward token from the config saved beside the adapter)."""
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from sfttool.dataset import build_preference_dataset
    from sfttool.dataset.collate_fns import preference_collate_fn
    from sfttool.model import RewardModel
    from sfttool.utils import PROMPT_TEMPLATE

    run_cli("copy-cfg", REWARD_DEMO, tmp_path)
    path = tmp_path / f"{REWARD_DEMO}_copy.py"
    text = path.read_text()
    # The tiny tokenizer's pieces are shorter; its pad token is id 0, which transformers' sequence
    # classifier skips when it picks the last token, so its sequences end with <|im_end|> (2) instead.
    for old, new in [("pretrained_model_name_or_path = dict(type=export_smollm2)",
                      f"pretrained_model_name_or_path = {str(tiny_llama_dir)!r}"),
                     ("max_epochs = 3", "max_epochs = 1"), ("max_length = 128", "max_length = 256"),
                     ("max_packed_length = 256", "max_packed_length = 1024"), ("reward_token_id = 0", "reward_token_id = 2")]:
        assert old in text, old
        text = text.replace(old, new)
    path.write_text(text)
    work = tmp_path / "work"
    run_cli("train", path, "--work-dir", work)
    scalars = logged_scalars(work)
    assert scalars and all(k in scalars[0] for k in ("loss", "accuracy", "scores/chosen", "scores/rejected"))
    assert json.loads((work / "hf_adapter" / "adapter_config.json").read_text())["task_type"] == "SEQ_CLS"

    prompt, chosen, rejected = "What is the capital of Norway?", "Oslo is the capital of Norway.", "Bergen."
    result = run_cli("score", tiny_llama_dir, "--adapter", work / "hf_adapter", "--prompt", prompt,
                     "--chosen", chosen, "--rejected", rejected)
    printed = dict(re.findall(r"(chosen|rejected|preferred): (\S+)", result.output))
    run_cli("convert", "merge", tiny_llama_dir, work / "hf_adapter", tmp_path / "merged")
    merged = AutoModelForSequenceClassification.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    row = {"prompt": [{"role": "user", "content": prompt}], "chosen": [{"role": "assistant", "content": chosen}],
           "rejected": [{"role": "assistant", "content": rejected}]}
    (pair,) = build_preference_dataset(Dataset.from_list([row]), AutoTokenizer.from_pretrained(tiny_llama_dir),
                                       max_length=256, is_reward=True, reward_token_id=2, pack_to_max_length=False,
                                       prompt_template=PROMPT_TEMPLATE.hf_chat_template)
    n_chosen, n_rejected = pair["sample_lengths"]  # the row holds the chosen sequence, then the rejected one
    sequences = [pair["input_ids"][:n_chosen], pair["input_ids"][n_chosen:n_chosen + n_rejected]]
    assert [seq[-1] for seq in sequences] == [2, 2]
    with torch.no_grad():  # as training scores: RewardModel at each sequence's last token; and plain transformers
        want = RewardModel(llm=merged, reward_token_id=2, use_activation_checkpointing=False).sequence_scores(
            preference_collate_fn([pair])["data"]).tolist()
        plain = [merged(input_ids=torch.tensor([seq])).logits[0, 0].item() for seq in sequences]
    assert plain == pytest.approx(want, abs=1e-4)
    assert float(printed["chosen"]) == pytest.approx(want[0], abs=1e-4)
    assert float(printed["rejected"]) == pytest.approx(want[1], abs=1e-4)
    assert want[0] != want[1] and printed["preferred"] == ("chosen" if want[0] > want[1] else "rejected")


# --- every shipped preference config builds on tiny assets ------------------------------------------------


def _materialise(value):
    from mmengine.config.lazy import LazyAttr, LazyObject
    return value.build() if isinstance(value, (LazyObject, LazyAttr)) else value


def test_the_preference_configs_are_listed():
    assert sorted(PREFERENCE_CONFIGS) == sorted([
        DEMO, REWARD_DEMO, "llama3_1_8b_instruct_lora_dpo_ultrafeedback_e1", "llama3_1_8b_instruct_qlora_dpo_ultrafeedback_e1",
        "qwen2_5_7b_instruct_lora_dpo_ultrafeedback_e1", "qwen2_5_7b_instruct_qlora_dpo_ultrafeedback_e1",
        "qwen2_5_7b_instruct_qlora_orpo_ultrafeedback_e1", "qwen2_5_7b_instruct_lora_reward_ultrafeedback_e1"])


@pytest.fixture(scope="module")
def ultrafeedback_jsonl(tmp_path_factory):
    """UltraFeedback-binarized's columns: a prompt string and whole chosen/rejected conversations."""
    from sfttool import assets
    rows = []
    for i in range(8):
        question = f"What is {i} plus {i}?"
        rows.append({"prompt": question, "score_chosen": 9.0, "score_rejected": 2.0,
                     "chosen": [{"role": "user", "content": question}, {"role": "assistant", "content": f"{2 * i}."}],
                     "rejected": [{"role": "user", "content": question}, {"role": "assistant", "content": "No."}]})
    return assets.write_jsonl(tmp_path_factory.mktemp("uf") / "train_prefs.jsonl", rows)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in PREFERENCE_CONFIGS if not n.startswith("demo_")])
def test_shipped_config_builds_and_takes_a_step_on_tiny_assets(name, tiny_qwen2_dir, ultrafeedback_jsonl):
    # Pointed at tiny assets the way a user would: PART 1 settings from the command line.
    options = [f"pretrained_model_name_or_path={tiny_qwen2_dir}", f"data_path={ultrafeedback_jsonl}",
               "data_split=train", "max_length=128", "max_packed_length=512", "model.llm.dtype=float32",
               "train_dataloader.dataset.num_proc=1"]
    if "_reward_" in name:  # the tiny vocabulary has no id 151643: end sequences with its EOS instead
        options.append("reward_token_id=2")
    cfg = load_config(name, options)
    assert cfg.train_dataloader.dataset.dataset.dataset.path == str(ultrafeedback_jsonl)
    dataset = build(cfg.train_dataloader.dataset, "train_dataloader.dataset")
    held_out = build(cfg.val_dataloader.dataset, "val_dataloader.dataset")
    # val_ratio = 0.01 holds out 1 of the 8 pairs (at least one); two sequences each
    assert sum(len(row["sample_lengths"]) for row in dataset) == 14
    assert sum(len(row["sample_lengths"]) for row in held_out) == 2
    collate_cfg = dict(cfg.train_dataloader.collate_fn)
    collate = functools.partial(_materialise(collate_cfg.pop("type")), **collate_cfg)
    model = build(cfg.model, "model")
    kind = next(k for k in ("dpo", "orpo", "reward") if f"_{k}_" in name)
    assert type(model).__name__ == {"dpo": "DPO", "orpo": "ORPO", "reward": "RewardModel"}[kind]
    out = model(**collate([dataset[0]]), mode="loss")
    out["loss"].backward()
    assert torch.isfinite(out["loss"]) and out["loss"].item() > 0
    trained = [p for p in model.parameters() if p.requires_grad]
    assert trained and all(p.grad is not None for p in trained)
    (pair,) = [p for row in model.validation_rows(collate([held_out[0]])["data"]) for p in row]
    assert math.isfinite(pair["loss"]) and ("rewards/margins" in pair or "scores/margins" in pair)
