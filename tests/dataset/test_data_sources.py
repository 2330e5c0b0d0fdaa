"""PART 1's ``data_sources``: per-source slice, map fn (None drops), filter fn; concat by ratio and
interleave as ``datasets.interleave_datasets``; packing after mixing; one source == ``data_path``."""
from __future__ import annotations

import numpy as np
import pytest
from datasets import Dataset, DatasetDict, interleave_datasets

from sfttool import assets
from sfttool.dataset import DatasetError, process_data_sources, process_hf_dataset
from sfttool.dataset.data_path import load_data_path
from sfttool.dataset.data_sources import run_sources, source_lines
from sfttool.dataset.errors import ROW_COLUMN
from sfttool.dataset.map_fns import alpaca_map_fn, template_map_fn_factory
from sfttool.dataset.mix import sample_indices
from sfttool.dataset.source_stages import load_source, sources_problems, wrapped_indices
from sfttool.utils import PROMPT_TEMPLATE

QWEN = dict(type=template_map_fn_factory, template=PROMPT_TEMPLATE.qwen_chat)


def alpaca_rows(n: int, tag: str) -> list[dict]:
    """Rows whose answer says which source and row they are (``tag`` and the row number)."""
    return [{"instruction": f"{tag} question {i}", "input": "", "output": f"{tag} answer {i} " + "x" * (i % 5)}
            for i in range(n)]


@pytest.fixture
def files(tmp_path):
    return {"chat": assets.write_jsonl(tmp_path / "chat.jsonl", assets.tiny_conversations(12, seed=1)),
            "alpaca": assets.write_jsonl(tmp_path / "alpaca.jsonl", alpaca_rows(8, "b"))}


def unpacked(sources, tok, **kw):
    """``run_sources`` without packing or shuffling: one sample per row, in mixed order."""
    kw = dict(dict(template_map_fn=QWEN, pack_to_max_length=False, shuffle_before_pack=False, seed=0), **kw)
    return run_sources(sources, tok, 128, **kw)


# ---------------------------------------------------------------------------
# Slices, map fn, filter fn.

def test_slice_wraps_around_in_order(files):
    assert wrapped_indices(range(7), 3).tolist() == [0, 1, 2, 0, 1, 2, 0]
    rows, name, read = load_source(1, dict(data_path=str(files["alpaca"]), slice=range(3 * 8)))
    assert read == 8 and rows[ROW_COLUMN] == list(range(8)) * 3
    assert str(name) == f"data_sources[1] {files['alpaca']}"  # the file once, as errors name it
    rows, _, _ = load_source(0, dict(data_path=str(files["alpaca"]), slice=[7, 9, 2]))
    assert rows[ROW_COLUMN] == [7, 1, 2] and rows["instruction"] == ["b question 7", "b question 1", "b question 2"]


def drop_five(row):
    return None if row["instruction"].endswith(" 5") else alpaca_map_fn(row)


def long_answer(row):
    return len(row["conversation"][0]["output"]) > len("b answer 0 ") + 1  # rows 2, 3, 4, 7 (i % 5 >= 2)


def test_map_none_and_filter_false_drop_rows_counted_by_source_and_cause(files, tiny_tokenizer):
    sources = [dict(name="chat", data_path=str(files["chat"])),
               dict(name="b", data_path=str(files["alpaca"]), map_fn=drop_five, filter_fn=long_answer,
                    slice=range(12))]
    dataset, report = unpacked(sources, tiny_tokenizer)
    chat, b = report.sources
    # b: rows 0..7 then 0..3; map drops row 5 (once); the filter keeps rows 2, 3, 4, 7 and then 2, 3.
    assert (b.read, b.sliced, b.kept, b.samples, b.used) == (8, 12, 6, 6, 6)
    assert b.report.dropped == {"map_fn drop_five returned None": 1, "filter_fn long_answer returned False": 5}
    assert b.report.drop_examples["filter_fn long_answer returned False"] == ["row 0", "row 1", "row 6",
                                                                             "row 0", "row 1"]
    assert report.dropped == {"data_sources[1] (b): map_fn drop_five returned None": 1,
                              "data_sources[1] (b): filter_fn long_answer returned False": 5}
    assert report.drop_examples["data_sources[1] (b): map_fn drop_five returned None"] == ["row 5"]
    assert (chat.read, chat.kept, chat.used) == (12, 12, 12) and chat.report.dropped == {}
    # Training columns only (no row numbers or source index); concat: every chat sample, then b's, in order.
    assert dataset.column_names == ["input_ids", "labels", "position_ids", "sample_lengths", "length"]
    texts = [tiny_tokenizer.decode([t for t in row["labels"] if t >= 0]) for row in dataset]
    assert [t.split()[2] for t in texts[12:]] == ["2", "3", "4", "7", "2", "3"]
    assert all(t.startswith("b answer") for t in texts[12:]) and not any(t.startswith("b answer") for t in texts[:12])


