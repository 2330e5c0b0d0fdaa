"""Streaming packing: every sample kept whole, rows within max_length, bounded carry, seeded order."""
from __future__ import annotations

import copy
import logging
import random
from collections import Counter

import pytest
import torch

from sfttool import assets
from sfttool.dataset.errors import DatasetError
from sfttool.dataset.map_fns import template_map_fn_factory
from sfttool.dataset import streaming
from sfttool.dataset.pack import concat_samples, pack_buffer, pack_stream
from sfttool.dataset.streaming import StreamingPackedDataset
from sfttool.utils import PROMPT_TEMPLATE


def fake_samples(n: int, seed: int = 0, max_len: int = 60) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for k in range(n):
        length = rng.randint(1, max_len)
        ids = [k] * length  # the sample's id in every token: splits would show
        out.append({"input_ids": ids, "labels": [-100] + ids[1:]})
    return out


def split_rows(rows: list[dict]) -> list[tuple]:
    """Cut rows back into samples using sample_lengths; check the row invariants on the way."""
    samples = []
    for row in rows:
        n = len(row["input_ids"])
        assert len(row["labels"]) == len(row["position_ids"]) == n == sum(row["sample_lengths"])
        start = 0
        for length in row["sample_lengths"]:
            assert row["position_ids"][start:start + length] == list(range(length))
            samples.append((tuple(row["input_ids"][start:start + length]),
                            tuple(row["labels"][start:start + length])))
            start += length
    return samples


def as_keys(samples: list[dict]) -> Counter:
    return Counter((tuple(s["input_ids"]), tuple(s["labels"])) for s in samples)


def test_concat_samples_restarts_positions():
    row = concat_samples([{"input_ids": [1, 2], "labels": [-100, 2]}, {"input_ids": [3], "labels": [3]}])
    assert row == {"input_ids": [1, 2, 3], "labels": [-100, 2, 3], "position_ids": [0, 1, 0],
                   "sample_lengths": [2, 1]}


@pytest.mark.parametrize("buffer_size", [1, 7, 50, 1000])
def test_pack_stream_keeps_every_sample_whole(buffer_size):
    samples = fake_samples(300)
    rows = list(pack_stream(iter(samples), 128, buffer_size, random.Random(0)))
    assert Counter(split_rows(rows)) == as_keys(samples)
    assert all(len(r["input_ids"]) <= 128 for r in rows)
    for row in rows:  # no sample split: each segment holds one sample id only
        start = 0
        for length in row["sample_lengths"]:
            assert len(set(row["input_ids"][start:start + length])) == 1
            start += length


def test_carry_is_at_most_one_half_full_row():
    samples = fake_samples(200, seed=3)
    for size in (10, 33, 200):
        buffer = samples[:size]
        rows, carry = pack_buffer(buffer, 128, final=False)
        assert sum(len(s["input_ids"]) for s in carry) <= 64  # one row's worth at most half full
        assert all(2 * len(r["input_ids"]) > 128 for r in rows)  # everything emitted is over half full
        assert as_keys([{"input_ids": list(a), "labels": list(b)} for a, b in split_rows(rows)]) + \
            as_keys(carry) == as_keys(buffer)


def test_all_rows_but_the_last_buffer_are_over_half_full():
    samples = fake_samples(500, seed=1)
    rows = list(pack_stream(iter(samples), 128, 50, random.Random(0)))
    half_full = [r for r in rows if 2 * len(r["input_ids"]) <= 128]
    assert len(half_full) <= 1
    efficiency = sum(len(r["input_ids"]) for r in rows) / (128 * len(rows))
    assert efficiency > 0.9


def test_order_is_seeded():
    samples = fake_samples(200)
    run = lambda seed: [r["input_ids"] for r in pack_stream(iter(samples), 128, 40, random.Random(seed))]
    assert run(0) == run(0)
    assert run(0) != run(1)
    assert sorted(map(tuple, run(0))) == sorted(map(tuple, run(1)))  # same rows, other order


def test_oversized_sample_is_a_clear_error():
    with pytest.raises(DatasetError, match="max_length=8"):
        pack_buffer([{"input_ids": [1] * 9, "labels": [1] * 9}], 8, final=True)


# ------------------------------------------------------------- the dataset ----

@pytest.fixture(scope="module")
def conversations():
    return assets.tiny_conversations(120, seed=5)


