"""Preference data: map fns, pair encoding (= SFT's encoding of each side), shared prompts,
truncation counted by reason, packing of whole pairs (no pair split, no token lost), collation."""
from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
from datasets import Dataset, load_dataset

from sfttool import assets
from sfttool.dataset import DatasetError, build_preference_dataset, process_hf_dataset
from sfttool.dataset.collate_fns import preference_collate_fn
from sfttool.dataset.map_fns import (MapFnError, intel_orca_dpo_map_fn, orpo_dpo_mix_40k_map_fn,
                                     preference_strings_map_fn, template_map_fn_factory,
                                     ultrafeedback_binarized_map_fn)
from sfttool.registry import MAP_FUNC
from sfttool.utils import PROMPT_TEMPLATE

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_pipeline import logged  # noqa: E402  (the log-capturing helper the SFT pipeline tests use)

WORDS = "the cat sat on a mat and then it ran to see how far the dog could go today".split()


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def words(rng, lo, hi):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def make_rows(n: int, seed: int = 0) -> list[dict]:
    """``n`` preference rows: a system prompt on some, earlier turns on some, two different answers."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        prompt = [{"role": "system", "content": "Be brief."}] if i % 3 == 0 else []
        for _ in range(i % 2):
            prompt += [user(words(rng, 2, 6) + "?"), assistant(words(rng, 2, 8) + ".")]
        prompt.append(user(words(rng, 2, 8) + "?"))
        rows.append({"prompt": prompt, "chosen": [assistant(words(rng, 2, 10) + ".")],
                     "rejected": [assistant("no " + words(rng, 1, 12) + "!")]})
    return rows


def sequences(ds) -> list[tuple]:
    """Every row's sequences as (ids, labels, position_ids) tuples, in row order."""
    out = []
    for row in ds:
        start = 0
        for n in row["sample_lengths"]:
            out.append(tuple(tuple(row[k][start:start + n]) for k in ("input_ids", "labels", "position_ids")))
            start += n
    return out


def pairs_of(ds) -> list[tuple]:
    seqs = sequences(ds)
    return [(seqs[i], seqs[i + 1]) for i in range(0, len(seqs), 2)]


def build(rows, tok, **kw):
    kw.setdefault("max_length", 128)
    return build_preference_dataset(Dataset.from_list(rows), tok, **kw)


# --- map fns ----------------------------------------------------------------------------------------


PAIR = {"prompt": [user("Hi")], "chosen": [assistant("Hello!")], "rejected": [assistant("Go away.")]}


@pytest.mark.parametrize("fn,row", [
    (orpo_dpo_mix_40k_map_fn, {"chosen": [user("Hi"), assistant("Hello!")],
                               "rejected": [user("Hi"), assistant("Go away.")], "source": "x"}),
    (ultrafeedback_binarized_map_fn, {"prompt": "Hi", "chosen": [user("Hi"), assistant("Hello!")],
                                      "rejected": [user("Hi"), assistant("Go away.")], "score_chosen": 9.0}),
    (preference_strings_map_fn, {"prompt": "Hi", "chosen": "Hello!", "rejected": "Go away."}),
    (intel_orca_dpo_map_fn, {"system": "", "question": "Hi", "chosen": "Hello!", "rejected": "Go away."}),
])
def test_map_fns_give_the_pair_format(fn, row):
    assert fn(row) == PAIR
    assert MAP_FUNC.get(fn.__name__) is fn


def test_intel_orca_keeps_the_system_prompt():
    out = intel_orca_dpo_map_fn({"system": "S", "question": "Q", "chosen": "A", "rejected": "B"})
    assert out["prompt"] == [{"role": "system", "content": "S"}, user("Q")]


def test_conversations_that_answer_different_prompts_are_refused():
    with pytest.raises(MapFnError, match="differ before their last message"):
        orpo_dpo_mix_40k_map_fn({"chosen": [user("Hi"), assistant("A")], "rejected": [user("Yo"), assistant("B")]})
    with pytest.raises(MapFnError, match="'chosen' must end with an assistant message"):
        orpo_dpo_mix_40k_map_fn({"chosen": [user("Hi")], "rejected": [user("Hi"), assistant("B")]})


