"""The encoder written plainly from its spec, one row and one token at a time, in Python lists: the
reference ``sfttool.dataset.encode`` (flat numpy arrays over a batch) is checked against, on every mode.

Only the tokenizer's own call (``tokenizer(text, add_special_tokens=False)``) tokenizes here; in chat-template
mode the rendered texts and trained character spans come from ``chat_targets.chat_template_samples``, which
``test_chat_targets.py`` checks against the official templates' renders.

* Template mode (XTuner 0.2's ``encode_fn``), per turn: BOS when the previous turn ended with EOS (and
  before the first; left out when the text after it starts with the BOS token), input (masked), output
  (trained unless ``output_with_loss`` is false), EOS when ``need_eos_token`` (labelled like the output),
  ``sep`` (masked). With ``input_ids_with_output=False`` only the inputs.
* Chat-template mode: each sample's text tokenized whole; a token is trained when it overlaps a trained
  character span.
* Both: ids and labels cut at ``max_length``; ``num_tokens`` before the cut, ``length`` after it,
  ``num_trained`` the kept labels, ``first_trained`` the first trained position of the uncut sample, or
  -1 (every answer masked), -2 (nothing to train), -3/-4/-5 (refused for what the template does not render:
  tool calls, reasoning, answer text).
"""
from __future__ import annotations

import json

IGNORE = -100
REFUSED = {"tool calls": -3, "reasoning_content": -4, "answer text": -5}


def _flag(turn: dict, key: str) -> bool:
    return True if turn.get(key) is None else bool(turn[key])


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def template_ids(conversation: list[dict], tokenizer, input_ids_with_output: bool = True) -> tuple[list, list]:
    """``(input_ids, labels)`` of one templated conversation."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    input_ids: list[int] = []
    labels: list[int] = []

    def add(ids: list[int], trained: bool) -> None:
        input_ids.extend(ids)
        labels.extend(ids if trained else [IGNORE] * len(ids))

    next_needs_bos = True
    for turn in conversation:
        prompt = _ids(tokenizer, turn.get("input") or "")
        if next_needs_bos and not (bos and prompt[:1] == bos):
            add(bos, False)
        add(prompt, False)
        if not input_ids_with_output:
            continue
        trained = _flag(turn, "output_with_loss")
        add(_ids(tokenizer, turn["output"]), trained)
        next_needs_bos = _flag(turn, "need_eos_token")
        if next_needs_bos:
            add(eos, trained)
        add(_ids(tokenizer, turn.get("sep") or ""), False)
    return input_ids, labels


def span_ids(text: str, spans: list[tuple[int, int]], tokenizer) -> tuple[list, list]:
    """``(input_ids, labels)`` of one rendered text: tokens overlapping a trained span are trained."""
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    labels = []
    for token, (start, end) in zip(encoded["input_ids"], encoded["offset_mapping"]):
        inside = any(start < span_end and end > span_start for span_start, span_end in spans)
        labels.append(token if inside else IGNORE)
    return list(encoded["input_ids"]), labels


def template_refusal(conversation: list[dict]) -> int | None:
    """A prompt template renders each turn's plain text: a trained answer with tool calls, or with reasoning
    as its only content, is refused."""
    for turn in conversation:
        if not turn.get("messages") or not _flag(turn, "output_with_loss"):
            continue
        messages = turn["messages"] if isinstance(turn["messages"], list) else json.loads(turn["messages"])
        answer = [m for m in messages if m.get("role") == "assistant"][-1]
        if answer.get("tool_calls"):
            return REFUSED["tool calls"]
        if not (answer.get("content") or "").strip() and (answer.get("reasoning_content") or "").strip():
            return REFUSED["reasoning_content"]
    return None


def encode_rows(conversations: list, rows: list[int], tokenizer, max_length: int, input_ids_with_output: bool = True,
                hf_chat_template: bool = False, chat_options: dict | None = None,
                skip_bad_rows: bool = False) -> dict[str, list]:
    """``encode_batch``'s columns (and ``_sfttool_row``), one sample at a time."""
    samples = []  # (row, conversation, input_ids, labels, refusal code)
    for conversation, row in zip(conversations, rows):
        for ids, labels, refused in _row_samples(conversation, row, tokenizer, input_ids_with_output,
                                                 hf_chat_template, chat_options, skip_bad_rows):
            samples.append((row, conversation, ids, labels, refused))
    out: dict[str, list] = {name: [] for name in ("input_ids", "labels", "length", "num_tokens", "num_trained",
                                                  "first_trained", "_sfttool_row")}
    for row, conversation, ids, labels, refused in samples:
        kept = labels[:max_length]
        out["input_ids"].append(ids[:max_length])
        out["labels"].append(kept)
        out["length"].append(min(len(ids), max_length))
        out["num_tokens"].append(len(ids))
        out["num_trained"].append(sum(1 for label in kept if label != IGNORE))
        out["first_trained"].append(_first_trained(labels, conversation, refused))
        out["_sfttool_row"].append(row)
    return out


def _row_samples(conversation, row, tokenizer, input_ids_with_output, hf_chat_template, chat_options, skip_bad_rows):
    from sfttool.dataset.chat_targets import chat_template_samples
    from sfttool.dataset.chat_encode import chat_renderer
    from sfttool.dataset.tokens import special_token_texts
    from sfttool.dataset.unrendered import Unrendered
    if not hf_chat_template:
        refused = template_refusal(conversation) if input_ids_with_output else None
        if refused is not None:
            assert skip_bad_rows, "a refused row is an error without skip_bad_rows"
            return [([], [], refused)]
        return [(*template_ids(conversation, tokenizer, input_ids_with_output), None)]
    try:
        samples = chat_template_samples(conversation, chat_renderer(tokenizer, chat_options),
                                        special_token_texts(tokenizer), chat_options, row)
    except Unrendered as exc:
        assert skip_bad_rows, "a refused row is an error without skip_bad_rows"
        return [([], [], REFUSED[exc.feature])]
    return [(*span_ids(text, spans, tokenizer), None) for text, spans in samples]


def _first_trained(labels: list[int], conversation: list[dict], refused: int | None) -> int:
    for i, label in enumerate(labels):
        if label != IGNORE:
            return i
    if refused is not None:
        return refused
    return -2 if any(_flag(turn, "output_with_loss") for turn in conversation) else -1