def make_dataset(data, tokenizer, **kw):
    kw.setdefault("max_length", 256)
    return StreamingPackedDataset(
        data, tokenizer, template_map_fn=template_map_fn_factory(PROMPT_TEMPLATE.qwen_chat), **kw)


def reference_samples(conversations, tokenizer, max_length=256) -> Counter:
    """The samples the map-style pipeline (process_hf_dataset, unpacked) makes of the same rows."""
    from datasets import Dataset

    from sfttool.dataset import process_hf_dataset

    rows = process_hf_dataset(Dataset.from_list(conversations), tokenizer, max_length,
                              template_map_fn=template_map_fn_factory(PROMPT_TEMPLATE.qwen_chat),
                              pack_to_max_length=False, map_num_proc=1)
    return Counter((tuple(r["input_ids"]), tuple(r["labels"])) for r in rows)


def test_streaming_rows_hold_exactly_the_pipeline_samples(conversations, tiny_tokenizer):
    ds = make_dataset(conversations, tiny_tokenizer, buffer_size=32, seed=0)
    rows = list(ds)
    assert Counter(split_rows(rows)) == reference_samples(conversations, tiny_tokenizer)
    assert all(len(r["input_ids"]) <= 256 for r in rows)
    assert len(rows) < len(conversations) / 2  # it did pack
    assert all(any(x != -100 for x in r["labels"]) for r in rows)


def test_unpacked_mode_yields_one_sample_per_row(conversations, tiny_tokenizer):
    rows = list(make_dataset(conversations, tiny_tokenizer, pack_to_max_length=False))
    assert all(len(r["sample_lengths"]) == 1 for r in rows)
    assert Counter(split_rows(rows)) == reference_samples(conversations, tiny_tokenizer)


def test_seed_and_epoch_fix_the_order(conversations, tiny_tokenizer):
    ids = lambda ds: [r["input_ids"] for r in ds]
    a, b = make_dataset(conversations, tiny_tokenizer, seed=0), make_dataset(conversations, tiny_tokenizer, seed=0)
    assert ids(a) == ids(b)
    first = ids(a)
    a.set_epoch(1)
    b.set_epoch(1)
    assert ids(a) == ids(b) != first


def test_dataloader_workers_share_rows_without_overlap(conversations, tiny_tokenizer):
    from sfttool.dataset.collate_fns import default_collate_fn

    ds = make_dataset(conversations, tiny_tokenizer, buffer_size=16)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, collate_fn=lambda row: row)
    rows = list(loader)
    assert Counter(split_rows(rows)) == reference_samples(conversations, tiny_tokenizer)
    batch = default_collate_fn(rows[:4])["data"]  # rows are what the collate fn expects
    assert batch["input_ids"].shape[0] == 4


def test_hf_streaming_source(tmp_path, conversations, tiny_tokenizer):
    from datasets import load_dataset

    path = assets.write_jsonl(tmp_path / "data.jsonl", conversations)
    source = dict(type=load_dataset, path="json", data_files=str(path), split="train", streaming=True)
    rows = list(make_dataset(source, tiny_tokenizer, seed=0))
    assert Counter(split_rows(rows)) == reference_samples(conversations, tiny_tokenizer)