# --- encoding: each side is SFT's encoding of the same conversation ---------------------------------------


@pytest.mark.parametrize("template", ["qwen_chat", None], ids=["template", "chat_template"])
def test_each_side_is_the_sft_encoding_of_its_conversation(tiny_tokenizer, template):
    rows = make_rows(12, seed=1)
    ds = build(rows, tiny_tokenizer, prompt_template=template, pack_to_max_length=False, shuffle_before_pack=False)
    conversations = []
    for row in rows:
        for side in ("chosen", "rejected"):
            messages = row["prompt"] + row[side]
            conversations.append({"messages": messages})
    tpl = PROMPT_TEMPLATE.hf_chat_template if template is None else PROMPT_TEMPLATE[template]
    sft = process_hf_dataset(Dataset.from_list(conversations), tiny_tokenizer, max_length=128,
                             dataset_map_fn="openai_map_fn", pack_to_max_length=False,
                             template_map_fn=dict(type=template_map_fn_factory, template=tpl))
    got = sequences(ds)
    for (ids, labels, _), want in zip(got, sft):
        assert list(ids) == want["input_ids"]
        # SFT trains every answer of the conversation; a preference pair only its final answer.
        first = next(i for i, label in enumerate(labels) if label != -100)
        assert list(labels[first:]) == want["labels"][first:]
        assert all(label == -100 for label in labels[:first])
    assert len(got) == 24


@pytest.mark.parametrize("template", ["qwen_chat", None], ids=["template", "chat_template"])
def test_trained_tokens_are_exactly_the_answer_and_its_end_token(tiny_tokenizer, template):
    rows = make_rows(9, seed=2)
    ds = build(rows, tiny_tokenizer, prompt_template=template, pack_to_max_length=False, shuffle_before_pack=False)
    for row, (chosen, rejected) in zip(rows, pairs_of(ds)):
        for side, (ids, labels, _) in (("chosen", chosen), ("rejected", rejected)):
            text = tiny_tokenizer.decode([label for label in labels if label != -100])
            assert text == row[side][0]["content"] + "<|im_end|>"
        n = next(i for i, label in enumerate(chosen[1]) if label != -100)
        assert chosen[0][:n] == rejected[0][:n]  # the shared prompt


def test_prompts_that_tokenize_differently_are_dropped_and_counted(tiny_tokenizer_dir):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    # No separator between turns: the prompt's last characters and the answer's first can merge into one token.
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    pair = {"prompt": [user("ca")], "chosen": [assistant("t")], "rejected": [assistant(" dog")]}
    encode = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert encode("cat")[:len(encode("ca"))] != encode("ca")  # "ca" + "t" tokenizes as another prefix
    ds, text = logged(build, [pair, PAIR], tok, pack_to_max_length=False)
    assert len(ds) == 1
    assert "dropped 1 pairs: chosen and rejected prompts tokenize differently" in text


# --- truncation ------------------------------------------------------------------------------------------


def test_long_prompts_lose_their_earliest_turns_but_keep_the_system_prompt(tiny_tokenizer):
    long_turns = []
    for i in range(6):
        long_turns += [user(f"question {i} " + "the cat sat " * 4), assistant(f"answer {i} " + "a mat " * 4)]
    row = {"prompt": [{"role": "system", "content": "SYSTEM"}] + long_turns + [user("last question?")],
           "chosen": [assistant("yes.")], "rejected": [assistant("no.")]}
    ds, text = logged(build, [row], tiny_tokenizer, max_length=80, pack_to_max_length=False)
    (chosen, rejected), = pairs_of(ds)
    decoded = tiny_tokenizer.decode(chosen[0])
    assert len(chosen[0]) <= 80 and len(rejected[0]) <= 80
    assert decoded.startswith("<|im_start|>system\nSYSTEM<|im_end|>\n<|im_start|>user\nquestion ")
    assert "question 0" not in decoded and "last question?" in decoded
    assert decoded.endswith("yes.<|im_end|>\n")
    assert "1 pairs over max_length=80: prompt truncated: earliest turns dropped" in text


