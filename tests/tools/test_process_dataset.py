"""`sfttool process-dataset`: the saved rows are the rows training builds, sharding keeps every
sample, the manifest counts are exact, and a config trains from the saved folder."""
from __future__ import annotations

import json
from collections import Counter

import pytest
from click.testing import CliRunner

from sfttool import assets
from sfttool.cli.main import cli
from sfttool.config import load_config
from sfttool.registry import build
from sfttool.tools.process_dataset import (ProcessedDatasetError, load_processed_dataset, process_dataset,
                                           read_manifest)

CONFIG = '''
from datasets import load_dataset
from transformers import AutoTokenizer

from sfttool.dataset import process_hf_dataset
from sfttool.dataset.map_fns import template_map_fn_factory
from sfttool.utils import PROMPT_TEMPLATE

max_length = 256
tokenizer = dict(type=AutoTokenizer.from_pretrained, pretrained_model_name_or_path={tok!r})
train_dataset = dict(
    type=process_hf_dataset,
    dataset=dict(type=load_dataset, path='json', data_files={data!r}),
    tokenizer=tokenizer, max_length=max_length,
    template_map_fn=dict(type=template_map_fn_factory, template=PROMPT_TEMPLATE.qwen_chat),
    pack_to_max_length={pack}, seed=0)
train_dataloader = dict(batch_size=1, dataset=train_dataset)
'''


def write_config(tmp_path, tok_dir, data, pack=True, name="cfg.py"):
    path = tmp_path / name
    path.write_text(CONFIG.format(tok=str(tok_dir), data=str(data), pack=pack))
    return path


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return assets.write_jsonl(tmp_path_factory.mktemp("pd") / "data.jsonl", assets.tiny_conversations(300, seed=2))


def rows_of(dataset) -> list[tuple]:
    cols = ("input_ids", "labels", "position_ids", "sample_lengths")
    return [tuple(tuple(r[c]) for c in cols) for r in dataset]


def samples_of(dataset) -> Counter:
    """Whole samples (ids, labels) cut out of rows by sample_lengths."""
    out = Counter()
    for row in dataset:
        start = 0
        for n in row["sample_lengths"]:
            assert row["position_ids"][start:start + n] == list(range(n))
            out[(tuple(row["input_ids"][start:start + n]), tuple(row["labels"][start:start + n]))] += 1
            start += n
    return out


def test_saved_rows_equal_the_training_rows(tmp_path, tiny_tokenizer_dir, data_file):
    cfg = load_config(write_config(tmp_path, tiny_tokenizer_dir, data_file))
    manifest = process_dataset(cfg, tmp_path / "out")
    saved = load_processed_dataset(tmp_path / "out")
    direct = build(cfg.train_dataloader.dataset)
    assert rows_of(saved) == rows_of(direct)
    tokens = sum(len(r["input_ids"]) for r in direct)
    assert manifest["rows"] == len(direct) and manifest["tokens"] == tokens
    assert manifest["trained_tokens"] == sum(x != -100 for r in direct for x in r["labels"])
    assert manifest["packing_efficiency"] == round(tokens / (len(direct) * 256), 4)
    assert read_manifest(tmp_path / "out") == manifest
    # The fingerprint is a content hash: the same data processed again gives the same value.
    again = process_dataset(cfg, tmp_path / "out", overwrite=True)
    assert again["fingerprint"] == manifest["fingerprint"]


def test_a_lazily_encoded_config_is_processed_eagerly(tmp_path, tiny_tokenizer_dir, data_file):
    """lazy_encode is a way to train from raw rows; process-dataset encodes ahead: the same rows as the
    config without it."""
    eager = load_config(write_config(tmp_path, tiny_tokenizer_dir, data_file))
    path = write_config(tmp_path, tiny_tokenizer_dir, data_file, name="lazy.py")
    path.write_text(path.read_text().replace("seed=0)", "seed=0, lazy_encode=True, buffer_size=50)"))
    manifest = process_dataset(load_config(path), tmp_path / "out", shard_rows=1000)
    assert rows_of(load_processed_dataset(tmp_path / "out")) == rows_of(build(eager.train_dataloader.dataset))
    assert manifest["rows"] == len(build(eager.train_dataloader.dataset))


def test_shards_keep_every_sample(tmp_path, tiny_tokenizer_dir, data_file):
    cfg = load_config(write_config(tmp_path, tiny_tokenizer_dir, data_file))
    manifest = process_dataset(cfg, tmp_path / "out", shard_rows=70)
    assert [s["name"] for s in manifest["shards"]] == [f"shard-{i:05d}" for i in range(5)]
    saved = load_processed_dataset(tmp_path / "out")
    assert len(saved) == manifest["rows"] == sum(s["rows"] for s in manifest["shards"])
    assert samples_of(saved) == samples_of(build(cfg.train_dataloader.dataset))
    assert max(len(r) for r in saved["input_ids"]) <= 256


def test_unpacked_config(tmp_path, tiny_tokenizer_dir, data_file):
    cfg = load_config(write_config(tmp_path, tiny_tokenizer_dir, data_file, pack=False))
    manifest = process_dataset(cfg, tmp_path / "out", shard_rows=100)
    saved = load_processed_dataset(tmp_path / "out")
    assert manifest["pack_to_max_length"] is False
    assert all(len(n) == 1 for n in saved["sample_lengths"])
    assert samples_of(saved) == samples_of(build(cfg.train_dataloader.dataset))


