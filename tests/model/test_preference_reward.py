"""RewardModel on the tiny Llama: scores = a plain sequence-classification forward per sequence,
Bradley-Terry loss + penalty = its formula, packed = unpacked, reward-token data, and the export
loads back as a transformers sequence-classification model with the same scores."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_preference import assert_close, batch, make_pairs, perturb, row_of  # noqa: E402

from sfttool.dataset import build_preference_dataset  # noqa: E402
from sfttool.model.step_metrics import step_means  # noqa: E402

REWARD_TOKEN = 7


def with_reward_token(pairs):
    """XTuner's reward data: every sequence ends with the reward token."""
    return [{side: (ids + [REWARD_TOKEN], labels + [REWARD_TOKEN]) for side, (ids, labels) in pair.items()}
            for pair in pairs]


def make_reward(model_dir, lora=False, **kwargs):
    from peft import LoraConfig
    from transformers import AutoModelForSequenceClassification

    from sfttool.model import RewardModel
    torch.manual_seed(0)
    llm = dict(type=AutoModelForSequenceClassification.from_pretrained, pretrained_model_name_or_path=str(model_dir),
               num_labels=1, dtype="float32", attn_implementation="sdpa")
    lora_cfg = dict(type=LoraConfig, r=4, lora_alpha=8, lora_dropout=0.0) if lora else None
    return RewardModel(llm=llm, lora=lora_cfg, use_activation_checkpointing=False, **kwargs)


def plain_score(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, 0].item()


@pytest.fixture
def reward_model(tiny_llama_dir):
    model = make_reward(tiny_llama_dir, reward_token_id=REWARD_TOKEN, penalty_type="log_barrier",
                        penalty_weight=0.1)
    perturb(model.llm, seed=4, scale=0.3)  # scores away from 0
    return model


def test_scores_equal_a_plain_sequence_classification_forward(reward_model, tmp_path):
    pairs = with_reward_token(make_pairs(5, seed=1))
    data = batch([row_of(pairs[:3]), row_of(pairs[3:])])
    scores = reward_model.sequence_scores(data)
    reward_model.llm.save_pretrained(tmp_path / "rm")  # the export: a plain transformers model
    from transformers import AutoModelForSequenceClassification
    plain = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm", dtype=torch.float32)
    want = [plain_score(plain, pair[side][0]) for pair in pairs for side in ("chosen", "rejected")]
    assert_close(scores, want)
    assert len(set(round(w, 6) for w in want)) == 10


def test_loss_is_bradley_terry_plus_the_penalty(reward_model):
    pairs = with_reward_token(make_pairs(4, seed=2))
    data = batch([row_of(pairs)])
    out = reward_model(data, mode="loss")
    s = reward_model.sequence_scores(data).tolist()

    def barrier(x):
        x = min(max(x, -5 + 1e-3), 5 - 1e-3)
        return -math.log(5 - x) - math.log(x + 5)

    want = [math.log1p(math.exp(-(s[2 * i] - s[2 * i + 1]))) + 0.1 * (barrier(s[2 * i]) + barrier(s[2 * i + 1])) / 2
            for i in range(4)]
    assert_close(out["loss"], sum(want) / 4)
    shown = step_means(out)
    assert shown["accuracy"] == pytest.approx(sum(s[2 * i] > s[2 * i + 1] for i in range(4)) / 4)
    assert_close(shown["scores/margins"], sum(s[2 * i] - s[2 * i + 1] for i in range(4)) / 4)


def test_packed_equals_unpacked(reward_model):
    pairs = with_reward_token(make_pairs(4, seed=3))
    packed = reward_model.sequence_scores(batch([row_of(pairs)]))
    unpacked = reward_model.sequence_scores(batch([row_of([p]) for p in pairs]))
    assert_close(packed, unpacked)


def test_data_without_the_reward_token_is_refused(reward_model):
    from sfttool.registry import ConfigBuildError
    with pytest.raises(ConfigBuildError, match="model.reward_token_id=7 but the sequences do not end with it"):
        reward_model.sequence_scores(batch([row_of(make_pairs(2, seed=5))]))


def test_reward_data_ends_every_sequence_with_the_token(tiny_tokenizer):
    rows = [{"prompt": [{"role": "user", "content": "the cat " * 30}],
             "chosen": [{"role": "assistant", "content": "a mat " * 20}],
             "rejected": [{"role": "assistant", "content": "no"}]}]
    ds = build_preference_dataset(Dataset.from_list(rows), tiny_tokenizer, max_length=80, is_reward=True,
                                  reward_token_id=REWARD_TOKEN, pack_to_max_length=False)
    row = ds[0]
    ends = [sum(row["sample_lengths"][:k + 1]) - 1 for k in range(2)]
    assert [row["input_ids"][e] for e in ends] == [REWARD_TOKEN, REWARD_TOKEN]
    assert row["sample_lengths"][0] == 80  # the chosen answer was cut to make room for the token