def test_a_batch_of_rows_all_dropped_by_the_map_fn(tmp_path, tiny_tokenizer):
    """datasets writes no empty batch: the first 1000-row batch, all dropped, leaves no gap in the schema."""
    path = assets.write_jsonl(tmp_path / "many.jsonl", alpaca_rows(1003, "m"))

    def last_three(row):
        return alpaca_map_fn(row) if int(row["instruction"].split()[-1]) >= 1000 else None

    dataset, report = unpacked([dict(data_path=str(path), map_fn=last_three)], tiny_tokenizer, map_num_proc=1)
    assert len(dataset) == 3 and report.sources[0].kept == 3
    assert report.sources[0].report.dropped == {"map_fn last_three returned None": 1000}


def test_filter_returning_a_non_bool_names_source_row_and_fix(files, tiny_tokenizer):
    def count_turns(row):
        return len(row["conversation"])

    turns = len(assets.tiny_conversations(12, seed=1)[0]["conversation"])
    with pytest.raises(DatasetError) as err:
        unpacked([dict(data_path=str(files["chat"]), filter_fn=count_turns)], tiny_tokenizer)
    assert str(err.value) == (f"data_sources[0] {files['chat']}, row 0: filter_fn count_turns "
                              f"returned int {turns}, not a bool; return True to keep the row, False to drop it")


def test_every_row_dropped_names_the_source(files, tiny_tokenizer):
    with pytest.raises(DatasetError, match=r"^data_sources\[0\] \(x\): no rows left after map_fn and filter_fn: "
                                           r"8 dropped \(filter_fn <lambda> returned False\)$"):
        unpacked([dict(name="x", data_path=str(files["alpaca"]), map_fn=alpaca_map_fn, filter_fn=lambda r: False)],
                 tiny_tokenizer)


# ---------------------------------------------------------------------------
# One source is today's data_path.

@pytest.mark.parametrize("pack", [True, False])
def test_one_source_equals_data_path(files, tiny_tokenizer, pack):
    path = str(files["alpaca"])
    today = process_hf_dataset(dict(type=load_data_path, path=path), tiny_tokenizer, 64, dataset_map_fn=alpaca_map_fn,
                               template_map_fn=QWEN, pack_to_max_length=pack, seed=7, remove_unused_columns=True)
    sources = process_data_sources([dict(data_path=path, map_fn=alpaca_map_fn)], tiny_tokenizer, 64, QWEN,
                                   pack_to_max_length=pack, seed=7)
    assert sources.column_names == today.column_names
    assert sources.to_list() == today.to_list() and len(today) == (3 if pack else 8)


# ---------------------------------------------------------------------------
# Mixing.

def answers(dataset, tok) -> list[str]:
    """Each sample's trained text: the answer, which names its source and row (``alpaca_rows``)."""
    return [" ".join(tok.decode([t for t in row["labels"] if t >= 0]).split()[:3]) for row in dataset]


def two_alpaca(tmp_path, sizes=(10, 4)) -> list[dict]:
    return [dict(name=tag, data_path=str(assets.write_jsonl(tmp_path / f"{tag}.jsonl", alpaca_rows(n, tag))),
                 map_fn=alpaca_map_fn) for tag, n in zip("ab", sizes)]


