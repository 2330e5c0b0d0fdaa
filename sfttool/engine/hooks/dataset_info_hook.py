"""Dataset statistics before training: rows, samples, tokens, trained tokens,
packing efficiency, and one decoded row with its loss mask.

    Dataset: 12 rows, 64 samples, 1530 tokens (1204 trained), packing efficiency 99.6% of 12 x 128
    Row 0 input:   <|im_start|>user\\nhi?<|im_end|>\\n<|im_start|>assistant\\nHello.<|im_end|>...
    Row 0 trained: [Hello.<|im_end|>] ...
"""
from __future__ import annotations

from typing import Any

from mmengine.hooks import Hook

from sfttool.dataset.stats import dataset_stats
from sfttool.registry import BUILDER, build_if_config
from sfttool.utils.constants import IGNORE_INDEX


def configured_max_length(cfg: Any) -> int | None:
    """The ``max_length`` the training dataset is processed to, when the config says it."""
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
            f"({stats['trained_tokens']} trained), packing efficiency {stats['packing_efficiency']:.1%} "
            f"of {stats['rows']} x {stats['max_length']}")
        row = dataset[0]
        spans = trained_spans(row["input_ids"], row["labels"])
        runner.logger.info(f"Row 0 input:\n{self.tokenizer.decode(row['input_ids'])}")
        runner.logger.info("Row 0 trained (loss on the [bracketed] parts):\n"
                           + " ".join(f"[{self.tokenizer.decode(s)}]" for s in spans))
