"""Lazy encoding (process_hf_dataset(lazy_encode=True)): the eager pipeline's rows and drops, a row at a
time in a seeded order, every row read once per epoch by exactly one reader, exact resume."""
from __future__ import annotations

import logging
import sys
from collections import Counter
from pathlib import Path

import pytest
from datasets import Dataset

from sfttool import assets
from sfttool.dataset import lazy, process_hf_dataset, streaming
from sfttool.dataset.errors import DatasetError
from sfttool.dataset.lazy import LazyEncodedDataset
from sfttool.dataset.map_fns import alpaca_map_fn, template_map_fn_factory
from sfttool.dataset.pipeline import run_pipeline
from sfttool.dataset.report import warning_lines
from sfttool.utils import PROMPT_TEMPLATE

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_streaming import ids_of, split_rows, stream_loader  # noqa: E402

MAX_LENGTH = 96


@pytest.fixture(scope="module")
def rows():
    """40 conversations, four of which a stage drops or cuts, in the eager pipeline's words."""
    rows = assets.tiny_conversations(40, seed=11)
    rows[3]["conversation"] = []                                                    # empty conversation
    rows[5]["conversation"] = [{"input": "hi", "output": "yo", "output_with_loss": False}]  # nothing trained
    rows[9]["conversation"] = [{"input": "hello " * 120, "output": "a"}]             # prompt over max_length
    rows[12]["conversation"][0]["output"] = " ".join(["word"] * 150)                # cut at max_length
    return rows


def template():
    return template_map_fn_factory(PROMPT_TEMPLATE.qwen_chat)


def build(data, tokenizer, **kw):
    kw.setdefault("max_length", MAX_LENGTH)
    return process_hf_dataset(Dataset.from_list(data), tokenizer, template_map_fn=template(), lazy_encode=True,
                              **kw)


def eager(data, tokenizer, **kw):
    """The eager pipeline's rows (one sample each, in row order) and report."""
    kw.setdefault("max_length", MAX_LENGTH)
    return run_pipeline(Dataset.from_list(data), tokenizer, template_map_fn=template(), pack_to_max_length=False,
                        map_num_proc=1, **kw)


def pairs(rows) -> list[tuple]:
    return [(tuple(r["input_ids"]), tuple(r["labels"])) for r in rows]


def same_counts(stats, report) -> None:
    assert (stats.dropped, stats.drop_examples, stats.truncated, stats.tokens_cut, stats.changed) == (
        report.dropped, report.drop_examples, report.truncated, report.tokens_cut, report.changed)


# ------------------------------------------------------- the eager pipeline's rows ----

def test_each_row_is_the_eager_pipelines_row_with_the_same_drops(rows, tiny_tokenizer):
    """In file order (shuffle_before_pack=False), unpacked: row for row the eager rows, drops and cuts."""
    expected, report = eager(rows, tiny_tokenizer)
    ds = build(rows, tiny_tokenizer, pack_to_max_length=False, shuffle_before_pack=False)
    assert isinstance(ds, LazyEncodedDataset) and len(ds) == 40  # the rows one rank reads
    got = list(ds)
    assert pairs(got) == pairs(expected) and len(got) == 37
    assert all(r["position_ids"] == list(range(len(r["input_ids"]))) for r in got)
    same_counts(ds.pass_stats, report)
    assert set(report.dropped) == {"empty conversation", "answer masked away (output_with_loss=False on every turn)",
                                   f"prompt longer than max_length={MAX_LENGTH} (the answer was cut away)"}


def test_a_dataset_map_fn_runs_per_row_as_the_eager_stage_runs_it(tiny_tokenizer):
    raw = [{"instruction": f"say {k}", "input": "" if k % 3 else "now", "output": f"{k} " * (k % 7 + 1)}
           for k in range(30)]
    raw[4]["instruction"] = "hello " * 120  # the prompt leaves no room for the answer: dropped by cause
    expected, report = eager(raw, tiny_tokenizer, dataset_map_fn=alpaca_map_fn)
    ds = build(raw, tiny_tokenizer, dataset_map_fn=alpaca_map_fn, pack_to_max_length=False, shuffle_before_pack=False)
    assert pairs(ds) == pairs(expected)
    same_counts(ds.pass_stats, report)
    assert sum(report.dropped.values()) == 1


def test_packed_rows_hold_exactly_the_eager_samples(rows, tiny_tokenizer):
    expected, report = eager(rows, tiny_tokenizer)
    ds = build(rows, tiny_tokenizer, buffer_size=8, seed=3)
    got = list(ds)
    assert Counter(split_rows(got)) == Counter(pairs(expected))
    assert all(len(r["input_ids"]) <= MAX_LENGTH for r in got) and len(got) < len(expected)
    assert sum(2 * len(r["input_ids"]) <= MAX_LENGTH for r in got) <= 1 + len(rows) // 8  # one carry per buffer
    same_counts(ds.pass_stats, report)


