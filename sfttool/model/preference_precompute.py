"""Reference log-probs computed once before training (``DPO(precompute_ref_log_probs=True)``).

One pass over the training rows, without gradients and with the reference in eval mode, gives each
sequence's summed reference log-prob. The values become a column of the processed dataset,
``ref_logps`` (one float per sequence of the row: chosen, rejected, chosen, ...), which
``preference_collate_fn`` hands to the model as ``ref_logps`` [2 * pairs] in ``sequence_ids``
order. Living in the rows, they follow them through shuffling, packing, ``--resume`` and data
parallelism with no state of their own; a resumed run computes them again (the reference does not
train, so they come out the same).

Each row is its own forward, so its values do not depend on which rows would share its batch, nor
on the number of processes. Each process computes every ``world_size``-th row and the processes
exchange their shares. The pass runs before DeepSpeed partitions the model: a full fine-tune's
frozen reference copy is then freed and never reaches DeepSpeed or the optimizer.

    >>> dataset = add_reference_log_probs(model, dataset, torch.device('cpu'))   # doctest: +SKIP
    >>> dataset[0]['ref_logps']   # a row of two pairs                           # doctest: +SKIP
    [-41.2, -57.9, -12.0, -30.3]
"""
from __future__ import annotations

import contextlib
import gc
import time
from typing import Any

import torch
from mmengine.dist import all_gather_object, get_rank, get_world_size

from sfttool.dataset.collate_fns.preference_collate_fn import REF_COLUMN, preference_collate_fn
from sfttool.dataset.report import log
from sfttool.errors import SfttoolError
from sfttool.model.build import to_torch_dtype
from sfttool.registry import type_name


class PrecomputeError(SfttoolError, ValueError):
    """The reference log-probs cannot be precomputed for this run."""


def add_reference_log_probs(model: Any, dataset: Any, device: torch.device,
                            autocast_dtype: torch.dtype | None = None, validation: bool = False) -> Any:
    """``dataset`` with the column ``ref_logps`` from ``model.reference_logps`` (the model in eval
    mode, its reference on ``device``). ``autocast_dtype``: on a GPU, the autocast dtype training
    runs the reference under, so the values are those it would compute. ``validation``: the
    validation set (said so in the log)."""
    check_dataset(dataset)
    start = time.perf_counter()
    rank, world = get_rank(), get_world_size()
    rows = "validation rows" if validation else "rows"
    log(f"Reference log-probs: computing them once for {len(dataset)} {rows}"
        + (f" ({world} processes)" if world > 1 else ""))
    mine = {i: row_reference_logps(model, dataset[i], device, autocast_dtype)
            for i in range(rank, len(dataset), world)}
    values = gathered_in_order(mine, len(dataset))
    pairs = sum(len(v) for v in values) // 2
    log(f"Reference log-probs: {pairs} pairs in {len(dataset)} {rows} in {time.perf_counter() - start:.1f} s; "
        + ("validation skips the reference forward" if validation else "training steps skip the reference forward"))
    if REF_COLUMN in dataset.column_names:
        dataset = dataset.remove_columns(REF_COLUMN)
    return dataset.add_column(REF_COLUMN, values, new_fingerprint=f"{dataset._fingerprint}-ref-{pairs}")


def check_dataset(dataset: Any) -> None:
    from datasets import Dataset

    if not isinstance(dataset, Dataset) or "sample_lengths" not in dataset.column_names:
        raise PrecomputeError("model.precompute_ref_log_probs=True needs the training set that "
                              "build_preference_dataset builds (a datasets.Dataset of pair rows); "
                              f"got {type(dataset).__name__}: set train_dataloader.dataset to build_preference_dataset "
                              "or model.precompute_ref_log_probs=False")


@torch.no_grad()
def row_reference_logps(model: Any, row: dict, device: torch.device,
                        autocast_dtype: torch.dtype | None) -> list[float]:
    """The summed reference log-prob of each sequence of one row."""
    data = preference_collate_fn([row])["data"]
    data = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in data.items()}
    context = (torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype is not None
               else contextlib.nullcontext())
    with context:
        sums, _ = model.reference_logps(data)  # [2 * pairs] float32
    return sums.float().cpu().tolist()


def gathered_in_order(mine: dict[int, list[float]], total: int) -> list[list[float]]:
    """Every process's share, in row order (a process computed rows rank, rank + world, ...)."""
    shares = all_gather_object(mine) if get_world_size() > 1 else [mine]
    merged = {i: v for share in shares for i, v in share.items()}
    assert sorted(merged) == list(range(total)), "a row's reference log-probs are missing"
    return [merged[i] for i in range(total)]


def place_on_run_device(module: torch.nn.Module) -> torch.device:
    """The reference on the device training will use (this process's GPU, else the CPU), where
    the runner would move it anyway; a model already there (e.g. 4-bit, loaded onto its GPU)
    stays put."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if next(module.parameters()).device != device:
        module.to(device)
    return device


def release_memory() -> None:
    """Hand the freed reference's memory back (its tensors are gone once nothing refers to them)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def training_autocast_dtype(optim_wrapper: Any) -> torch.dtype | None:
    """The autocast dtype of ``AmpOptimWrapper`` on a GPU (mmengine's default float16); None
    elsewhere (float32 on CPU; DeepSpeed casts the weights themselves)."""
    optim_wrapper = optim_wrapper or {}
    if not torch.cuda.is_available() or not type_name(optim_wrapper.get("type")).endswith("AmpOptimWrapper"):
        return None
    dtype = optim_wrapper.get("dtype") or "float16"
    return to_torch_dtype(dtype, "optim_wrapper.dtype")
