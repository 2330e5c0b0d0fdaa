"""The map-style pipeline's output does not depend on how its stages are grouped into ``datasets.map``
calls: the built-in template map fn applied inside the encode stage gives exactly what a separate
template stage gives (ids, labels, row numbers, the report's counts), packed or not."""
from __future__ import annotations

import functools
import hashlib
import importlib
import json
import sys
from pathlib import Path

import pytest
from datasets import Dataset

from sfttool import assets
from sfttool.dataset.map_fns import template_map_fn_factory
from sfttool.dataset.pipeline import folds_into_encode, run_pipeline

sys.path.insert(0, str(Path(__file__).resolve().parent))
import reference_encoder as reference  # noqa: E402

QWEN = template_map_fn_factory("qwen_chat")


def _as_user_fn(row, fn):
    return fn(row)


# Not the built-in template map fn itself, so the pipeline gives it a stage of its own.
SEPARATE_QWEN = functools.partial(_as_user_fn, fn=QWEN)


def edge_rows() -> list[dict]:
    """Generated rows plus one of each kind a stage drops, cuts or counts."""
    rows = assets.tiny_conversations(40, seed=3)
    long_prompt = " ".join(["word"] * 200)
    return rows + [
        {"conversation": []},
        {"conversation": [{"input": "q", "output": "a", "output_with_loss": False}]},
        {"conversation": [{"input": long_prompt + "?", "output": "cut away."}]},
        {"conversation": [{"input": "short?", "output": " ".join(["answer"] * 200) + "."}]},
        {"conversation": [{"system": "Be brief.", "input": "one?", "output": "1."},
                          {"input": "two?", "output": "2.", "output_with_loss": False},
                          {"input": "three?", "output": "3."}]},
    ]


def reasoning_rows() -> list[dict]:
    """OpenAI-format rows; some carry reasoning, which a prompt template leaves out (counted)."""
    rows = []
    for i in range(12):
        answer = {"role": "assistant", "content": f"answer {i}."}
        if i % 3 == 0:
            answer["reasoning_content"] = f"thinking about {i}"
        rows.append({"messages": [{"role": "user", "content": f"question {i}?"}, answer]})
    return rows


def outcome(rows, tok, template_map_fn, **kw):
    out, report = run_pipeline(Dataset.from_list(rows), tok, 64, template_map_fn=template_map_fn, **kw)
    counts = {name: getattr(report, name) for name in ("rows_in", "rows_out", "dropped", "drop_examples", "changed",
                                                       "change_examples", "encoded", "truncated", "tokens_cut",
                                                       "tokens", "trained_tokens", "sample_lengths", "split")}
    pack = report.pack and (report.pack.rows, report.pack.samples, report.pack.split_samples)
    return out.to_dict(), counts, pack


def test_only_the_built_in_template_map_fn_folds_into_encoding():
    assert folds_into_encode(QWEN, [], True)
    assert not folds_into_encode(SEPARATE_QWEN, [], True)
    assert not folds_into_encode(QWEN, [("conv", "conversation")], True)
    assert not folds_into_encode(QWEN, [], False)
    assert not folds_into_encode(None, [], True)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
@pytest.mark.parametrize("data", ["edge", "reasoning"])
def test_template_inside_encoding_equals_a_template_stage(tiny_tokenizer, packed, data):
    rows, kw = (edge_rows(), {}) if data == "edge" else (reasoning_rows(), {"dataset_map_fn": "openai_map_fn"})
    folded = outcome(rows, tiny_tokenizer, QWEN, pack_to_max_length=packed, **kw)
    separate = outcome(rows, tiny_tokenizer, SEPARATE_QWEN, pack_to_max_length=packed, **kw)
    assert folded == separate
    counts = folded[1]
    if data == "edge":  # the cases are there: a drop of each kind and cut samples
        assert len(counts["dropped"]) == 3 and counts["truncated"] >= 2
    else:
        assert counts["changed"] == {"reasoning_content ignored by the prompt template (use hf_chat_template): "
                                     "not in the trained text": 4}


def test_check_views_keep_the_template_stage(tiny_tokenizer):
    """check-custom-dataset prints the rows after the template map fn: kept when the template is folded."""
    rows = assets.tiny_conversations(4, seed=0)
    _, report = run_pipeline(Dataset.from_list(rows), tiny_tokenizer, 64, template_map_fn=QWEN, keep_stages=True)
    assert list(report.stages) == ["loaded", "template", "encoded", "packed"]
    assert report.stages["template"][0]["conversation"][0]["input"].startswith("<|im_start|>")