STREAM_CONFIG = '''
from datasets import load_dataset
from mmengine.hooks import CheckpointHook, IterTimerHook, LoggerHook, ParamSchedulerHook
from mmengine.optim import LinearLR, OptimWrapper
from torch.optim import AdamW
from transformers import AutoModelForCausalLM, AutoTokenizer

from sfttool.dataset.collate_fns import default_collate_fn
from sfttool.dataset.map_fns import template_map_fn_factory
from sfttool.dataset.streaming import StreamingPackedDataset
from sfttool.engine.hooks import DatasetInfoHook
from sfttool.engine.runner import TrainLoop
from sfttool.model import SupervisedFinetune
from sfttool.utils import PROMPT_TEMPLATE

model_dir = {model_dir!r}
tokenizer = dict(type=AutoTokenizer.from_pretrained, pretrained_model_name_or_path=model_dir)
model = dict(type=SupervisedFinetune, use_activation_checkpointing=False,
             llm=dict(type=AutoModelForCausalLM.from_pretrained, pretrained_model_name_or_path=model_dir,
                      dtype='float32'))
train_dataset = dict(
    type=StreamingPackedDataset,
    dataset=dict(type=load_dataset, path='json', data_files={data!r}, split='train', streaming=True),
    tokenizer=tokenizer, max_length=256,
    template_map_fn=dict(type=template_map_fn_factory, template=PROMPT_TEMPLATE.qwen_chat),
    buffer_size=32, seed=0, rows_per_epoch=8,
    # process_hf_dataset's own arguments, as a config switched by changing `type` still has them
    shuffle_before_pack=True, use_varlen_attn=False, map_num_proc=4, remove_unused_columns=True)
train_dataloader = dict(batch_size=2, num_workers=0, dataset=train_dataset, sampler=None,
                        collate_fn=dict(type=default_collate_fn))
optim_wrapper = dict(type=OptimWrapper, optimizer=dict(type=AdamW, lr=1e-3), clip_grad=dict(max_norm=1))
param_scheduler = [dict(type=LinearLR, start_factor=0.1, by_epoch=False, begin=0, end=2)]
train_cfg = dict(type=TrainLoop, max_iters=6)
default_hooks = dict(timer=dict(type=IterTimerHook), logger=dict(type=LoggerHook, interval=1),
                     param_scheduler=dict(type=ParamSchedulerHook),
                     checkpoint=dict(type=CheckpointHook, by_epoch=False, interval=100))
custom_hooks = [dict(type=DatasetInfoHook, tokenizer=tokenizer)]  # must not read ahead in a stream
log_processor = dict(by_epoch=False)
randomness = dict(seed=0)
'''


@pytest.mark.slow
def test_sfttool_train_runs_on_a_stream(tmp_path, tiny_llama_dir, conversations):
    import json

    from click.testing import CliRunner

    from sfttool.cli.main import cli

    data = assets.write_jsonl(tmp_path / "data.jsonl", conversations)
    cfg = tmp_path / "stream_cfg.py"
    cfg.write_text(STREAM_CONFIG.format(model_dir=str(tiny_llama_dir), data=str(data)))
    result = CliRunner().invoke(cli, ["train", str(cfg), "--work-dir", str(tmp_path / "wd")])
    assert result.exit_code == 0, result.output[-3000:]
    scalars = sorted((tmp_path / "wd").glob("*/vis_data/scalars.json"))[-1]
    losses = [json.loads(line)["loss"] for line in scalars.read_text().splitlines() if "loss" in line]
    assert len(losses) == 6 and losses[-1] < losses[0]


def test_a_stream_without_rows_per_epoch_says_how_to_fix_len(conversations, tiny_tokenizer):
    with pytest.raises(TypeError, match="rows_per_epoch"):
        len(make_dataset(conversations, tiny_tokenizer))


def test_every_row_goes_to_exactly_one_reader_numbered_as_in_the_source():
    from datasets import Dataset

    from sfttool.dataset.streaming import _shard

    rows = [{"i": i} for i in range(23)]
    readers = [(rank, 2, worker, 3) for rank in range(2) for worker in range(3)]  # 2 ranks x 3 workers
    numbered = [(n, r["i"]) for reader in readers for n, r in _shard(rows, *reader)]
    assert sorted(numbered) == [(i, i) for i in range(23)]  # the number is the index in the source
    hf = Dataset.from_list(rows).to_iterable_dataset(num_shards=4)
    per_rank = [sorted(r["i"] for _, r in _shard(hf, rank, 2, 0, 1)) for rank in range(2)]
    assert sorted(per_rank[0] + per_rank[1]) == list(range(23)) and per_rank[0] and per_rank[1]
    assert [(n, r["i"]) for n, r in _shard(hf, 0, 1, 0, 1)] == [(i, i) for i in range(23)]  # one reader


def test_stream_epochs_differ_and_resume_matches_the_uninterrupted_run(conversations, tiny_tokenizer):
    """Through the train loop's batch iterator: each epoch a new seeded order, and starting at
    iteration k gives what the uninterrupted run gave from k (rows_per_epoch = the true count)."""
    from sfttool.engine.runner import _ResumableBatches

    rows = len(list(make_dataset(conversations, tiny_tokenizer, buffer_size=16)))

    def loader():
        ds = make_dataset(conversations, tiny_tokenizer, buffer_size=16, rows_per_epoch=rows)
        return torch.utils.data.DataLoader(ds, batch_size=None, collate_fn=lambda row: row)

    full = _ResumableBatches(loader())
    run = [tuple(next(full)["input_ids"]) for _ in range(2 * rows)]
    assert run[:rows] != run[rows:] and sorted(run[:rows]) == sorted(run[rows:])
    start = rows + 3  # mid second epoch
    resumed = _ResumableBatches(loader(), start_iter=start)
    assert [tuple(next(resumed)["input_ids"]) for _ in range(rows - 3)] == run[start:]