def test_answers_are_cut_but_never_to_nothing_and_long_prompts_are_dropped(tiny_tokenizer):
    rows = [{"prompt": [user("short?")], "chosen": [assistant("the cat " * 40)], "rejected": [assistant("no.")]},
            {"prompt": [user("the cat sat " * 30)], "chosen": [assistant("a")], "rejected": [assistant("b")]},
            {"prompt": [user("q?")], "chosen": [assistant("same")], "rejected": [assistant("same")]},
            PAIR]
    ds, text = logged(build, rows, tiny_tokenizer, max_length=40, pack_to_max_length=False, shuffle_before_pack=False)
    pairs = pairs_of(ds)
    assert len(pairs) == 2
    (chosen, rejected) = pairs[0]
    assert len(chosen[0]) == 40 and tiny_tokenizer.decode(rejected[0]).endswith("no.<|im_end|>\n")
    assert sum(label != -100 for label in chosen[1]) > 0
    assert "1 pairs over max_length=40: answers cut at max_length" in text
    assert "dropped 1 pairs: prompt alone fills max_length (no room for the answers)" in text
    assert "dropped 1 pairs: chosen and rejected answers are identical" in text
    assert "4 rows in, 2 pairs in 2 rows out" in text


# --- packing ----------------------------------------------------------------------------------------------


def test_packing_keeps_pairs_whole_and_loses_no_token(tiny_tokenizer):
    rows = make_rows(40, seed=3)
    unpacked = build(rows, tiny_tokenizer, pack_to_max_length=False)
    packed = build(rows, tiny_tokenizer, max_packed_length=300)
    assert len(unpacked) == 40 and len(packed) < 20
    assert sorted(pairs_of(packed)) == sorted(pairs_of(unpacked))  # same pairs, chosen before rejected
    for row in packed:
        assert row["length"] <= 300 and len(row["sample_lengths"]) % 2 == 0
        assert sum(row["sample_lengths"]) == row["length"] == len(row["input_ids"]) == len(row["position_ids"])
    assert packed.column_names == ["input_ids", "labels", "position_ids", "sample_lengths", "length"]


def test_packing_is_seeded(tiny_tokenizer):
    rows = make_rows(30, seed=4)
    a = build(rows, tiny_tokenizer, max_packed_length=300, seed=1)
    assert a.to_list() == build(rows, tiny_tokenizer, max_packed_length=300, seed=1).to_list()
    assert a.to_list() != build(rows, tiny_tokenizer, max_packed_length=300, seed=2).to_list()


def test_collate_numbers_sequences_across_the_batch(tiny_tokenizer):
    ds = build(make_rows(6, seed=5), tiny_tokenizer, max_packed_length=256)
    rows = [ds[i] for i in range(len(ds))]
    data = preference_collate_fn(rows)["data"]
    width = max(r["length"] for r in rows)
    first = 0
    for b, row in enumerate(rows):
        want = []
        for k, n in enumerate(row["sample_lengths"]):
            want += [first + k] * n
        first += len(row["sample_lengths"])
        assert data["sequence_ids"][b].tolist() == want + [-1] * (width - row["length"])
    assert first == 12
    assert data["input_ids"].shape == data["sequence_ids"].shape == data["position_ids"].shape


# --- config and errors -----------------------------------------------------------------------------------


def test_jsonl_config_with_a_map_fn_name(tmp_path, tiny_tokenizer_dir):
    from transformers import AutoTokenizer
    path = assets.write_jsonl(tmp_path / "pairs.jsonl", [
        {"system": "", "question": "Hi", "chosen": "Hello!", "rejected": "Go away."}])
    ds = build_preference_dataset(
        dataset=dict(type=load_dataset, path="json", data_files=str(path)),
        tokenizer=dict(type=AutoTokenizer.from_pretrained, pretrained_model_name_or_path=str(tiny_tokenizer_dir)),
        max_length=64, dataset_map_fn="intel_orca_dpo_map_fn", max_packed_length=128)
    assert len(ds) == 1 and len(ds[0]["sample_lengths"]) == 2