def test_the_template_runs_once_per_turn_whether_or_not_the_stages_are_kept(tiny_tokenizer, monkeypatch):
    """check-custom-dataset keeps every stage: the template stage is then a map of its own, and the encode
    stage reads its rows instead of templating them again."""
    module = importlib.import_module("sfttool.dataset.map_fns.template_map_fn")
    calls, render = [], module._render_input
    monkeypatch.setattr(module, "_render_input", lambda *args, **kw: calls.append(1) or render(*args, **kw))
    rows = assets.tiny_conversations(6, seed=0)
    turns = sum(len(row["conversation"]) for row in rows)
    outputs = []
    for keep_stages in (False, True):
        calls.clear()
        out, _ = run_pipeline(Dataset.from_list(rows), tiny_tokenizer, 64, template_map_fn=QWEN,
                              keep_stages=keep_stages)
        assert len(calls) == turns
        outputs.append(out.to_dict())
    assert outputs[0] == outputs[1]


def test_output_is_pinned(tiny_tokenizer):
    """The rows of a fixed input, hashed: the same before and after any regrouping of the stages."""
    out, report = run_pipeline(Dataset.from_list(edge_rows()), tiny_tokenizer, 64, template_map_fn=QWEN)
    digest = hashlib.sha256(json.dumps(out.to_dict(), sort_keys=True).encode()).hexdigest()[:16]
    assert (report.rows_out, report.tokens, report.trained_tokens) == PINNED_COUNTS
    assert digest == PINNED_DIGEST


PINNED_COUNTS = (42, 2430, 783)
PINNED_DIGEST = "ea720b704145d03c"


def chat_template_sample(conversation: list[dict], tokenizer, max_length: int) -> tuple[list[int], list[int]]:
    """One row encoded without sfttool: the tokenizer's own ChatML chat template (qwen_chat writes the same
    text) renders it, the tokenizer's own call tokenizes it whole, and a token is trained when it lies within
    a trained answer and its ``<|im_end|>`` (where the render up to that answer, with the generation prompt,
    ends); cut at ``max_length``."""
    messages, answers = [], []
    if conversation[0].get("system"):
        messages.append({"role": "system", "content": conversation[0]["system"]})
    for turn in conversation:
        messages.append({"role": "user", "content": turn["input"]})
        start = len(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
        messages.append({"role": "assistant", "content": turn["output"]})
        if turn.get("output_with_loss", True):
            answers.append((start, start + len(turn["output"] + "<|im_end|>")))
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    labels = [token if any(a <= start and end <= b for a, b in answers) else -100
              for token, (start, end) in zip(encoded["input_ids"], encoded["offset_mapping"])]
    return encoded["input_ids"][:max_length], labels[:max_length]


def test_the_pinned_rows_are_the_chat_template_renders(tiny_tokenizer):
    """The pinned rows checked independently of sfttool's encoder (``chat_template_sample``): the packed rows
    hold exactly those samples, each whole, and rows with nothing left to train are the ones dropped."""
    out, report = run_pipeline(Dataset.from_list(edge_rows()), tiny_tokenizer, 64, template_map_fn=QWEN)
    expected = [chat_template_sample(row["conversation"], tiny_tokenizer, 64) for row in edge_rows()
                if row["conversation"]]
    expected = [sample for sample in expected if any(label != -100 for label in sample[1])]
    packed = []
    for row in out:
        start = 0
        for length in row["sample_lengths"]:
            packed.append((row["input_ids"][start:start + length], row["labels"][start:start + length]))
            start += length
    assert sorted(packed) == sorted(expected)
    assert (report.tokens, report.trained_tokens) == (sum(len(ids) for ids, _ in expected),
                                                      sum(sum(label != -100 for label in labels)
                                                          for _, labels in expected)) == PINNED_COUNTS[1:]


@pytest.mark.parametrize("max_length", [1, 16, 64, 4096])
def test_batch_columns_built_in_numpy_equal_the_plain_encoding(tiny_tokenizer, max_length):
    """The encode stage's numpy columns equal the plain reference encoding (``reference_encoder``)."""
    from sfttool.dataset.encode import encode_batch_arrays
    conversations = [QWEN(row)["conversation"] for row in edge_rows() if row["conversation"]]
    batch, indices = {"conversation": conversations}, list(range(10, 10 + len(conversations)))
    expected = reference.encode_rows(conversations, indices, tiny_tokenizer, max_length)
    got = encode_batch_arrays(batch, indices, tiny_tokenizer, max_length)
    assert {name: [list(v) if hasattr(v, "__len__") else v for v in values] for name, values in got.items()} == \
        {name: list(values) for name, values in expected.items()}
    assert len(set(expected["first_trained"])) > 2  # trained, masked and cut rows are all there
