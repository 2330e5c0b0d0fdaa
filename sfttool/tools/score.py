"""``sfttool score``: a trained reward model's scores for a chosen and a rejected answer.

Both answers are rendered and encoded exactly as the reward model's training
data was (``sfttool.dataset.preference_encode``: the template from the
training config saved beside the model or adapter, else the tokenizer's chat
template), end with the reward token, and are scored at their last token.

    >>> score_pair('work_dirs/rm/hf_adapter_merged', 'What is 2+2?', '4.', '5.')   # doctest: +SKIP
    (2.91, -1.37)
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from sfttool.config import load_config
from sfttool.dataset.preference_encode import encode_conversations, pair_conversations
from sfttool.errors import SfttoolError
from sfttool.model.hf_folder import SAVED_CONFIG_NAME
from sfttool.tools.chat import resolve_template
from sfttool.tools.merge import adapter_tokenizer, load_merged


class ScoreError(SfttoolError):
    """The model or the inputs of ``sfttool score`` cannot be used."""


def saved_reward_token(folders) -> int | None:
    """``model.reward_token_id`` of the training config saved beside the model or adapter, if any."""
    for folder in folders:
        path = Path(folder) / SAVED_CONFIG_NAME
        if path.is_file():
            token = load_config(path).get("model", {}).get("reward_token_id")
            if token is not None:
                return int(token)
    return None


def load_reward_model(model_path: str | os.PathLike, adapter: str | os.PathLike | None) -> tuple[Any, Any]:
    """The sequence-classification model (the adapter merged in) and its tokenizer."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    if adapter is not None:
        tokenizer = adapter_tokenizer(adapter)
        model = load_merged(model_path, adapter, tokenizer=tokenizer)
        return model, tokenizer or AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForSequenceClassification.from_pretrained(model_path)
    return model, AutoTokenizer.from_pretrained(model_path)


def score_pair(model_path, prompt: str, chosen: str, rejected: str, adapter=None, system: str | None = None,
               prompt_template: str | None = None, hf_template: bool = False,
               reward_token_id: int | None = None) -> tuple[float, float]:
    """``(score of chosen, score of rejected)`` for one user prompt."""
    import torch

    folders = [f for f in (adapter, model_path) if f is not None and Path(f).is_dir()]
    model, tokenizer = load_reward_model(model_path, adapter)
    if getattr(model.config, "num_labels", None) != 1:
        raise ScoreError(f"{adapter or model_path} is not a reward model (a sequence classifier with one "
                         "label); train one with RewardModel (docs/preference.md)")
    template, _ = resolve_template(tokenizer, prompt_template, hf_template, folders)
    token = reward_token_id if reward_token_id is not None else saved_reward_token(folders)
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    sides = pair_conversations(messages, [{"role": "assistant", "content": chosen}],
                               [{"role": "assistant", "content": rejected}])
    scores = []
    for ids, _ in encode_conversations(list(sides), [None, None], tokenizer, template):
        ids = ids + ([token] if token is not None else [])
        with torch.no_grad():
            scores.append(model(input_ids=torch.tensor([ids])).logits[0, 0].item())  # the last token's score
    return scores[0], scores[1]