# --------------------------------------------------------- passes and resume ----

def ids_of(rows) -> list[tuple]:
    return [tuple(r["input_ids"]) for r in rows]


def stream_loader(ds, **kw):
    return torch.utils.data.DataLoader(ds, batch_size=None, collate_fn=lambda row: row, **kw)


@pytest.fixture
def loop_log(monkeypatch):
    from sfttool.engine import runner

    logged = []
    monkeypatch.setattr(runner, "print_log", lambda message, **kw: logged.append(message))
    return logged


def test_a_resume_past_the_end_of_a_short_pass_goes_on_into_the_next(conversations, tiny_tokenizer, loop_log):
    """rows_per_epoch above the true count: the skip runs out of rows mid-way and, instead of
    stopping with a bare StopIteration, follows the stream into its next pass, as the run did."""
    from sfttool.engine.runner import _ResumableBatches

    rows = len(list(make_dataset(conversations, tiny_tokenizer, buffer_size=16)))
    loader = lambda: stream_loader(make_dataset(conversations, tiny_tokenizer, buffer_size=16,
                                                rows_per_epoch=rows + 5))
    full = _ResumableBatches(loader())
    run = ids_of(next(full) for _ in range(2 * rows))
    mismatch = (f"epoch 0 of the training data gave {rows} batches, but len(train_dataloader) is {rows + 5} "
                f"(rows_per_epoch={rows + 5}; rows_per_epoch={rows} would give {rows} batches of 1)")
    assert loop_log == [mismatch + ": epochs are counted with the length (a resume still lands on the exact "
                                   "batch: checkpoints hold the data position)"]
    loop_log.clear()
    resumed = _ResumableBatches(loader(), start_iter=rows + 2)  # epoch 0 by the length, epoch 1 of the stream
    assert (resumed.epoch, resumed.batches_into_epoch) == (1, 2)  # what the "Resuming at" line reports
    assert ids_of(next(resumed) for _ in range(rows - 2)) == run[rows + 2:]
    assert loop_log == [mismatch + f"; resuming at iteration {rows + 2}, the skip went on into epoch 1: "
                                   "a checkpoint without the data position resumes on the exact batch only when "
                                   "they agree"]