def test_concat_uses_each_source_ratio_times(tmp_path, tiny_tokenizer):
    sources = two_alpaca(tmp_path)
    sources[0]["ratio"], sources[1]["ratio"] = 1.0, 2.5
    dataset, report = unpacked(sources, tiny_tokenizer, seed=3)
    # b's 4 rows twice, plus a seeded half (2 rows, in row order) drawn after a's (whole) draw.
    rng = np.random.default_rng(3)
    rng.permutation(10)
    extra = np.sort(rng.permutation(4)[:2]).tolist()
    expected = [f"a answer {i}" for i in range(10)] + [f"b answer {i}" for i in [0, 1, 2, 3] * 2 + extra]
    assert answers(dataset, tiny_tokenizer) == expected
    assert sample_indices(4, 2.5, np.random.default_rng(0)).size == 10
    a, b = report.sources
    assert (a.used, b.used) == (10, 10) and a.realised_share == b.realised_share == 0.5
    assert (a.requested_share, b.requested_share) == (10 / 20, 10 / 20)


@pytest.mark.parametrize("stopping", ["first_exhausted", "all_exhausted"])
@pytest.mark.parametrize("probabilities", [None, [0.7, 0.3]])
def test_interleave_draws_what_datasets_interleave_draws(tmp_path, tiny_tokenizer, stopping, probabilities):
    sources = two_alpaca(tmp_path)
    dataset, report = unpacked(sources, tiny_tokenizer, mix_strategy="interleave", mix_probabilities=probabilities,
                               stopping_strategy=stopping, seed=5)
    reference = interleave_datasets([Dataset.from_dict({"t": [f"{tag} answer {i}" for i in range(n)]})
                                     for tag, n in zip("ab", (10, 4))],
                                    probabilities=probabilities, seed=5, stopping_strategy=stopping)
    assert answers(dataset, tiny_tokenizer) == reference["t"]
    used = [sum(t.startswith(tag) for t in reference["t"]) for tag in "ab"]
    assert [s.used for s in report.sources] == used
    assert [s.realised_share for s in report.sources] == [u / sum(used) for u in used]
    assert [s.requested_share for s in report.sources] == (probabilities or [0.5, 0.5])


