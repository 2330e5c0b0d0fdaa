"""Helpers for the model tests: build a SupervisedFinetune on the tiny
fixtures, make samples, pack them and pad them as the data pipeline does."""
from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

# Test modules may import each other's reference implementations (test_grpo imports test_grpo_loss's).
HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))


def make_samples(n: int, seed: int = 0, vocab: int = 500, lengths=(5, 17)) -> list[dict]:
    """``n`` samples: random ids, the first third of each untrained (a prompt)."""
    rng = random.Random(seed)
    samples = []
    for _ in range(n):
        length = rng.randint(*lengths)
        ids = [rng.randrange(3, vocab) for _ in range(length)]
        prompt = max(1, length // 3)
        samples.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return samples


def pack(samples: list[dict]) -> dict:
    """Samples -> one packed row (the dataset row format)."""
    row = {"input_ids": [], "labels": [], "position_ids": [], "sample_lengths": []}
    for s in samples:
        row["input_ids"] += s["input_ids"]
        row["labels"] += s["labels"]
        row["position_ids"] += list(range(len(s["input_ids"])))
        row["sample_lengths"].append(len(s["input_ids"]))
    return row


def as_row(sample: dict) -> dict:
    return pack([sample])


def collate(rows: list[dict], pad_index: int = 0) -> dict:
    """Right padding as default_collate_fn pads: padding is its own pseudo-sample with
    positions 0..p-1 and labels -100; no attention mask."""
    width = max(len(r["input_ids"]) for r in rows)
    out = {"input_ids": [], "labels": [], "position_ids": []}
    for r in rows:
        pad = width - len(r["input_ids"])
        out["input_ids"].append(r["input_ids"] + [pad_index] * pad)
        out["labels"].append(r["labels"] + [-100] * pad)
        out["position_ids"].append(r["position_ids"] + list(range(pad)))
    return {k: torch.tensor(v, dtype=torch.long) for k, v in out.items()}


@pytest.fixture
def make_sft():
    """``make_sft(model_dir, attn='sdpa', **kwargs)`` -> a float32 SupervisedFinetune."""
    from transformers import AutoModelForCausalLM

    from sfttool.model import SupervisedFinetune

    def _make(model_dir, attn="sdpa", seed=0, **kwargs):
        torch.manual_seed(seed)  # LoRA init is random
        llm = dict(type=AutoModelForCausalLM.from_pretrained, pretrained_model_name_or_path=str(model_dir),
                   dtype="float32", attn_implementation=attn)
        kwargs.setdefault("use_activation_checkpointing", False)
        return SupervisedFinetune(llm=llm, **kwargs)

    return _make


@pytest.fixture
def rows():
    """The sample/pack/collate helpers above, for tests to call."""
    from types import SimpleNamespace

    return SimpleNamespace(make_samples=make_samples, pack=pack, as_row=as_row, collate=collate)


@pytest.fixture(scope="session")
def tiny_tied_qwen2_dir(tmp_path_factory, tiny_qwen2_dir):
    """The tiny Qwen2 with ``tie_word_embeddings=True``: one matrix is both the
    input embeddings and the LM head."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(tiny_qwen2_dir)
    config.tie_word_embeddings = True
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    folder = tmp_path_factory.mktemp("tiny_tied_qwen2")
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_qwen2_dir).save_pretrained(folder)
    return folder


@pytest.fixture
def make_grpo(tiny_qwen2_dir):
    """``make_grpo(lora=True, **kwargs)`` -> a float32 GRPO on the tiny Qwen2 (rewards: 'format' unless given)."""
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sfttool.model import GRPO

    def _make(lora=True, seed=0, **kwargs):
        torch.manual_seed(seed)  # LoRA init is random
        llm = dict(type=AutoModelForCausalLM.from_pretrained, pretrained_model_name_or_path=str(tiny_qwen2_dir),
                   dtype="float32", attn_implementation="sdpa")
        kwargs.setdefault("reward_funcs", ["format"])
        kwargs.setdefault("use_activation_checkpointing", False)
        adapter = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM") if lora else None
        return GRPO(llm=llm, tokenizer=AutoTokenizer.from_pretrained(tiny_qwen2_dir), lora=adapter, **kwargs)

    return _make