def test_a_config_trains_from_the_saved_folder(tmp_path, tiny_tokenizer_dir, data_file):
    from sfttool.dataset.collate_fns import default_collate_fn

    process_dataset(load_config(write_config(tmp_path, tiny_tokenizer_dir, data_file)), tmp_path / "out")
    cfg_path = tmp_path / "train_from_disk.py"
    cfg_path.write_text(
        "from sfttool.tools.process_dataset import load_processed_dataset\n"
        f"train_dataset = dict(type=load_processed_dataset, path={str(tmp_path / 'out')!r})\n"
        "train_dataloader = dict(batch_size=2, dataset=train_dataset)\n")
    dataset = build(load_config(cfg_path).train_dataloader.dataset)
    batch = default_collate_fn([dataset[0], dataset[1]])["data"]
    assert batch["input_ids"].shape[0] == 2 and batch["input_ids"].shape == batch["labels"].shape


def test_cli_writes_and_refuses_to_overwrite(tmp_path, tiny_tokenizer_dir, data_file):
    cfg = write_config(tmp_path, tiny_tokenizer_dir, data_file)
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["process-dataset", str(cfg), "--out", str(out), "--num-proc", "2"])
    assert result.exit_code == 0, result.output
    assert "Packing efficiency" in result.output and "load_processed_dataset" in result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["num_proc"] == 2 and manifest["rows"] > 0
    again = CliRunner().invoke(cli, ["process-dataset", str(cfg), "--out", str(out)])
    assert again.exit_code == 1
    assert "Error:" in again.output and "--overwrite" in again.output and "Traceback" not in again.output


def test_clear_errors(tmp_path):
    with pytest.raises(ProcessedDatasetError, match="sfttool process-dataset"):
        load_processed_dataset(tmp_path)
    cfg_path = tmp_path / "no_dataset.py"
    cfg_path.write_text("train_dataloader = dict(batch_size=1)\n")
    result = CliRunner().invoke(cli, ["process-dataset", str(cfg_path), "--out", str(tmp_path / "o")])
    assert result.exit_code == 1 and "train_dataloader.dataset" in result.output


def test_a_bad_row_in_a_later_shard_is_named_by_file_and_row(tmp_path, tiny_tokenizer_dir):
    """Rows keep their numbers as loaded through max_dataset_length and sharding."""
    from sfttool.dataset import DatasetError
    rows = [{"instruction": f"q{i}", "output": "a"} for i in range(10)]
    rows[7]["output"] = None
    data = assets.write_jsonl(tmp_path / "alpaca.jsonl", rows)
    cfg_path = write_config(tmp_path, tiny_tokenizer_dir, data)
    text = cfg_path.read_text().replace("pack_to_max_length=True,", "pack_to_max_length=True, "
                                        "dataset_map_fn='alpaca_map_fn', max_dataset_length=9,")
    cfg_path.write_text(text)
    with pytest.raises(DatasetError, match=r"alpaca.jsonl, row 7: dataset_map_fn alpaca_map_fn failed"):
        process_dataset(load_config(cfg_path), tmp_path / "out", shard_rows=3)


def test_loading_checks_max_length_when_asked(tmp_path, tiny_tokenizer_dir, data_file):
    cfg = load_config(write_config(tmp_path, tiny_tokenizer_dir, data_file))
    process_dataset(cfg, tmp_path / "out")
    assert len(load_processed_dataset(tmp_path / "out", max_length=256)) == read_manifest(tmp_path / "out")["rows"]
    with pytest.raises(ProcessedDatasetError, match=r"processed with max_length=256, but this config asks for "
                                                    r"max_length=512"):
        load_processed_dataset(tmp_path / "out", max_length=512)


def test_train_prints_a_refused_folder_as_one_line(tmp_path, tiny_tokenizer_dir, data_file, tiny_qwen2_dir):
    cfg = load_config(write_config(tmp_path, tiny_tokenizer_dir, data_file))
    process_dataset(cfg, tmp_path / "out")
    train_cfg = tmp_path / "train.py"
    train_cfg.write_text(
        "from transformers import AutoModelForCausalLM\n"
        "from sfttool.model import SupervisedFinetune\n"
        "from sfttool.tools.process_dataset import load_processed_dataset\n"
        f"model = dict(type=SupervisedFinetune, llm=dict(type=AutoModelForCausalLM.from_pretrained, "
        f"pretrained_model_name_or_path={str(tiny_qwen2_dir)!r}))\n"
        f"train_dataloader = dict(batch_size=1, dataset=dict(type=load_processed_dataset, "
        f"path={str(tmp_path / 'out')!r}, max_length=512))\n"
        "optim_wrapper = dict(optimizer=dict(type='torch.optim.AdamW', lr=1e-4))\n"
        "train_cfg = dict(by_epoch=False, max_iters=1)\n")
    result = CliRunner().invoke(cli, ["train", str(train_cfg), "--work-dir", str(tmp_path / "w")])
    assert result.exit_code == 1
    assert result.output.strip().splitlines()[-1] == (
        f"Error: {tmp_path / 'out'}: processed with max_length=256, but this config asks for max_length=512; "
        "re-run `sfttool process-dataset` with this config")
