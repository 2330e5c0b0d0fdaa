"""Streaming packing: every sample kept whole, rows within max_length, bounded carry, seeded order."""
from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from sfttool import assets
from sfttool.dataset.errors import DatasetError
from sfttool.dataset.map_fns import template_map_fn_factory
from sfttool.dataset.streaming import StreamingPackedDataset, concat_samples, pack_buffer, pack_stream
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


def make_dataset(source, tokenizer, **kw):
    kw.setdefault("max_length", 256)
    return StreamingPackedDataset(
        source, tokenizer, template_map_fn=template_map_fn_factory(PROMPT_TEMPLATE.qwen_chat), **kw)


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
    buffer_size=32, seed=0, rows_per_epoch=8)
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


def test_every_row_goes_to_exactly_one_reader():
    from datasets import Dataset

    from sfttool.dataset.streaming import _shard

    rows = [{"i": i} for i in range(23)]
    readers = [(rank, 2, worker, 3) for rank in range(2) for worker in range(3)]  # 2 ranks x 3 workers
    seen = sorted(r["i"] for reader in readers for r in _shard(rows, *reader))
    assert seen == list(range(23))
    hf = Dataset.from_list(rows).to_iterable_dataset(num_shards=4)
    per_rank = [sorted(r["i"] for r in _shard(hf, rank, 2, 0, 1)) for rank in range(2)]
    assert sorted(per_rank[0] + per_rank[1]) == list(range(23)) and per_rank[0] and per_rank[1]


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
