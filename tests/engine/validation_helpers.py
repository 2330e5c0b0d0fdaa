"""Validation runs for the tests: sfttool's ValLoop on a tiny model, and a plain reference."""
from __future__ import annotations

import functools
import itertools
import json
import os
from pathlib import Path

import torch
from mmengine.hooks import Hook

_names = itertools.count()


def tiny_model(model_dir):
    from sfttool.model import SupervisedFinetune

    return SupervisedFinetune(llm=dict(type="transformers.AutoModelForCausalLM.from_pretrained",
                                       pretrained_model_name_or_path=str(model_dir), dtype="float32"),
                              use_activation_checkpointing=False)


def val_rows(model_dir, data_file, pack: bool, rows: int | None = None):
    from datasets import load_dataset

    from sfttool.dataset import process_hf_dataset
    from sfttool.dataset.map_fns import template_map_fn_factory
    from sfttool.utils import PROMPT_TEMPLATE

    dataset = process_hf_dataset(
        dataset=dict(type=load_dataset, path="json", data_files=str(data_file)),
        tokenizer=dict(type="transformers.AutoTokenizer.from_pretrained", pretrained_model_name_or_path=str(model_dir)),
        max_length=128, template_map_fn=dict(type=template_map_fn_factory, template=PROMPT_TEMPLATE.qwen_chat),
        pack_to_max_length=pack, map_num_proc=1, seed=3)
    return dataset.select(range(rows)) if rows is not None else dataset


def run_validation(model, dataset, work_dir, batch_size: int) -> dict:
    """``Runner.val()`` with sfttool's ValLoop and ValLossMetric: the metrics dict."""
    from mmengine.dataset import DefaultSampler
    from mmengine.runner import Runner

    from sfttool.dataset.collate_fns import default_collate_fn
    from sfttool.engine.validation import ValLoop, ValLossMetric

    runner = Runner(model=model, work_dir=str(work_dir), experiment_name=f"val_{os.getpid()}_{next(_names)}",
                    val_dataloader=dict(batch_size=batch_size, num_workers=0, dataset=dataset,
                                        sampler=dict(type=DefaultSampler, shuffle=False),
                                        collate_fn=functools.partial(default_collate_fn)),
                    val_cfg=dict(type=ValLoop), val_evaluator=dict(type=ValLossMetric),
                    default_hooks=dict(logger=None, checkpoint=None), log_level="WARNING")
    return runner.val()


def reference_loss(model, unpacked) -> float:
    """The mean next-token cross-entropy over every trained token, one sample at a time, straight
    from the HF model's logits."""
    total, tokens = 0.0, 0
    with torch.no_grad():
        for row in unpacked:
            ids = torch.tensor(row["input_ids"])[None]
            labels = torch.tensor(row["labels"])
            logits = model.llm(input_ids=ids).logits[0]  # [seq, vocab]
            trained = labels[1:] != -100
            loss = torch.nn.functional.cross_entropy(logits[:-1][trained].double(), labels[1:][trained],
                                                     reduction="sum")
            total += loss.item()
            tokens += int(trained.sum())
    return total / tokens


def two_process_worker(rank: int, model_dir: str, data_file: str, work_dir: str, rows: int, port: int) -> None:
    """One of two gloo processes: validate ``rows`` packed rows, rank 0 writes the metrics."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        model = tiny_model(model_dir)
        metrics = run_validation(model, val_rows(model_dir, data_file, pack=True, rows=rows), work_dir, 1)
        if rank == 0:
            Path(work_dir, "metrics.json").write_text(json.dumps(metrics))
    finally:
        dist.destroy_process_group()


# What a config adds for validation (the built-in configs' PART 1/3/5 lines, on the test config).
VALIDATION = '''
from sfttool.dataset.split import validation_split
from sfttool.engine.hooks import EarlyStoppingHook
from sfttool.engine.validation import ValLoop, ValLossMetric

val_data_path = None
val_ratio = 0.1
val_interval = {val_interval}
early_stopping_patience = {patience}
early_stopping_min_delta = 1e-6  # a plateau: changes below this do not count

raw_dataset = dict(type=load_dataset, path='json', data_files=data_file)
train_dataset['dataset'] = dict(type=validation_split, dataset=raw_dataset, part='train', val_ratio=val_ratio,
                                val_data_path=val_data_path, seed=seed)
val_dataloader = dict(
    batch_size=batch_size, num_workers=0,
    dataset=dict(train_dataset, dataset=dict(train_dataset['dataset'], part='val')),
    sampler=dict(type=DefaultSampler, shuffle=False),
    collate_fn=dict(type=default_collate_fn))
val_cfg = dict(type=ValLoop)
val_evaluator = dict(type=ValLossMetric)
train_cfg = dict(type=TrainLoop, max_epochs=max_epochs, val_interval=val_interval * accumulative_counts)
custom_hooks = custom_hooks + [dict(type=EarlyStoppingHook, patience=early_stopping_patience,
                                    min_delta=early_stopping_min_delta)]
default_hooks['checkpoint'].update(save_best='val/loss', rule='less')
'''


def validation_config(tiny_config, name="val.py", val_interval=2, patience=None, extra="", **overrides):
    """The engine tests' tiny config with validation (1 epoch, no accumulation), and ``extra`` lines."""
    path = tiny_config(name, accumulative_counts=1, max_epochs=1, **overrides)
    path.write_text(path.read_text() + VALIDATION.format(val_interval=val_interval, patience=patience) + extra)
    return path


class RecordValMetrics(Hook):
    """Appends the metrics each validation hands its hooks to ``work_dir/val_metrics.jsonl``."""

    def after_val_epoch(self, runner, metrics=None):
        with open(Path(runner.work_dir) / "val_metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": runner.iter, **metrics}) + "\n")