def test_a_checkpointed_data_position_resumes_exactly_whatever_the_length(conversations, tiny_tokenizer, loop_log):
    """rows_per_epoch below the true count: by the length, iteration 2 * rows_per_epoch would be the
    start of epoch 2, but the run was then still in its first pass; the position it recorded resumes
    it on the exact batch."""
    from sfttool.engine.runner import _ResumableBatches

    rows = len(list(make_dataset(conversations, tiny_tokenizer, buffer_size=16)))
    loader = lambda: stream_loader(make_dataset(conversations, tiny_tokenizer, buffer_size=16,
                                                rows_per_epoch=rows // 3))
    full = _ResumableBatches(loader())
    run, positions = [], []
    for _ in range(2 * rows):
        run.append(tuple(next(full)["input_ids"]))
        positions.append(full.data_position)
    start = 2 * (rows // 3)
    assert positions[start - 1] == (0, start)  # the first pass has not ended: epoch 0, not epoch 2
    resumed = _ResumableBatches(loader(), start_iter=start, position=positions[start - 1])
    assert ids_of(next(resumed) for _ in range(rows)) == run[start:start + rows]
    assert positions[rows + 4] == (1, 5)  # and into the second pass
    resumed = _ResumableBatches(loader(), start_iter=rows + 5, position=positions[rows + 4])
    assert ids_of(next(resumed) for _ in range(rows - 5)) == run[rows + 5:]


def test_rows_per_epoch_counts_one_ranks_rows(conversations, tiny_tokenizer, monkeypatch, loop_log):
    """On rank 0 of 2 the loader reads half the rows: set to what one rank reads, the length is
    that rank's batches and a resume is exact; set to the global count, the resume still runs."""
    from sfttool.engine.runner import _ResumableBatches

    everything = len(list(make_dataset(conversations, tiny_tokenizer, buffer_size=16)))
    monkeypatch.setattr(streaming, "_reader", lambda: (0, 2, 0, 1))
    per_rank = len(list(make_dataset(conversations, tiny_tokenizer, buffer_size=16)))
    assert per_rank < everything
    loader = lambda n: stream_loader(make_dataset(conversations, tiny_tokenizer, buffer_size=16, rows_per_epoch=n))
    assert len(loader(per_rank)) == len(list(loader(per_rank))) == per_rank
    full = _ResumableBatches(loader(per_rank))
    run = ids_of(next(full) for _ in range(3 * per_rank))
    start = per_rank + 3
    resumed = _ResumableBatches(loader(per_rank), start_iter=start)
    assert ids_of(next(resumed) for _ in range(per_rank)) == run[start:start + per_rank]
    assert loop_log == []
    resumed = _ResumableBatches(loader(everything), start_iter=start)  # the global count: no crash
    assert len(ids_of(next(resumed) for _ in range(per_rank))) == per_rank and len(loop_log) == 1


def test_a_generator_source_is_refused_with_the_fix(conversations, tiny_tokenizer):
    with pytest.raises(DatasetError) as exc:
        make_dataset((c for c in conversations), tiny_tokenizer)
    assert str(exc.value) == (
        "dataset is a one-shot iterator (generator), but a stream is read again every epoch and on resume: "
        "a source must support several passes; give a list, a datasets.IterableDataset "
        "(load_dataset(..., streaming=True)) or a config")


class _ReadOnce:
    """An iterable that is not its own iterator, yet whose rows can be read only once."""

    def __init__(self, rows):
        self.rows = iter(rows)

    def __iter__(self):
        return self.rows


@pytest.mark.parametrize("source, epoch", [(lambda rows: _ReadOnce(rows), 1), (lambda rows: [], 0)])
def test_a_pass_without_batches_is_an_error(conversations, tiny_tokenizer, source, epoch):
    from sfttool.engine.runner import _ResumableBatches

    batches = _ResumableBatches(stream_loader(make_dataset(source(conversations[:10]), tiny_tokenizer,
                                                           rows_per_epoch=100)))
    with pytest.raises(DatasetError) as exc:
        for _ in range(100):
            next(batches)
    assert str(exc.value) == (
        f"epoch {epoch} of the training data gave no batch: its dataset is empty or can be read only once "
        "(a generator); give a dataset that supports several passes")


def test_a_shuffled_hf_source_is_reshuffled_every_epoch_on_each_rank(conversations, tiny_tokenizer, monkeypatch):
    from datasets import Dataset

    def samples(rank, epoch):  # unpacked: the rows come in the source's order
        source = Dataset.from_list(conversations).to_iterable_dataset(num_shards=4).shuffle(seed=1, buffer_size=8)
        monkeypatch.setattr(streaming, "_reader", lambda: (rank, 2, 0, 1))
        ds = make_dataset(source, tiny_tokenizer, pack_to_max_length=False)
        ds.set_epoch(epoch)
        return split_rows(list(ds))

    for rank in (0, 1):
        first, second = samples(rank, 0), samples(rank, 1)
        assert first != second and sorted(first) == sorted(second)
        assert samples(rank, 1) == second  # reproducible
    assert Counter(samples(0, 1) + samples(1, 1)) == reference_samples(conversations, tiny_tokenizer)


def test_persistent_workers_see_every_epoch(conversations, tiny_tokenizer):
    """A persistent worker keeps its copy of the dataset across passes; the epoch still reaches it."""
    from sfttool.engine.runner import _ResumableBatches

    rows = len(list(make_dataset(conversations[:60], tiny_tokenizer, buffer_size=16)))

    def epochs(**kw):
        ds = make_dataset(conversations[:60], tiny_tokenizer, buffer_size=16, rows_per_epoch=rows)
        batches = _ResumableBatches(stream_loader(ds, **kw))
        return [ids_of(next(batches) for _ in range(rows)) for _ in range(3)]

    persistent = epochs(num_workers=1, persistent_workers=True)
    assert persistent[0] != persistent[1] and persistent[1] != persistent[2]
    assert persistent == epochs()  # the orders the main process reads itself


# ------------------------------------------------------------- bad rows ----

BAD_OUTPUT = ("row 137, field 'conversation[0].output': expected a string, got an int; fix the data or the "
              "dataset_map_fn so every turn's `system`, `input` and `output` are strings")


@pytest.fixture(scope="module")
def bad_rows():
    rows = copy.deepcopy(assets.tiny_conversations(200, seed=5))
    rows[137]["conversation"][0]["output"] = 12345
    return rows


@pytest.mark.parametrize("template", [True, False])
@pytest.mark.parametrize("reader", [(0, 1, 0, 1), (0, 2, 1, 2), (2, 3, 1, 2)])
def test_a_bad_row_is_numbered_as_in_the_source_whatever_reads_it(bad_rows, tiny_tokenizer, monkeypatch,
                                                                  reader, template):
    rank, world, worker, workers = reader
    assert 137 % (world * workers) == rank * workers + worker  # this reader gets the bad row
    monkeypatch.setattr(streaming, "_reader", lambda: reader)
    ds = (make_dataset(bad_rows, tiny_tokenizer) if template
          else StreamingPackedDataset(bad_rows, tiny_tokenizer, max_length=256))
    with pytest.raises(DatasetError) as exc:
        list(ds)
    assert str(exc.value) == BAD_OUTPUT


def test_a_bad_row_read_by_a_dataloader_worker_keeps_its_number(bad_rows, tiny_tokenizer):
    with pytest.raises(DatasetError) as exc:
        list(stream_loader(make_dataset(bad_rows, tiny_tokenizer), num_workers=2))
    assert str(exc.value).splitlines()[-1] == f"sfttool.dataset.errors.DatasetError: {BAD_OUTPUT}"


def test_a_bad_row_of_a_streamed_file_names_the_file(tmp_path, bad_rows, tiny_tokenizer):
    from datasets import load_dataset

    from sfttool.registry import build

    path = assets.write_jsonl(tmp_path / "bad.jsonl", bad_rows)
    ds = build(dict(type=StreamingPackedDataset, tokenizer=tiny_tokenizer, max_length=256,
                    dataset=dict(type=load_dataset, path="json", data_files=str(path), split="train", streaming=True),
                    template_map_fn=template_map_fn_factory(PROMPT_TEMPLATE.qwen_chat)))
    with pytest.raises(DatasetError) as exc:
        list(ds)
    assert str(exc.value) == f"{path}, {BAD_OUTPUT}"


def test_a_bad_row_of_a_hf_stream_split_by_datasets_counts_in_the_readers_share(bad_rows, tiny_tokenizer,
                                                                                 monkeypatch):
    """datasets gives rank 1 of 2 the second of two shards, rows 100..199: row 137 is its 37th."""
    from datasets import Dataset

    rows = copy.deepcopy(bad_rows)
    rows[137]["conversation"][0]["output"] = None  # Arrow takes a null, not an int among strings
    monkeypatch.setattr(streaming, "_reader", lambda: (1, 2, 0, 1))
    ds = make_dataset(Dataset.from_list(rows).to_iterable_dataset(num_shards=2), tiny_tokenizer, source="data.jsonl")
    with pytest.raises(DatasetError) as exc:
        list(ds)
    assert str(exc.value) == (
        "data.jsonl, the rows read by rank 1, row 37, field 'conversation[0].output': expected a string, got "
        "missing; fix the data or the dataset_map_fn so every turn's `system`, `input` and `output` are strings")


def qa_map_fn(row):
    return {"conversation": [{"input": row["q"], "output": row["a"]}]}


def text_map_fn(row):
    return {"text": row["q"]}


def failing_template(row):
    raise RuntimeError("no template for this row")


@pytest.mark.parametrize("rows, kwargs, message", [
    ([{"q": "hi", "a": "yo"}, {"q": "hi"}], dict(dataset_map_fn=qa_map_fn),
     "qa.jsonl, row 1: dataset_map_fn qa_map_fn failed: KeyError: 'a'"),
    ([{"instruction": "x", "output": "y"}], {},
     "qa.jsonl, row 0: no `conversation` (fields: instruction, output); data that is not in the standard format "
     "needs a dataset_map_fn (set dataset_map_fn=alpaca_map_fn)"),
    ([{"text": "x"}], {}, "qa.jsonl, row 0: no `conversation` (fields: text); data that is not in the standard "
                          "format needs a dataset_map_fn (e.g. alpaca_map_fn, sharegpt_map_fn)"),
    ([{"q": "hi"}], dict(dataset_map_fn=text_map_fn),
     "qa.jsonl, row 0: no `conversation` after dataset_map_fn text_map_fn (fields: q, text); it must return "
     "{'conversation': [{'input': ..., 'output': ...}]}"),
    ([{"conversation": [{"input": "hi", "output": "yo"}]}], dict(template_map_fn=failing_template),
     "qa.jsonl, row 0: template_map_fn failing_template failed: RuntimeError: no template for this row"),
    ([["hi", "yo"]], {}, "qa.jsonl, row 0: expected a dict (one JSON object per row), got list"),
])
def test_a_row_that_fails_a_stage_names_the_row_and_the_stage(tiny_tokenizer, rows, kwargs, message):
    ds = StreamingPackedDataset(rows, tiny_tokenizer, max_length=256, source="qa.jsonl", **kwargs)
    with pytest.raises(DatasetError) as exc:
        list(ds)
    assert str(exc.value) == message


def test_each_pass_logs_what_it_dropped_and_cut_as_the_pipeline_counts_it(conversations, tiny_tokenizer,
                                                                         monkeypatch):
    from datasets import Dataset

    from sfttool.dataset.pipeline import run_pipeline

    logged = []
    monkeypatch.setattr(streaming, "log", lambda message, level=logging.INFO: logged.append((level, message)))
    rows = copy.deepcopy(conversations[:20])
    rows[3]["conversation"] = []
    rows[5]["conversation"] = [{"input": "hi", "output": "yo", "output_with_loss": False}]
    rows[7]["conversation"][0]["output"] = " ".join(["word"] * 400)  # cut at max_length
    ds = make_dataset(rows, tiny_tokenizer)
    for epoch in (0, 1):
        ds.set_epoch(epoch)
        out = list(ds)
        s = ds.pass_stats
        assert (s.rows_in, s.samples, s.rows_out, s.tokens) == (20, 18, len(out), sum(len(r["input_ids"]) for r in out))
        assert logged[4 * epoch:] == [
            (logging.INFO, f"Stream epoch {epoch}: 20 rows in, 18 samples in {len(out)} rows out, {s.tokens} tokens"),
            (logging.WARNING, f"Stream epoch {epoch}: dropped 1 rows: empty conversation (row 3)"),
            (logging.WARNING, f"Stream epoch {epoch}: dropped 1 rows: answer masked away (output_with_loss=False "
                              "on every turn) (row 5)"),
            (logging.WARNING, f"Stream epoch {epoch}: truncated 1 samples at max_length=256 "
                              f"({s.tokens_cut} tokens cut)")]
    _, report = run_pipeline(Dataset.from_list(rows), tiny_tokenizer, 256, pack_to_max_length=False, map_num_proc=1,
                             template_map_fn=template_map_fn_factory(PROMPT_TEMPLATE.qwen_chat))
    assert (report.dropped, report.drop_examples, report.truncated, report.tokens_cut) == (
        s.dropped, s.drop_examples, s.truncated, s.tokens_cut)


# ------------------------------------------------- process_hf_dataset's arguments ----

def test_every_process_hf_dataset_argument_is_taken():
    import inspect

    from sfttool.dataset import process_hf_dataset

    pipeline = set(inspect.signature(process_hf_dataset).parameters)
    assert pipeline <= set(inspect.signature(StreamingPackedDataset).parameters)


def test_arguments_without_a_streaming_meaning_are_ignored_with_one_warning(conversations, tiny_tokenizer,
                                                                            monkeypatch):
    logged = []
    monkeypatch.setattr(streaming, "log", lambda message, level=logging.INFO: logged.append((level, message)))
    ds = make_dataset(conversations, tiny_tokenizer, map_num_proc=4, remove_unused_columns=True, cache_dir="cache",
                      use_varlen_attn=True, pack_strategy="bfd", shuffle_before_pack=True, split="train",
                      max_dataset_length=None, rename_maps=[], with_image_token=False, do_dataset_tokenization=True)
    assert logged == [(logging.WARNING, (
        "StreamingPackedDataset: ignoring what does not apply to streaming: map_num_proc (rows are encoded as "
        "they are read, in the dataloader workers (num_workers)); remove_unused_columns (streamed rows hold only "
        "input_ids, labels, position_ids and sample_lengths); cache_dir (a stream is encoded anew every pass, "
        "nothing is cached)"))]
    assert Counter(split_rows(list(ds))) == reference_samples(conversations, tiny_tokenizer)


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_dataset_length=10), "max_dataset_length (a seeded random subset of a dataset of known length) is "
                                  "not available when streaming; remove it, or stream a smaller source"),
    (dict(pack_strategy="concat"), "pack_strategy='concat' (XTuner's cut, which splits samples across rows) is "
                                   "not available when streaming: rows are packed best-fit-decreasing within a "
                                   "buffer and no sample is split; remove pack_strategy, or use process_hf_dataset"),
    (dict(pack_strategy="ffd"), "pack_strategy must be 'bfd' when streaming, got 'ffd'"),
    (dict(rename_maps=[("text", "conversation")]),
     "rename_maps is not available when streaming; rename the fields in a dataset_map_fn"),
    (dict(do_dataset_tokenization=False), "do_dataset_tokenization=False (pre-tokenized rows) is not available "
                                          "when streaming; use process_hf_dataset or sfttool process-dataset"),
    (dict(with_image_token=True), "with_image_token (XTuner's LLaVA encoding) is not supported: image rows go "
                                  "through the model's processor here; set processor=... instead (docs/multimodal.md)"),
    (dict(use_varlen_attn=True, pack_to_max_length=False),
     "use_varlen_attn=True needs pack_to_max_length=True (as in XTuner)"),
    (dict(rows_per_epoch=0),
     "rows_per_epoch must be a positive integer (the packed rows one rank reads per pass), got 0"),
    (dict(buffer_size=0), "buffer_size must be a positive integer, got 0"),
    (dict(max_length="2048"), "max_length must be a positive integer, got '2048'"),
])
def test_settings_a_stream_cannot_honour_are_refused(conversations, tiny_tokenizer, kwargs, message):
    with pytest.raises(DatasetError) as exc:
        make_dataset(conversations, tiny_tokenizer, **kwargs)
    assert str(exc.value) == message


