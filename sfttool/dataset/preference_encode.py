"""Encode preference pairs: ``{"prompt", "chosen", "rejected"}`` messages -> two token sequences.

Each side is the conversation ``prompt + [answer]`` encoded exactly as SFT
encodes a conversation (``sfttool.dataset.encode``: an XTuner template or the
tokenizer's own chat template); earlier assistant messages of the prompt are
context (masked), only the final answer is trained. Both sides must start with
the same prompt tokens, which is checked.

Truncation keeps a pair meaningful. When a side is longer than ``max_length``:

1. the prompt loses its earliest turns (the system message stays; the last
   user message always stays), re-encoded, until the pair fits;
2. if a one-turn prompt is still too long, both answers are cut at
   ``max_length`` provided each keeps at least one trained token;
3. otherwise the pair is dropped.

Nothing is silent: each pair gets a ``note`` (what truncation did) or a
``drop`` reason, which the pipeline counts and logs.
"""
from __future__ import annotations

import sys
from typing import Any, Iterable

from sfttool.dataset.conversation import prompt_turns
from sfttool.dataset.encode import encode_batch
from sfttool.dataset.errors import ROW_COLUMN, DatasetError, where
from sfttool.utils.constants import IGNORE_INDEX
from sfttool.utils.templates import chat_template_options, is_hf_chat_template

COLUMNS = ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels", "prompt_tokens",
           "length", "num_tokens", "note", "drop")
NOTE_TURNS = "prompt truncated: earliest turns dropped"
NOTE_ANSWERS = "answers cut at max_length"
DROP_PROMPT_TOO_LONG = "prompt alone fills max_length (no room for the answers)"
DROP_PROMPT_MISMATCH = "chosen and rejected prompts tokenize differently"
DROP_SAME_ANSWER = "chosen and rejected answers are identical"
PROMPT_SHAPE = "; a prompt is an optional system message, then user/assistant turns ending with a user message"


# ---------------------------------------------------------------------------
# Rows -> two standard conversations.

def _messages(value: Any, field: str, row: int | None, source: str | None) -> list[dict]:
    if isinstance(value, dict):
        value = [value]  # one message given without its list
    ok = isinstance(value, list) and value and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)
    if not ok:
        raise DatasetError(f"{where(row, source, field)}: expected a non-empty list of messages "
                           f"{{'role': ..., 'content': ...}}, got {value!r:.80}; set a dataset_map_fn "
                           "(e.g. orpo_dpo_mix_40k_map_fn, intel_orca_dpo_map_fn, preference_strings_map_fn)")
    return value


def _answer(value: Any, field: str, row: int | None, source: str | None) -> dict:
    messages = _messages(value, field, row, source)
    if len(messages) != 1 or messages[0]["role"] != "assistant":
        roles = [m["role"] for m in messages]
        raise DatasetError(f"{where(row, source, field)}: expected one assistant message, got roles {roles}; "
                           "put the conversation before the answer into `prompt`")
    return messages[0]


def pair_conversations(prompt: Any, chosen: Any, rejected: Any, row: int | None = None,
                       source: str | None = None) -> tuple[list[dict], list[dict]]:
    """Standard conversations of the two sides; only the last turn (the answer) is trained.

    >>> pair_conversations([{'role': 'user', 'content': 'Q'}], [{'role': 'assistant', 'content': 'A'}],
    ...                    [{'role': 'assistant', 'content': 'B'}])
    ([{'input': 'Q', 'output': 'A'}], [{'input': 'Q', 'output': 'B'}])
    """
    messages = _messages(prompt, "prompt", row, source)
    if messages[-1]["role"] != "user":
        raise DatasetError(f"{where(row, source, 'prompt')}: the prompt must end with a user message, "
                           f"not {messages[-1]['role']!r}")
    turns = prompt_turns(messages, row, source, PROMPT_SHAPE)
    sides = []
    for field, value in (("chosen", chosen), ("rejected", rejected)):
        last = dict(turns[-1], output=_answer(value, field, row, source)["content"])
        sides.append(turns[:-1] + [last])
    return sides[0], sides[1]


def drop_first_turn(conversation: list[dict]) -> list[dict]:
    """The conversation without its first turn; the system prompt moves to the new first turn."""
    rest = [dict(turn) for turn in conversation[1:]]
    if conversation[0].get("system"):
        rest[0] = {"system": conversation[0]["system"], **rest[0]}
    return rest


# ---------------------------------------------------------------------------
# Conversations -> ids and labels.

def encode_conversations(conversations: list[list[dict]], rows: list, tokenizer, template: Any,
                         source: str | None = None) -> list[tuple[list[int], list[int]]]:
    """``(input_ids, labels)`` per conversation, uncut, by SFT's encoder (one tokenizer call)."""
    hf = is_hf_chat_template(template)
    if not hf and template is not None:
        from sfttool.dataset.map_fns import template_map_fn
        conversations = [template_map_fn({"conversation": c}, template)["conversation"] for c in conversations]
    out = encode_batch({"conversation": conversations, ROW_COLUMN: rows}, rows, tokenizer, sys.maxsize,
                       hf_chat_template=hf, source=source, chat_options=chat_template_options(template))
    return list(zip(out["input_ids"], out["labels"]))


