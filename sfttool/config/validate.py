"""Check a loaded config before anything is built; report every problem at once."""
from __future__ import annotations

import os
from typing import Any

from sfttool.config.arguments import check_arguments, typed_nodes

__all__ = ["check_arguments", "check_data_paths", "validate_config"]

REQUIRED_KEYS = {
    "model": "the model to train, e.g. model = dict(type=SupervisedFinetune, llm=...)",
    "train_dataloader": "the training data, e.g. train_dataloader = dict(batch_size=1, dataset=train_dataset, ...)",
    "optim_wrapper": "the optimizer, e.g. optim_wrapper = dict(optimizer=dict(type=AdamW, lr=2e-4))",
    "train_cfg": "the loop length, e.g. train_cfg = dict(type=TrainLoop, max_epochs=3)",
}


def _get(cfg: Any, dotted: str) -> Any:
    node = cfg
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def validate_config(cfg: Any, path: str = "config") -> list[str]:
    """Return a list of ``'<file>: <key>: <problem>; fix: ...'`` messages (empty when valid)."""
    errors = []
    # An mmengine ``Config`` is not a dict; its ConfigDict is.
    cfg = getattr(cfg, "_cfg_dict", cfg)
    for key, example in REQUIRED_KEYS.items():
        if _get(cfg, key) is None:
            errors.append(f"{path}: missing `{key}`; add {example}")
    dl = _get(cfg, "train_dataloader")
    if isinstance(dl, dict):
        if dl.get("dataset") is None:
            errors.append(f"{path}: train_dataloader.dataset: missing; set it to your dataset config")
        bs = dl.get("batch_size")
        if bs is not None and (not isinstance(bs, int) or bs < 1):
            errors.append(f"{path}: train_dataloader.batch_size: must be a positive integer, got {bs!r}")
    accum = _get(cfg, "optim_wrapper.accumulative_counts")
    if accum is not None and (not isinstance(accum, int) or accum < 1):
        errors.append(f"{path}: optim_wrapper.accumulative_counts: must be a positive integer, got {accum!r}")
    lr = _get(cfg, "optim_wrapper.optimizer.lr")
    if lr is not None and (not isinstance(lr, (int, float)) or lr <= 0):
        errors.append(f"{path}: optim_wrapper.optimizer.lr: must be a positive number, got {lr!r}")
    tc = _get(cfg, "train_cfg")
    if isinstance(tc, dict) and tc.get("max_epochs") is None and tc.get("max_iters") is None:
        errors.append(f"{path}: train_cfg: set max_epochs (or max_iters) so the run has a length")
    from sfttool.dataset.preference import validation_problems
    from sfttool.dataset.prompts import validation_problems as prompt_validation_problems
    return (errors + check_arguments(cfg, path) + check_data_paths(cfg, path) + validation_problems(cfg, path)
            + prompt_validation_problems(cfg, path))


def check_data_paths(cfg: Any, path: str) -> list[str]:
    """Local data files that do not exist (``data_path``, or the ``data_files`` of XTuner's
    ``dict(type=load_dataset, path='json', data_files=...)``), found now rather than when the
    dataset is built. Only literal paths are checked: a lazily built one (the demo's
    ``builtin_data_file``) is not built here."""
    from sfttool.dataset.data_path import data_source, load_data_path
    from sfttool.dataset.errors import DatasetError
    errors = []
    for key, node, fn, _ in typed_nodes(cfg):
        if fn is load_data_path and isinstance(node.get("path"), str):
            try:
                data_source(node["path"])
            except DatasetError as exc:
                errors.append(f"{path}: {key}.path: {exc}")
        elif getattr(fn, "__name__", "") == "load_dataset":
            errors += [f"{path}: {key}.data_files: no such file {file!r}; set data_files to your data file "
                       "(a path relative to the folder you run from, or absolute)" for file in _missing_files(node)]
    return errors


def _missing_files(node: dict) -> list[str]:
    from sfttool.dataset.load import data_file_list
    files = node.get("data_files")
    if not isinstance(files, (str, list, tuple, dict)) or _has_typed(files):
        return []  # built lazily: not built here
    return [f for f in data_file_list(files)
            if not any(c in f for c in "*?[") and "://" not in f and not os.path.exists(os.path.expanduser(f))]


def _has_typed(node: Any) -> bool:
    if isinstance(node, dict):
        return "type" in node or any(_has_typed(v) for v in node.values())
    return isinstance(node, (list, tuple)) and any(_has_typed(v) for v in node)