def test_max_dataset_length_keeps_the_eager_subset(rows, tiny_tokenizer):
    expected, report = eager(rows, tiny_tokenizer, max_dataset_length=15, seed=4)
    ds = build(rows, tiny_tokenizer, max_dataset_length=15, seed=4, pack_to_max_length=False,
               shuffle_before_pack=False)
    assert len(ds) == 15 and pairs(ds) == pairs(expected)


# ---------------------------------------------------------------- order and readers ----

def test_each_epoch_reads_every_row_once_in_an_order_the_seed_fixes(rows, tiny_tokenizer):
    def epoch(seed, e):
        ds = build(rows, tiny_tokenizer, pack_to_max_length=False, seed=seed)
        ds.set_epoch(e)
        return pairs(ds)

    first = epoch(0, 0)
    assert first == epoch(0, 0) and Counter(first) == Counter(pairs(eager(rows, tiny_tokenizer)[0]))
    for other in (epoch(0, 1), epoch(1, 0)):
        assert other != first and Counter(other) == Counter(first)


def test_ranks_and_workers_share_the_rows_without_overlap(rows, tiny_tokenizer, monkeypatch):
    """2 ranks x 3 dataloader workers: each reads its own rows; together, every row once. A rank's
    length is its share whatever its workers."""
    shares = []
    for rank in range(2):
        for worker in range(3):
            monkeypatch.setattr(streaming, "_reader", lambda r=rank, w=worker: (r, 2, w, 3))
            monkeypatch.setattr(lazy, "_reader", lambda r=rank, w=worker: (r, 2, w, 3))
            ds = build(rows, tiny_tokenizer, pack_to_max_length=False)
            assert len(ds) == 20
            shares.append(pairs(ds))
    assert Counter(p for share in shares for p in share) == Counter(pairs(eager(rows, tiny_tokenizer)[0]))


def test_two_dataloader_workers_encode_every_row_once(rows, tiny_tokenizer):
    ds = build(rows, tiny_tokenizer, pack_to_max_length=False)
    got = list(stream_loader(ds, num_workers=2))
    assert Counter(pairs(got)) == Counter(pairs(eager(rows, tiny_tokenizer)[0]))


# --------------------------------------------------------------- drops and resume ----

def test_each_epoch_logs_what_it_dropped_in_the_eager_pipelines_words(rows, tiny_tokenizer, monkeypatch):
    _, report = eager(rows, tiny_tokenizer)
    logged = []
    monkeypatch.setattr(streaming, "log", lambda message, level=logging.INFO: logged.append((level, message)))
    ds = build(rows, tiny_tokenizer, pack_to_max_length=False, shuffle_before_pack=False)  # causes met in file order
    for epoch in (0, 1):
        ds.set_epoch(epoch)
        out = list(ds)
        tokens = sum(len(r["input_ids"]) for r in out)
        assert logged[5 * epoch:] == [
            (logging.INFO, f"Lazy epoch {epoch}: 40 rows in, 37 samples in 37 rows out, {tokens} tokens"),
            *[(logging.WARNING, f"Lazy epoch {epoch}: {line}") for line in warning_lines(report, MAX_LENGTH)]]
        assert logged[1 + 5 * epoch] == (logging.WARNING, f"Lazy epoch {epoch}: dropped 1 rows: empty conversation "
                                                          "(row 3)")


@pytest.mark.parametrize("pack", [False, True])
def test_a_resume_from_the_checkpointed_position_gives_the_uninterrupted_batches(rows, tiny_tokenizer, pack):
    """Unpacked, a pass gives 37 of the 40 rows its length counts (3 dropped); packed, the length is an
    estimate. Resumed from the position the run recorded, mid-epoch and past the first epoch, the batches
    are the uninterrupted run's."""
    from sfttool.engine.runner import _ResumableBatches

    loader = lambda: stream_loader(build(rows, tiny_tokenizer, pack_to_max_length=pack, buffer_size=8))
    full = _ResumableBatches(loader())
    run, positions = [], []
    for _ in range(90):
        run.append(tuple(next(full)["input_ids"]))
        positions.append(full.data_position)
    per_pass = positions.index((1, 1))  # the batches of epoch 0
    assert per_pass == (37 if pack is False else len(list(build(rows, tiny_tokenizer, buffer_size=8))))
    for start in (5, per_pass + 3, 2 * per_pass + 1):
        resumed = _ResumableBatches(loader(), start_iter=start, position=positions[start - 1])
        assert ids_of(next(resumed) for _ in range(90 - start)) == run[start:]


# ------------------------------------------------------------------------- settings ----