def prompt_length(labels: list[int]) -> int:
    """Tokens before the first trained one: ``[-100, -100, 7, 8] -> 2``."""
    return next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), len(labels))


def _fit(chosen, rejected, max_length: int) -> tuple[dict | None, str]:
    """The pair as columns cut to ``max_length`` (answers only), or None and the drop reason."""
    (c_ids, c_labels), (r_ids, r_labels) = chosen, rejected
    p = prompt_length(c_labels)
    if p != prompt_length(r_labels) or c_ids[:p] != r_ids[:p]:
        return None, DROP_PROMPT_MISMATCH
    if c_ids[p:] == r_ids[p:] and c_labels[p:] == r_labels[p:]:
        return None, DROP_SAME_ANSWER
    if p >= max_length:
        return None, DROP_PROMPT_TOO_LONG
    pair = dict(chosen_input_ids=c_ids[:max_length], chosen_labels=c_labels[:max_length],
                rejected_input_ids=r_ids[:max_length], rejected_labels=r_labels[:max_length], prompt_tokens=p,
                num_tokens=max(len(c_ids), len(r_ids)))
    pair["length"] = len(pair["chosen_input_ids"]) + len(pair["rejected_input_ids"])
    return pair, ""


def _too_long(chosen, rejected, max_length: int) -> bool:
    return max(len(chosen[0]), len(rejected[0])) > max_length


def encode_pair_batch(batch: dict[str, list], indices: Iterable[int], tokenizer, max_length: int,
                      template: Any = None, source: str | None = None,
                      reward_token_id: int | None = None) -> dict[str, list]:
    """Batched ``datasets.map`` function: preference rows -> the two sides' ids and labels.

    >>> encode_pair_batch({'prompt': [[{'role': 'user', 'content': 'Q'}]],
    ...                    'chosen': [[{'role': 'assistant', 'content': 'A'}]],
    ...                    'rejected': [[{'role': 'assistant', 'content': 'B'}]]}, [0], tok, 64,
    ...                   'qwen_chat')   # doctest: +SKIP
    {'chosen_input_ids': [[...Q..., a, im_end, nl]], 'chosen_labels': [[-100, ..., a, im_end, -100]],
     'rejected_input_ids': [...], 'rejected_labels': [...], 'prompt_tokens': [p], 'length': [...],
     'num_tokens': [...], 'note': [''], 'drop': ['']}

    ``reward_token_id`` (reward-model data, XTuner's convention) is appended to
    both sequences after fitting them into ``max_length - 1`` tokens.
    """
    if reward_token_id is not None:
        out = encode_pair_batch(batch, indices, tokenizer, max_length - 1, template, source)
        return append_reward_token(out, reward_token_id)
    rows = list(batch[ROW_COLUMN]) if ROW_COLUMN in batch else list(indices)
    pairs = [pair_conversations(p, c, r, row, source)
             for p, c, r, row in zip(batch["prompt"], batch["chosen"], batch["rejected"], rows)]
    flat = encode_conversations([side for pair in pairs for side in pair], [r for r in rows for _ in "cr"],
                                tokenizer, template, source)
    out: dict[str, list] = {name: [] for name in COLUMNS}
    for k, (pair, row) in enumerate(zip(pairs, rows)):
        encoded, notes = (flat[2 * k], flat[2 * k + 1]), []
        while _too_long(*encoded, max_length) and len(pair[0]) > 1:
            pair, notes = tuple(drop_first_turn(side) for side in pair), [NOTE_TURNS]
            encoded = tuple(encode_conversations(list(pair), [row, row], tokenizer, template, source))
        if _too_long(*encoded, max_length):
            notes.append(NOTE_ANSWERS)
        columns, drop = _fit(*encoded, max_length)
        for name, value in (columns or _DROPPED).items():
            out[name].append(value)
        out["note"].append("" if drop else "; ".join(notes))
        out["drop"].append(drop)
    return out


def append_reward_token(out: dict[str, list], token: int) -> dict[str, list]:
    """End every kept sequence with ``token`` (trained, so it is each sequence's last trained position)."""
    for k, drop in enumerate(out["drop"]):
        if drop:
            continue
        for name in ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels"):
            out[name][k] = out[name][k] + [token]
        out["length"][k] += 2
    return out


# The columns of a dropped pair (removed by the pipeline, which counts its reason).
_DROPPED = dict(chosen_input_ids=[], chosen_labels=[], rejected_input_ids=[], rejected_labels=[], prompt_tokens=0,
                num_tokens=0, length=0)
