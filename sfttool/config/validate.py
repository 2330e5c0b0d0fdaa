"""Check a loaded config before anything is built; report every problem at once."""
from __future__ import annotations

import difflib
import inspect
from typing import Any, Callable

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
    return errors + check_arguments(cfg, path)


# ---------------------------------------------------------------------------
# Argument names of what the runner builds itself (the data loader, sampler, optimizer, schedulers,
# loop and hooks): mmengine builds most of them only when training starts, or, for the checkpoint
# hook, passes them on at the first save, so a misspelt name would fail after the dataset and the
# model were built, or after hours of training. The model and dataset go through sfttool's registry,
# whose errors already name the key.

# mmengine's DataLoader keys it takes out before calling torch's DataLoader.
_DATALOADER_KEYS = {"dataset", "sampler", "batch_sampler", "collate_fn", "worker_init_fn", "num_batch_per_epoch"}


def check_arguments(cfg: Any, path: str) -> list[str]:
    """``'<file>: <key>: <Type> takes no argument `x` (did you mean y?)'`` for each unknown argument."""
    from mmengine.registry import DATA_SAMPLERS, HOOKS, LOOPS, OPTIMIZERS, PARAM_SCHEDULERS
    from torch.utils.data import DataLoader
    nodes: list[tuple[str, Any, Any]] = [("optim_wrapper.optimizer", _get(cfg, "optim_wrapper.optimizer"),
                                          OPTIMIZERS),
                                         ("train_dataloader.sampler", _get(cfg, "train_dataloader.sampler"),
                                          DATA_SAMPLERS),
                                         ("train_cfg", _get(cfg, "train_cfg"), LOOPS)]
    schedulers = _get(cfg, "param_scheduler")
    for i, node in enumerate(schedulers if isinstance(schedulers, list) else [schedulers]):
        nodes.append((f"param_scheduler.{i}" if isinstance(schedulers, list) else "param_scheduler", node,
                      PARAM_SCHEDULERS))
    for name, node in (_get(cfg, "default_hooks") or {}).items():
        nodes.append((f"default_hooks.{name}", node, HOOKS))
    for i, node in enumerate(_get(cfg, "custom_hooks") or []):
        nodes.append((f"custom_hooks.{i}", node, HOOKS))
    errors = []
    for key, node, registry in nodes:
        if not isinstance(node, dict):
            continue
        fn = _loop_class(node) if key == "train_cfg" else _resolve(node.get("type"), registry)
        if fn is not None:
            errors += _unknown(path, key, node, fn, _accepted(fn))
    dataloader = _get(cfg, "train_dataloader")
    if isinstance(dataloader, dict):
        errors += _unknown(path, "train_dataloader", dataloader, DataLoader,
                           (_accepted(DataLoader) or set()) | _DATALOADER_KEYS)
    return errors


def _unknown(path: str, key: str, node: dict, fn: Callable, accepted: set[str] | None) -> list[str]:
    if accepted is None:
        return []
    out = []
    for arg in node:
        # by_epoch picks the loop class; convert_to_iter_based is taken by mmengine's scheduler builder
        if arg in ("type", "by_epoch", "convert_to_iter_based") or arg in accepted:
            continue
        close = difflib.get_close_matches(arg, sorted(accepted), n=2, cutoff=0.6)
        hint = f" (did you mean {' or '.join(close)}?)" if close else ""
        out.append(f"{path}: {key}.{arg}: {getattr(fn, '__name__', fn)} takes no argument `{arg}`{hint}")
    return out


def _resolve(type_: Any, registry) -> Any:
    if isinstance(type_, str):
        try:
            return registry.get(type_)
        except Exception:  # unknown names are reported by the build itself
            return None
    return type_ if callable(type_) else None


def _loop_class(node: dict) -> Any:
    from mmengine.registry import LOOPS
    from mmengine.runner import EpochBasedTrainLoop, IterBasedTrainLoop
    if "type" in node:
        return _resolve(node["type"], LOOPS)
    if "by_epoch" not in node:
        return None  # mmengine needs one of the two; the build says so
    return EpochBasedTrainLoop if node["by_epoch"] else IterBasedTrainLoop


def _accepted(fn: Any) -> set[str] | None:
    """Keyword names ``fn`` takes, following ``**kwargs`` into base classes; None when any goes."""
    from mmengine.hooks import CheckpointHook
    from mmengine.runner import Runner
    names: set[str] = set()
    if isinstance(fn, type):
        targets = []
        for cls in fn.__mro__:
            if "__init__" in cls.__dict__ and cls is not object:
                targets.append(cls.__dict__["__init__"])
            if cls is CheckpointHook:
                # CheckpointHook keeps unknown keywords and hands them to Runner.save_checkpoint at each save.
                targets.append(Runner.save_checkpoint)
                break
    else:
        targets = [fn]
    for target in targets:
        try:
            parameters = inspect.signature(target).parameters.values()
        except (TypeError, ValueError):
            return None
        names |= {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        if not any(p.kind == p.VAR_KEYWORD for p in parameters):
            return names
    return None