def test_a_map_fn_that_takes_notes_has_its_changes_counted_and_logged(tiny_tokenizer):
    def trim_system(row, notes=None):  # the SFT map fns' convention: say what the row lost
        notes.append("system prompt removed")
        return {k: v for k, v in row.items() if k != "system"}
    rows = [dict(PAIR, system="Be brief.") for _ in range(3)]
    ds, log = logged(build, rows, tiny_tokenizer, dataset_map_fn=trim_system, max_packed_length=256)
    assert sum(len(r["sample_lengths"]) for r in ds) == 6
    assert "Preference data: changed 3 rows: system prompt removed (row 0, row 1, row 2)" in log


def test_a_preference_config_reads_data_path_like_an_sft_one(tmp_path):
    """PART 1's data_path (a file, folder or glob) reaches the dataset through load_data_path."""
    from sfttool.config import load_config
    from sfttool.registry import build as build_node
    path = assets.write_jsonl(tmp_path / "pairs" / "part1.jsonl", [PAIR, PAIR])
    for data_path in (path, path.parent, tmp_path / "pairs" / "*.jsonl"):
        cfg = load_config("qwen2_5_7b_instruct_qlora_dpo_ultrafeedback_e1", [f"data_path={data_path}"])
        source = cfg.train_dataloader.dataset.dataset.dataset  # under the validation split, which holds out pairs
        rows = build_node(source, "train_dataloader.dataset.dataset.dataset")
        assert rows["train"].column_names == ["prompt", "chosen", "rejected"] and len(rows["train"]) == 2


def test_a_preference_config_trains_on_your_pairs_from_the_command_line(tmp_path, tiny_tokenizer_dir):
    """docs/preference.md: data_path, data_split and dataset_map_fn are all a run on your own pairs needs."""
    from sfttool.config import load_config
    from sfttool.registry import build as build_node
    path = assets.write_jsonl(tmp_path / "pairs.jsonl", [PAIR, PAIR, PAIR])
    cfg = load_config("qwen2_5_7b_instruct_qlora_dpo_ultrafeedback_e1", [
        f"data_path={path}", "data_split=train", "dataset_map_fn=None",
        f"pretrained_model_name_or_path={tiny_tokenizer_dir}", "max_length=64", "max_packed_length=128"])
    assert cfg.train_dataset.dataset_map_fn is None and cfg.train_dataset.split == "train"
    ds = build_node(cfg.train_dataloader.dataset, "train_dataloader.dataset")
    held_out = build_node(cfg.val_dataloader.dataset, "val_dataloader.dataset")
    # 3 pairs, two sequences each: val_ratio = 0.01 holds out one pair (at least one), the other two train
    assert sum(len(r["sample_lengths"]) for r in ds) == 4
    assert sum(len(r["sample_lengths"]) for r in held_out) == 2


@pytest.mark.parametrize("row,message", [
    ({"question": "x"}, "preference rows need `prompt`, `chosen` and `rejected`"),
    ({"prompt": [user("q")], "chosen": "text", "rejected": [assistant("b")]}, "row 0, field 'chosen': expected a non"),
    ({"prompt": [user("q")], "chosen": [user("a")], "rejected": [assistant("b")]},
     "row 0, field 'chosen': expected one assistant message"),
    ({"prompt": [assistant("a")], "chosen": [assistant("a")], "rejected": [assistant("b")]},
     "row 0, field 'prompt': the prompt must end with a user message"),
])
def test_bad_rows_name_the_row_and_field(tiny_tokenizer, row, message):
    with pytest.raises(DatasetError, match=message.replace("(", r"\(")):
        build([row], tiny_tokenizer)


def test_max_packed_length_must_fit_a_pair(tiny_tokenizer):
    with pytest.raises(DatasetError, match="set max_packed_length >= 256"):
        build([PAIR], tiny_tokenizer, max_length=128, max_packed_length=200)