@pytest.mark.parametrize("kwargs, message", [
    (dict(lazy_encode=False, buffer_size=100), "buffer_size only applies with lazy_encode=True (rows encoded as "
                                               "the loader reads them); set lazy_encode=True, or remove it"),
    (dict(rename_maps=[("text", "conversation")]), "rename_maps is not available with lazy_encode=True; rename the "
                                                   "fields in a dataset_map_fn"),
    (dict(pack_strategy="concat"), "pack_strategy='concat' is not available with lazy_encode=True: rows are packed "
                                   "best-fit-decreasing within a buffer (buffer_size) and no sample is split; remove "
                                   "pack_strategy"),
    (dict(do_dataset_tokenization=False), "do_dataset_tokenization=False (pre-tokenized rows) leaves nothing to "
                                          "encode lazily; remove lazy_encode"),
    (dict(buffer_size=0), "buffer_size must be a positive integer, got 0"),
])
def test_settings_lazy_encoding_cannot_honour_are_refused(rows, tiny_tokenizer, kwargs, message):
    kwargs = {"lazy_encode": True, **kwargs}
    with pytest.raises(DatasetError) as exc:
        process_hf_dataset(Dataset.from_list(rows), tiny_tokenizer, MAX_LENGTH, template_map_fn=template(), **kwargs)
    assert str(exc.value) == message


def test_settings_without_a_lazy_meaning_are_ignored_with_one_warning(rows, tiny_tokenizer, monkeypatch):
    logged = []
    monkeypatch.setattr(lazy, "log", lambda message, level=logging.INFO: logged.append((level, message)))
    ds = build(rows[:8], tiny_tokenizer, map_num_proc=4, cache_dir="cache", pack_to_max_length=False)
    assert logged == [(logging.WARNING, "lazy_encode: ignoring what does not apply to lazy encoding: map_num_proc "
                                        "(rows are encoded as they are read, in the dataloader workers "
                                        "(num_workers)); cache_dir (nothing is encoded ahead to cache)")]
    assert len(list(ds)) == 6


def test_the_packed_length_is_estimated_from_the_first_rows_or_taken_from_rows_per_epoch(rows, tiny_tokenizer):
    whole = build(rows, tiny_tokenizer, buffer_size=1000)  # the estimate packs all 40 rows: the exact count
    assert len(whole) == len(list(whole))
    assert len(build(rows, tiny_tokenizer, rows_per_epoch=7)) == 7


def test_a_pipeline_argument_lazy_encoding_does_not_know_is_refused_not_ignored(rows, tiny_tokenizer):
    """An argument process_hf_dataset gains later reaches lazy encoding in ``args``: set, it is an error."""
    from sfttool.dataset.lazy import PIPELINE_ARGS, lazy_dataset

    args = dict.fromkeys(PIPELINE_ARGS, None) | dict(rename_maps=[], do_dataset_tokenization=True,
                                                     pack_strategy="bfd", image_folder="images")
    with pytest.raises(DatasetError, match="^image_folder: not available with lazy_encode=True; remove lazy_encode$"):
        lazy_dataset(args, True, None, None, None, False, None)


def test_a_bad_line_or_row_of_a_json_file_is_one_line_naming_it(tmp_path, tiny_tokenizer):
    """Local JSON is not checked line by line before training (a pass over the file in every process): a
    line Arrow cannot read is named when the file is converted, a bad row when it is read."""
    import json

    from datasets import load_dataset

    rows = assets.tiny_conversations(6)
    lines = [json.dumps(r) for r in rows]
    (tmp_path / "cut.jsonl").write_text("\n".join(lines[:3] + [lines[3][:-5]] + lines[4:]) + "\n")
    rows[4]["conversation"][0]["input"] = 5
    assets.write_jsonl(tmp_path / "typed.jsonl", rows)

    def read(name):
        data = dict(type=load_dataset, path="json", data_files=str(tmp_path / name))
        with pytest.raises(DatasetError) as exc:
            list(process_hf_dataset(data, tiny_tokenizer, MAX_LENGTH, template_map_fn=template(), lazy_encode=True,
                                    pack_to_max_length=False))
        return str(exc.value)

    assert read("cut.jsonl").startswith(f"{tmp_path / 'cut.jsonl'}, line 4: invalid JSON: the line ends before its "
                                        "last object, array or string is closed")
    assert read("typed.jsonl") == (f"{tmp_path / 'typed.jsonl'}, row 4, field 'conversation[0].input': expected a "
                                   "string, got an int; fix the data or the dataset_map_fn so every turn's `system`, "
                                   "`input` and `output` are strings")


def test_image_rows_are_refused_not_read_as_text(rows, tiny_tokenizer):
    with_images = [{**row, "images": ["a.png"]} for row in rows[:4]]
    with pytest.raises(DatasetError, match=r"^qa\.jsonl: rows with images \(a 'images' column\) are not encoded "
                                           r"lazily; remove lazy_encode$"):
        build(with_images, tiny_tokenizer, source="qa.jsonl")
