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
  -1 (every answer masked), -2 (nothing to train).
"""
from __future__ import annotations

IGNORE = -100


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


def encode_rows(conversations: list, rows: list[int], tokenizer, max_length: int, input_ids_with_output: bool = True,
                hf_chat_template: bool = False, chat_options: dict | None = None) -> dict[str, list]:
    """``encode_batch``'s columns (and ``_sfttool_row``), one sample at a time."""
    samples = []  # (row, conversation, input_ids, labels)
    for conversation, row in zip(conversations, rows):
        for ids, labels in _row_samples(conversation, row, tokenizer, input_ids_with_output, hf_chat_template,
                                        chat_options):
            samples.append((row, conversation, ids, labels))
    out: dict[str, list] = {name: [] for name in ("input_ids", "labels", "length", "num_tokens", "num_trained",
                                                  "first_trained", "_sfttool_row")}
    for row, conversation, ids, labels in samples:
        kept = labels[:max_length]
        out["input_ids"].append(ids[:max_length])
        out["labels"].append(kept)
        out["length"].append(min(len(ids), max_length))
        out["num_tokens"].append(len(ids))
        out["num_trained"].append(sum(1 for label in kept if label != IGNORE))
        out["first_trained"].append(_first_trained(labels, conversation))
        out["_sfttool_row"].append(row)
    return out


def _row_samples(conversation, row, tokenizer, input_ids_with_output, hf_chat_template, chat_options):
    from sfttool.dataset.chat_targets import chat_template_samples
    from sfttool.dataset.encode import chat_renderer, special_token_texts
    if not hf_chat_template:
        return [template_ids(conversation, tokenizer, input_ids_with_output)]
    samples = chat_template_samples(conversation, chat_renderer(tokenizer, chat_options),
                                    special_token_texts(tokenizer), chat_options, row)
    return [span_ids(text, spans, tokenizer) for text, spans in samples]


def _first_trained(labels: list[int], conversation: list[dict]) -> int:
    for i, label in enumerate(labels):
        if label != IGNORE:
            return i
    return -2 if any(_flag(turn, "output_with_loss") for turn in conversation) else -1