def test_lora_reward_adapter_saves_the_head_and_loads_with_peft(tiny_llama_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification
    model = make_reward(tiny_llama_dir, lora=True, reward_token_id=None)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("score" in n for n in trainable) and any("lora_A" in n for n in trainable)
    perturb(model.llm, seed=6, scale=0.2)
    pairs = make_pairs(2, seed=7)
    scores = model.sequence_scores(batch([row_of(pairs)]))
    model.llm.save_pretrained(tmp_path / "adapter")
    base = AutoModelForSequenceClassification.from_pretrained(tiny_llama_dir, num_labels=1, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, tmp_path / "adapter").merge_and_unload()
    want = [plain_score(loaded, pair[side][0]) for pair in pairs for side in ("chosen", "rejected")]
    assert_close(scores, want)


def test_a_causal_lm_is_refused(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    from sfttool.model import RewardModel
    from sfttool.registry import ConfigBuildError
    llm = dict(type=AutoModelForCausalLM.from_pretrained, pretrained_model_name_or_path=str(tiny_llama_dir))
    with pytest.raises(ConfigBuildError, match="needs a sequence-classification model with a `score` head"):
        RewardModel(llm=llm, use_activation_checkpointing=False)


def test_sfttool_merge_of_a_reward_adapter_gives_a_sequence_classifier(tiny_llama_dir, tmp_path):
    from click.testing import CliRunner
    from transformers import AutoModelForSequenceClassification

    from sfttool.cli.main import cli
    model = make_reward(tiny_llama_dir, lora=True)
    perturb(model.llm, seed=8, scale=0.2)
    pairs = make_pairs(2, seed=9)
    scores = model.sequence_scores(batch([row_of(pairs)]))
    model.llm.save_pretrained(tmp_path / "adapter")
    result = CliRunner().invoke(cli, ["convert", "merge", str(tiny_llama_dir), str(tmp_path / "adapter"),
                                      str(tmp_path / "merged")])
    assert result.exit_code == 0, result.output
    merged = AutoModelForSequenceClassification.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    assert type(merged).__name__ == "LlamaForSequenceClassification"
    assert_close(scores, [plain_score(merged, pair[side][0]) for pair in pairs for side in ("chosen", "rejected")])


@pytest.mark.parametrize("token", ["other", "pad"])
def test_sfttool_score_scores_a_pair_as_training_encoded_it(tiny_llama_dir, tiny_tokenizer, tmp_path, token):
    """Also where the reward token is the tokenizer's pad token (a sequence classifier alone would read
    the score one token early, at the last token that is not the pad token)."""
    from click.testing import CliRunner

    from sfttool.cli.main import cli
    from sfttool.dataset.collate_fns import preference_collate_fn
    reward_token = 2 if token == "other" else tiny_tokenizer.pad_token_id
    assert reward_token is not None and (token == "other") == (reward_token != tiny_tokenizer.pad_token_id)
    model = make_reward(tiny_llama_dir, lora=True, reward_token_id=reward_token)
    perturb(model.llm, seed=10, scale=0.2)
    adapter = tmp_path / "adapter"
    model.llm.save_pretrained(adapter)
    tiny_tokenizer.save_pretrained(adapter)
    # What the run saves beside its adapter: the training config (template and reward token).
    (adapter / "sfttool_config.py").write_text(
        f"prompt_template = dict(HF_CHAT_TEMPLATE=True, STOP_WORDS=[])\nmodel = dict(reward_token_id={reward_token})\n")
    row = {"prompt": [{"role": "user", "content": "Is the sky blue?"}],
           "chosen": [{"role": "assistant", "content": "Yes, on a clear day."}],
           "rejected": [{"role": "assistant", "content": "No."}]}
    ds = build_preference_dataset(Dataset.from_list([row]), tiny_tokenizer, max_length=64, is_reward=True,
                                  reward_token_id=reward_token, pack_to_max_length=False)
    want = model.sequence_scores(preference_collate_fn([ds[0]])["data"]).tolist()

    result = CliRunner().invoke(cli, ["score", str(tiny_llama_dir), "--adapter", str(adapter),
                                      "--prompt", "Is the sky blue?", "--chosen", "Yes, on a clear day.",
                                      "--rejected", "No."])
    assert result.exit_code == 0, result.output
    import re
    lines = dict(re.findall(r"(chosen|rejected|preferred): (\S+)", result.output))
    assert float(lines["chosen"]) == pytest.approx(want[0], abs=1e-4)
    assert float(lines["rejected"]) == pytest.approx(want[1], abs=1e-4)
    assert lines["preferred"] == ("chosen" if want[0] > want[1] else "rejected")


def test_sfttool_score_refuses_a_causal_lm(tiny_llama_dir):
    from click.testing import CliRunner

    from sfttool.cli.main import cli
    result = CliRunner().invoke(cli, ["score", str(tiny_llama_dir), "--prompt", "q", "--chosen", "a",
                                      "--rejected", "b"])
    assert result.exit_code == 1
    assert "is not a reward model" in result.output