def test_interleave_is_seeded(tmp_path, tiny_tokenizer):
    sources = two_alpaca(tmp_path, sizes=(30, 30))
    runs = [answers(unpacked(sources, tiny_tokenizer, mix_strategy="interleave", mix_probabilities=[0.5, 0.5],
                             seed=seed)[0], tiny_tokenizer) for seed in (1, 1, 2)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_interleave_realised_shares_follow_the_probabilities(tmp_path, tiny_tokenizer):
    """0.8 / 0.2 over 400 + 400 rows, first_exhausted: a's 400 run out first, after about 500 draws."""
    sources = two_alpaca(tmp_path, sizes=(400, 400))
    _, report = unpacked(sources, tiny_tokenizer, mix_strategy="interleave", mix_probabilities=[0.8, 0.2], seed=0)
    a, b = report.sources
    assert a.used == 400 and 50 < b.used < 200  # 3 standard deviations of a 0.2 share of ~500 draws: +-0.05
    assert abs(a.realised_share - 0.8) < 0.05 and a.realised_share + b.realised_share == pytest.approx(1)
    lines = source_lines(report, "interleave")
    assert lines[1].endswith(f"interleave share of samples {b.realised_share:.3f} (requested 0.200)")
    assert lines[1].startswith(f"data_sources[1] (b): 400 rows read, 400 after map/filter, 400 samples, {b.used} used, ")


def test_packing_runs_after_mixing_or_per_source(tmp_path, tiny_tokenizer):
    sources = two_alpaca(tmp_path, sizes=(10, 10))
    samples, report = unpacked(sources, tiny_tokenizer)
    together, _ = run_sources(sources, tiny_tokenizer, 128, QWEN, seed=0)
    apart, apart_report = run_sources(sources, tiny_tokenizer, 128, QWEN, seed=0, pack_per_source=True)
    every = sorted((tuple(r["input_ids"]), tuple(r["labels"])) for r in samples)
    for packed in (together, apart):  # no sample lost, split or changed
        pieces = []
        for row in packed:
            starts = np.cumsum([0] + row["sample_lengths"])
            pieces += [(tuple(row["input_ids"][s:e]), tuple(row["labels"][s:e])) for s, e in zip(starts, starts[1:])]
        assert sorted(pieces) == every
    texts = [tiny_tokenizer.decode([t for t in row["labels"] if t >= 0]) for row in together]
    assert any("a answer" in t and "b answer" in t for t in texts)  # samples of both sources share a row
    texts = [tiny_tokenizer.decode([t for t in row["labels"] if t >= 0]) for row in apart]
    assert not any("a answer" in t and "b answer" in t for t in texts)
    a_rows = sum("a answer" in t for t in texts)
    assert all("a answer" in t for t in texts[:a_rows])  # source 0's rows first
    assert apart_report.pack.samples == 20 and apart_report.pack.rows == len(apart)


# ---------------------------------------------------------------------------
# Validation from a named source's split.

def test_validation_reads_the_named_sources_split(tmp_path, tiny_tokenizer):
    folder = tmp_path / "b_splits"
    DatasetDict(train=Dataset.from_list(alpaca_rows(6, "b")), test=Dataset.from_list(alpaca_rows(3, "t"))) \
        .save_to_disk(str(folder))
    sources = [dict(name="a", data_path=str(assets.write_jsonl(tmp_path / "a.jsonl", alpaca_rows(5, "a"))),
                    map_fn=alpaca_map_fn),
               dict(name="b", data_path=str(folder), map_fn=alpaca_map_fn, slice=range(12))]
    common = dict(tokenizer=tiny_tokenizer, max_length=128, template_map_fn=QWEN, pack_to_max_length=False,
                  shuffle_before_pack=False)
    train = process_data_sources(sources, **common)
    val = process_data_sources(sources, part="val", val_source="b", val_split="test", **common)
    assert len(train) == 5 + 12
    assert answers(val, tiny_tokenizer) == ["t answer 0", "t answer 1", "t answer 2"]
    with pytest.raises(DatasetError, match=r"^val_source 'c' names no source; the sources are a, b$"):
        process_data_sources(sources, part="val", val_source="c", **common)
    with pytest.raises(DatasetError, match=r"^data_sources\[0\] \(a\): dataset has no split 'test' \(it has train\)"):
        process_data_sources(sources, part="val", val_source="a", **common)


# ---------------------------------------------------------------------------
# Bad settings: one line each, naming the key and the fix.

def test_bad_settings_are_one_line_each(files):
    good = dict(data_path=str(files["alpaca"]))
    assert sources_problems([good, good]) == [
        f"data_sources[1]: name {str(files['alpaca'])!r} is also data_sources[0]'s; give each source its own name=..."]
    assert sources_problems([dict(good, mapfn=alpaca_map_fn, slice=range(-1, 2))]) == [
        "data_sources[0]: unknown key 'mapfn'; did you mean 'map_fn'? a source takes data_path, name, subset, split, "
        "map_fn, filter_fn, slice, ratio",
        "data_sources[0].slice: expected a range or list of row indices >= 0 (e.g. range(1000)), got range(-1, 2)"]
    assert sources_problems([dict(data_path="missing/nothing.jsonl")]) == [
        "data_sources[0].data_path 'missing/nothing.jsonl': no such file or folder; set data_sources[0].data_path to "
        "your data file, a folder or a glob, or a dataset name on the hub"]
    two = [good, dict(good, name="b", ratio=2)]
    assert sources_problems(two, "interleave", [0.5, 0.4]) == [
        "data_sources[1]: ratio applies to mix_strategy='concat'; with 'interleave' set mix_probabilities (one per "
        "source)",
        "mix_probabilities [0.5, 0.4] sum to 0.9; they must sum to 1"]
    assert sources_problems(two[:1], "interleave", [0.5, 0.5]) == [
        "mix_probabilities has 2 values for 1 sources; give one per source, in the order of data_sources"]
    assert sources_problems(two, "concat", [0.5, 0.5]) == [
        "mix_probabilities apply to mix_strategy='interleave'; with 'concat' give each source a ratio, or set "
        "mix_strategy='interleave'"]
    assert sources_problems(two[:1], "shuffle") == ["mix_strategy must be one of 'concat', 'interleave', got 'shuffle'"]
    assert sources_problems(two[:1], "interleave", None, "longest") == [
        "stopping_strategy must be one of 'first_exhausted', 'all_exhausted', got 'longest'"]
    assert sources_problems([]) == ["data_sources must be a non-empty list of dict(data_path=...), one per source; "
                                    "got []"]
    assert sources_problems([dict(good, subset="en")]) == [
        "data_sources[0].subset: local files have no subsets (a hub dataset's configurations); remove subset, or "
        "point data_path at the file of the subset you want"]
    assert sources_problems([dict(good, ratio=-1)]) == [
        "data_sources[0].ratio: expected a finite number >= 0 (1.0: every row once), got -1"]
