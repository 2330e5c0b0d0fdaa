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


def load_scorer(model_path, adapter=None, prompt_template: str | None = None, hf_template: bool = False,
                reward_token_id: int | None = None) -> tuple[Any, Any, Any, int | None]:
    """``(model, tokenizer, template, reward token)`` of a reward model, checked to be one."""
    folders = [f for f in (adapter, model_path) if f is not None and Path(f).is_dir()]
    model, tokenizer = load_reward_model(model_path, adapter)
    if getattr(model.config, "num_labels", None) != 1:
        raise ScoreError(f"{adapter or model_path} is not a reward model (a sequence classifier with one "
                         "label); train one with RewardModel (docs/preference.md)")
    template, _ = resolve_template(tokenizer, prompt_template, hf_template, folders)
    token = reward_token_id if reward_token_id is not None else saved_reward_token(folders)
    # A sequence classifier reads its score at the last token that is not ``pad_token_id``; a reward token
    # that is the pad token (a tokenizer whose pad is its EOS) would be read one token early. Scored one
    # unpadded sequence at a time, the score is the last token's, as RewardModel trained it.
    model.config.pad_token_id = None
    return model.eval(), tokenizer, template, token


def score_answers(model, tokenizer, template, token: int | None, messages: list[dict],
                  answers: list[str]) -> list[float]:
    """The score of each answer to the conversation ``messages`` (ending with a user message), each encoded
    exactly as the reward model's training data was and ended with its reward token."""
    import torch

    sides = [side for answer in answers for side in pair_conversations(
        messages, [{"role": "assistant", "content": answer}], [{"role": "assistant", "content": answer}])[:1]]
    device = next(model.parameters()).device
    scores = []
    for ids, _ in encode_conversations(sides, [None] * len(sides), tokenizer, template):
        ids = ids + ([token] if token is not None else [])
        with torch.no_grad():  # the last token's score
            scores.append(model(input_ids=torch.tensor([ids], device=device)).logits[0, 0].item())
    return scores


def score_pair(model_path, prompt: str, chosen: str, rejected: str, adapter=None, system: str | None = None,
               prompt_template: str | None = None, hf_template: bool = False,
               reward_token_id: int | None = None) -> tuple[float, float]:
    """``(score of chosen, score of rejected)`` for one user prompt."""
    model, tokenizer, template, token = load_scorer(model_path, adapter, prompt_template, hf_template, reward_token_id)
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    chosen_score, rejected_score = score_answers(model, tokenizer, template, token, messages, [chosen, rejected])
    return chosen_score, rejected_score


class RewardModelReward:
    """A reward model trained by sfttool (``RewardModel``, docs/preference.md) as a reward function for
    online RL (``GRPO``): each completion is scored after its prompt, rendered and encoded exactly as
    ``sfttool score`` renders them. Loaded on first use (on the GPU when there is one).

    >>> reward_funcs = ['accuracy', dict(type=RewardModelReward, model_path='work_dirs/rm/hf_model')]  # doctest: +SKIP
    """

    def __init__(self, model_path, adapter=None, prompt_template: str | None = None, hf_template: bool = False,
                 reward_token_id: int | None = None, name: str = "reward_model"):
        self.args = (model_path, adapter, prompt_template, hf_template, reward_token_id)
        self.__name__ = name
        self._scorer = None

    def __call__(self, prompts: list, completions: list, **columns: Any) -> list[float]:
        import torch

        from sfttool.dataset.prompts import prompt_messages
        from sfttool.model.rewards import completion_text
        if self._scorer is None:
            model, *rest = load_scorer(*self.args)
            self._scorer = (model.to("cuda") if torch.cuda.is_available() else model, *rest)
        return [score_answers(*self._scorer, prompt_messages(prompt), [completion_text(completion)])[0]
                for prompt, completion in zip(prompts, completions)]
