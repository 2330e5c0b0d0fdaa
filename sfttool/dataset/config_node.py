"""The training dataset node of a loaded config, as the checks read it (``check-custom-dataset``,
the train entry's template check): where it is, what builds it, its arguments with the builder's
defaults.

    >>> node = dataset_node(cfg)                  # doctest: +SKIP
    >>> is_process_hf_dataset(node), pipeline_args(node)['max_length']  # doctest: +SKIP
    (True, 2048)
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

from sfttool.dataset.errors import DatasetError
from sfttool.dataset.pipeline import process_hf_dataset
from sfttool.dataset.resolve import dataset_config
from sfttool.registry import resolve_type


def dataset_node(cfg) -> dict:
    """``train_dataloader.dataset`` (or ``train_dataset``) as a plain dict."""
    node = None
    if "train_dataloader" in cfg and isinstance(cfg["train_dataloader"], dict):
        node = cfg["train_dataloader"].get("dataset")
    if node is None and "train_dataset" in cfg:
        node = cfg["train_dataset"]
    if not isinstance(node, dict) or "type" not in node:
        raise DatasetError(f"{cfg.filename}: no `train_dataloader.dataset` (or `train_dataset`) with a `type`; "
                           "set train_dataloader = dict(dataset=dict(type=process_hf_dataset, ...), ...)")
    return dict(node.items())  # items() resolves the config's lazy imports; to_dict() would stringify them


def is_built_by(node: Any, builder: Callable) -> bool:
    return isinstance(node, dict) and "type" in node and \
        resolve_type(node["type"], "train_dataloader.dataset.type") is builder


def is_process_hf_dataset(node: Any) -> bool:
    return is_built_by(node, process_hf_dataset)


def pipeline_args(node: dict, builder: Callable = process_hf_dataset) -> dict:
    """The node's arguments with the defaults of ``builder`` (process_hf_dataset) filled in, its
    ``dataset`` a config with its own arguments built (``resolve.dataset_config``)."""
    args = {name: p.default for name, p in inspect.signature(builder).parameters.items()
            if p.default is not inspect.Parameter.empty}
    args.update({k: v for k, v in node.items() if k != "type"})
    args["dataset"] = dataset_config(args["dataset"])
    return args
