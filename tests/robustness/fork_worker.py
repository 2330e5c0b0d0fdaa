"""Tokenize in forked workers after this process has used the tokenizer's thread pool.

Run as ``python fork_worker.py MODE MODEL_DIR DATA`` by test_tokenizer_fork.py, with
TOKENIZERS_PARALLELISM set by the test. Prints ``ok <count>`` when every worker returned.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from datasets import load_dataset
from transformers import AutoTokenizer

from sfttool.dataset import process_hf_dataset
from sfttool.dataset.tokens import batch_token_ids
from sfttool.dataset.map_fns import template_map_fn_factory
from sfttool.dataset.streaming import StreamingPackedDataset
from sfttool.utils import PROMPT_TEMPLATE


def main(mode: str, model_dir: str, data: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    batch_token_ids(tokenizer, ["warm the pool"] * 64)  # the parent's pool is now in use, as in training
    template = template_map_fn_factory(template=PROMPT_TEMPLATE.qwen_chat)
    if mode == "stream":  # rows as a list: the stream deals them to both workers
        rows = [json.loads(line) for line in Path(data).read_text().splitlines()]
        dataset = StreamingPackedDataset(rows, tokenizer, max_length=256, template_map_fn=template,
                                         buffer_size=16, seed=0)
        loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2, collate_fn=lambda row: row)
        count = sum(len(row["sample_lengths"]) for row in loader)
    else:
        dataset = process_hf_dataset(load_dataset("json", data_files=data, split="train"), tokenizer,
                                     max_length=256, template_map_fn=template, map_num_proc=2,
                                     pack_to_max_length=False)
        count = len(dataset)
    print("ok", count)


if __name__ == "__main__":
    main(*sys.argv[1:])