def test_shuffle_before_pack_false_keeps_the_packing_order(conversations, tiny_tokenizer):
    ds = make_dataset(conversations, tiny_tokenizer, buffer_size=16, shuffle_before_pack=False)
    first = ids_of(ds)
    ds.set_epoch(1)
    assert ids_of(ds) == first
    samples = [{"input_ids": r["input_ids"], "labels": r["labels"]}
               for r in make_dataset(conversations, tiny_tokenizer, pack_to_max_length=False)]
    assert first == ids_of(pack_stream(iter(samples), 256, 16, None))
    assert first != ids_of(make_dataset(conversations, tiny_tokenizer, buffer_size=16))


def test_a_dict_of_splits_gives_the_split_asked_for(tmp_path, conversations, tiny_tokenizer):
    from datasets import Dataset, load_dataset

    path = assets.write_jsonl(tmp_path / "data.jsonl", conversations)
    source = dict(type=load_dataset, path="json", data_files=str(path), streaming=True)  # a dict of splits
    reference = reference_samples(conversations, tiny_tokenizer)
    assert Counter(split_rows(list(make_dataset(source, tiny_tokenizer)))) == reference
    assert Counter(split_rows(list(make_dataset(Dataset.from_list(conversations), tiny_tokenizer)))) == reference
    with pytest.raises(DatasetError) as exc:
        make_dataset(source, tiny_tokenizer, split="validation")
    assert str(exc.value) == "dataset has no split 'validation' (it has train); set split=..."


def test_a_row_the_map_fn_empties_is_dropped_under_the_cause_the_pipeline_names(tiny_tokenizer):
    """The stream, the map-style pipeline and check-custom-dataset name one cause, in the same words."""
    from sfttool.dataset.pipeline import run_pipeline
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    rows = [{"messages": chat}, {"messages": [{"role": "assistant", "content": "Hi!"}]}, {"messages": chat}]
    stream = make_dataset(rows, tiny_tokenizer, dataset_map_fn="openai_map_fn")
    list(stream)
    cause = ("empty conversation after dataset_map_fn: conversation starts with an assistant message (dropped: "
             "nothing asked it)")
    assert stream.pass_stats.dropped == {cause: 1} and stream.pass_stats.drop_examples == {cause: ["row 1"]}
    assert stream.pass_stats.emptied == {}  # kept only until the row is dropped
    from datasets import Dataset
    _, report = run_pipeline(Dataset.from_list(rows), tiny_tokenizer, 64, dataset_map_fn="openai_map_fn",
                             template_map_fn=template_map_fn_factory("qwen_chat"))
    assert report.dropped == stream.pass_stats.dropped and report.drop_examples == stream.pass_stats.drop_examples
