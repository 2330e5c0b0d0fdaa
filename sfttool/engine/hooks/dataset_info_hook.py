"""Dataset statistics before training: rows, samples, tokens, trained tokens,
packing efficiency, and one decoded row with its loss mask.

    Dataset: 12 rows, 64 samples, 1530 tokens (1204 trained), packing efficiency 99.6% of 12 x 128
    Row 0 input:   <|im_start|>user\\nhi?<|im_end|>\\n<|im_start|>assistant\\nHello.<|im_end|>...
    Row 0 trained: [Hello.<|im_end|>] ...
"""
from __future__ import annotations

from typing import Any

from mmengine.hooks import Hook

from sfttool.dataset.pack import packing_efficiency
from sfttool.registry import BUILDER, build_if_config

IGNORE_INDEX = -100


def _lengths(dataset: Any, column: str) -> list[int]:
    """Per-row list lengths, read from Arrow without decoding rows when possible."""
    data = getattr(dataset, "data", None)
    if data is not None and hasattr(data, "column") and column in getattr(dataset, "column_names", []):
        import pyarrow.compute as pc
        return pc.list_value_length(data.column(column)).to_pylist()
    return [len(dataset[i][column]) for i in range(len(dataset))]


def _trained_tokens(dataset: Any) -> int:
    data = getattr(dataset, "data", None)
    if data is not None and hasattr(data, "column") and "labels" in getattr(dataset, "column_names", []):
        import pyarrow.compute as pc
        labels = pc.list_flatten(data.column("labels"))
        return int(pc.sum(pc.not_equal(labels, IGNORE_INDEX)).as_py() or 0)
    return sum(sum(1 for x in dataset[i]["labels"] if x != IGNORE_INDEX) for i in range(len(dataset)))


def dataset_stats(dataset: Any, max_length: int | None = None) -> dict:
    """``{'rows', 'samples', 'tokens', 'trained_tokens', 'max_length', 'efficiency'}``; the
    efficiency is the pipeline's (``pack.packing_efficiency``) of ``max_length``, or of the
    longest row when the dataset's ``max_length`` is not known."""
    lengths = _lengths(dataset, "input_ids")
    columns = getattr(dataset, "column_names", None) or list(dataset[0].keys())
    samples = sum(_lengths(dataset, "sample_lengths")) if "sample_lengths" in columns else len(lengths)
    trained = _trained_tokens(dataset)
    tokens = sum(lengths)
    max_length = max_length or max(lengths, default=0)
    return {"rows": len(lengths), "samples": samples, "tokens": tokens, "trained_tokens": trained,
            "max_length": max_length, "efficiency": packing_efficiency(tokens, len(lengths), max_length) or 0.0}


def configured_max_length(cfg: Any) -> int | None:
    """The ``max_length`` the training dataset was processed to, when the config says it."""
    dataset_cfg = ((cfg or {}).get("train_dataloader") or {}).get("dataset") or {}
    value = dataset_cfg.get("max_length") if isinstance(dataset_cfg, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def trained_spans(input_ids: list[int], labels: list[int]) -> list[list[int]]:
    """Runs of ids whose label is trained: ``ids [5,6,7,8], labels [-100,6,7,-100]`` -> ``[[6, 7]]``."""
    spans, current = [], []
    for token, label in zip(input_ids, labels):
        if label != IGNORE_INDEX:
            current.append(token)
        elif current:
            spans.append(current)
            current = []
    return spans + ([current] if current else [])


@BUILDER.register_module()
class DatasetInfoHook(Hook):
    """XTuner's ``DatasetInfoHook(tokenizer, is_intern_repo_dataset=False)``."""

    priority = "LOW"

    def __init__(self, tokenizer, is_intern_repo_dataset: bool = False):
        self.tokenizer = build_if_config(tokenizer, "DatasetInfoHook.tokenizer")

    def before_train(self, runner) -> None:
        dataset = runner.train_dataloader.dataset
        from torch.utils.data import IterableDataset
        if isinstance(dataset, IterableDataset):  # a stream (sfttool.dataset.streaming): no rows to read ahead
            return
        if not hasattr(dataset, "__len__") or len(dataset) == 0:
            return
        stats = dataset_stats(dataset, configured_max_length(runner.cfg))
        runner.logger.info(
            f"Dataset: {stats['rows']} rows, {stats['samples']} samples, {stats['tokens']} tokens "
            f"({stats['trained_tokens']} trained), packing efficiency {stats['efficiency']:.1%} "
            f"of {stats['rows']} x {stats['max_length']}")
        row = dataset[0]
        spans = trained_spans(row["input_ids"], row["labels"])
        runner.logger.info(f"Row 0 input:\n{self.tokenizer.decode(row['input_ids'])}")
        runner.logger.info("Row 0 trained (loss on the [bracketed] parts):\n"
                           + " ".join(f"[{self.tokenizer.decode(s)}]" for s in spans))
