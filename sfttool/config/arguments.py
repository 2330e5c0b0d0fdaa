"""Check the argument names of every typed node against what will be called, before anything is built.

mmengine builds the loop, hooks and optimizer only when training starts, and the model and dataset are
built after the data has been processed, so a misspelt argument (``model.lora.rr``,
``train_dataloader.dataset.max_lenght``) would otherwise fail minutes or hours in. Each node's ``type``
is resolved (no call, no import beyond the config's own) and its keys are compared with the callable's
signature, following ``**kwargs`` into base classes. A callable that still takes ``**kwargs`` (HF
``from_pretrained``, ``BitsAndBytesConfig``, ``datasets.load_dataset``) accepts names nobody can list
(a model's config attributes), so there only a name within a typo of a known one is reported.
Arguments built lazily (``SupervisedFinetune``'s ``llm``) are nodes like any other: their own ``type``
is checked, nothing is built.

Dicts without ``type`` that a known function receives as keyword arguments are checked the same way:
``optim_wrapper.clip_grad`` (``clip_grad_norm_``/``clip_grad_value_``, called at the first optimizer
step; its required argument too), ``randomness``, ``log_processor``, ``env_cfg.mp_cfg``,
``env_cfg.dist_cfg``, a ``val_cfg``/``test_cfg`` without ``type``; and the keys a library reads from
a dict it keeps (``env_cfg``, ``optim_wrapper.paramwise_cfg``: ``ReadKeys``).
"""
from __future__ import annotations

import difflib
import functools
import inspect
import re
from typing import Any, Callable, Iterator

# What the runner and the train entry build, in the order errors are reported; other top-level names
# are building blocks that these hold copies of.
ROOTS = ("model", "tokenizer", "train_dataloader", "val_dataloader", "test_dataloader", "optim_wrapper",
         "param_scheduler", "train_cfg", "val_cfg", "test_cfg", "val_evaluator", "test_evaluator",
         "default_hooks", "custom_hooks", "visualizer", "randomness", "log_processor", "env_cfg")

# mmengine's DataLoader keys it takes out before calling torch's DataLoader.
_DATALOADER_KEYS = {"dataset", "sampler", "batch_sampler", "collate_fn", "worker_init_fn", "num_batch_per_epoch"}

# Keys mmengine's builders (and sfttool's non-finite loss guard, `max_consecutive_nonfinite`) take out
# of a node before calling its type, by the node's kind.
_TAKEN = {"optim_wrapper": {"constructor", "paramwise_cfg", "max_consecutive_nonfinite"}, "hook": {"priority"},
          "scheduler": {"convert_to_iter_based"}, "loop": {"by_epoch"}, "clip_grad": {"type"}}


class ReadKeys:
    """The keys a library reads from a dict it does not unpack (``env_cfg``, ``paramwise_cfg``): checked
    like a signature's names, read from its source so they follow the version."""

    def __init__(self, name: str, keys: set[str]):
        self.__name__, self.keys = name, keys


# Close enough to a known name to be a typo of it (torch_dtpye -> torch_dtype: 0.91).
_TYPO_CUTOFF = 0.8


def check_arguments(cfg: Any, path: str) -> list[str]:
    """``'<file>: <key>: <Type> takes no argument `x` (did you mean y?)'`` for each unknown argument,
    every typed node of what the run builds, each problem once."""
    errors = [error for key, node, fn, kind in typed_nodes(cfg)
              for error in _unknown(path, key, node, fn, kind) + _missing(path, key, node, fn, kind)]
    return errors + _clip_type_problems(getattr(cfg, "_cfg_dict", cfg), path)


def typed_nodes(cfg: Any) -> Iterator[tuple[str, dict, Callable, str]]:
    """``(key, node, callable, kind)`` for each typed node of what the run builds, without building
    anything; a node equal to one already given (a copy of ``tokenizer`` in a hook) is left out."""
    cfg = getattr(cfg, "_cfg_dict", cfg)
    seen: list[tuple[Any, Any]] = []
    for root in ROOTS:
        node = cfg.get(root) if isinstance(cfg, dict) else None
        if root == "train_dataloader" and isinstance(node, dict) and node.get("dataset") is None:
            node = dict(node, dataset=cfg.get("train_dataset"))
        for key, node, fn, kind in _typed_nodes(node, root):
            if key == "optim_wrapper.paramwise_cfg" and "constructor" in cfg["optim_wrapper"]:
                continue  # its keys are the custom constructor's to read
            if not any(node == other and fn == other_fn for other, other_fn in seen):
                seen.append((node, fn))
                yield key, node, fn, kind


def _typed_nodes(node: Any, key: str) -> Iterator[tuple[str, dict, Callable, str]]:
    """``(key, node, callable, kind)`` for every node below ``key`` whose callable is known."""
    if isinstance(node, dict):
        kind = _kind(key)
        fn = _callable(node, key, kind)
        if fn is not None:
            yield key, node, fn, kind
        for name in node.keys():
            if name != "type":
                yield from _typed_nodes(node.get(name), f"{key}.{name}")
    elif isinstance(node, (list, tuple)):
        for i, item in enumerate(node):
            yield from _typed_nodes(item, f"{key}.{i}")


def _kind(key: str) -> str:
    """Which builder makes the node at ``key``: it decides the registry and the keys it takes out."""
    parts = key.split(".")
    if len(parts) == 1 and key.endswith("_dataloader"):
        return "dataloader"
    if len(parts) == 2 and parts[0].endswith("_dataloader") and parts[1] == "sampler":
        return "sampler"
    if key in ("train_cfg", "val_cfg", "test_cfg"):
        return "loop"
    if key in ("optim_wrapper", "optim_wrapper.clip_grad"):
        return key.rsplit(".", 1)[-1]
    if key == "optim_wrapper.optimizer":
        return "optimizer"
    if key == "param_scheduler" or (parts[0] == "param_scheduler" and len(parts) == 2):
        return "scheduler"
    if parts[0] in ("default_hooks", "custom_hooks") and len(parts) == 2:
        return "hook"
    if key == "visualizer":
        return "visualizer"
    return "sfttool"


def _callable(node: dict, key: str, kind: str) -> Callable | None:
    if kind == "dataloader":
        from torch.utils.data import DataLoader
        return DataLoader
    if kind == "clip_grad":
        return _clip_function(node.get("type", "norm"))
    if "type" not in node and kind == "optim_wrapper":
        from mmengine.optim import OptimWrapper
        return OptimWrapper  # mmengine's default
    if "type" not in node:
        return _loop_class(node, key) if kind == "loop" else _untyped(key)
    return _resolve(node.get("type"), kind)


def _clip_function(clip_type: Any) -> Callable | None:
    """mmengine's OptimWrapper calls ``clip_grad_norm_(params, **clip_grad)`` (``type='norm'``, the
    default) or ``clip_grad_value_`` (``type='value'``) at the first optimizer step."""
    import torch
    return {"norm": torch.nn.utils.clip_grad_norm_, "value": torch.nn.utils.clip_grad_value_}.get(clip_type)


def _untyped(key: str) -> Callable | ReadKeys | None:
    """What receives a dict without ``type`` at ``key``: a function the runner unpacks it into, or the
    keys a library reads from it."""
    from mmengine.optim import DefaultOptimWrapperConstructor
    from mmengine.runner import Runner
    from mmengine.runner.log_processor import LogProcessor
    from mmengine.utils.dl_utils import set_multi_processing
    if key == "randomness":
        return Runner.set_randomness
    if key == "log_processor":
        return LogProcessor
    if key == "env_cfg.mp_cfg":
        return set_multi_processing
    if key == "env_cfg.dist_cfg":
        return _dist_cfg_keys()
    if key == "env_cfg":
        return ReadKeys("Runner.setup_env", _read_keys(Runner.setup_env, "env_cfg"))
    if key == "optim_wrapper.paramwise_cfg":
        return ReadKeys("DefaultOptimWrapperConstructor",
                        _read_keys(DefaultOptimWrapperConstructor, r"self\.paramwise_cfg"))
    return None


def _dist_cfg_keys() -> ReadKeys:
    """mmengine's ``init_dist(launcher, **dist_cfg)`` hands what it does not name to torch's
    ``init_process_group``."""
    from mmengine.dist import init_dist
    from torch.distributed import init_process_group
    names = accepted_arguments(init_dist)[0] | accepted_arguments(init_process_group)[0]
    return ReadKeys("init_dist", names - {"launcher", "rank", "world_size"})


def _read_keys(fn: Any, holder: str) -> set[str]:
    """The keys ``fn``'s source reads from ``holder`` (``holder.get('x')``, ``holder['x']``)."""
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        return set()
    return set(re.findall(rf"{holder}(?:\.get\(\s*|\[)[\"'](\w+)", source))


def _resolve(type_: Any, kind: str) -> Callable | None:
    """The callable a ``type`` names, or None when it cannot be told (the build reports that)."""
    if callable(type_):
        return type_
    if not isinstance(type_, str):
        return None
    registry = _registry(kind)
    if registry is not None:
        try:
            found = registry.get(type_)
        except Exception:  # a dotted path mmengine's registries do not know: sfttool's builder resolves it
            found = None
        if found is not None:
            return found
    from sfttool.registry import ConfigBuildError, resolve_type
    try:
        return resolve_type(type_)
    except (ConfigBuildError, ImportError, AttributeError):
        return None


def _registry(kind: str) -> Any:
    from mmengine import registry as r
    return {"sampler": r.DATA_SAMPLERS, "loop": r.LOOPS, "optim_wrapper": r.OPTIM_WRAPPERS,
            "optimizer": r.OPTIMIZERS, "scheduler": r.PARAM_SCHEDULERS, "hook": r.HOOKS,
            "visualizer": r.VISUALIZERS}.get(kind)


def _loop_class(node: dict, key: str) -> Any:
    """The loop mmengine builds from a loop config without ``type``."""
    from mmengine.runner import EpochBasedTrainLoop, IterBasedTrainLoop, TestLoop, ValLoop
    if key != "train_cfg":
        return ValLoop if key == "val_cfg" else TestLoop
    if "by_epoch" not in node:
        return None  # mmengine needs `type` or `by_epoch`; the build says so
    return EpochBasedTrainLoop if node["by_epoch"] else IterBasedTrainLoop


def _unknown(path: str, key: str, node: dict, fn: Callable, kind: str) -> list[str]:
    accepted, open_ended = accepted_arguments(fn)
    accepted |= _TAKEN.get(kind, set()) | (_DATALOADER_KEYS if kind == "dataloader" else set())
    out = []
    for arg in node.keys():
        if arg == "type" or arg in accepted:
            continue
        close = difflib.get_close_matches(arg, sorted(accepted), n=2, cutoff=_TYPO_CUTOFF if open_ended else 0.6)
        if open_ended and not close:
            continue  # **kwargs takes it (a model config attribute, a reader option)
        hint = f" (did you mean {' or '.join(close)}?)" if close else ""
        takes = "reads no key" if isinstance(fn, ReadKeys) else "takes no argument"
        out.append(f"{path}: {key}.{arg}: {_name(fn)} {takes} `{arg}`{hint}")
    return out


def _missing(path: str, key: str, node: dict, fn: Callable, kind: str) -> list[str]:
    """The required arguments a ``clip_grad`` dict lacks: mmengine passes only the parameters."""
    if kind != "clip_grad":
        return []
    required = [p.name for p in inspect.signature(fn).parameters.values()
                if p.default is p.empty and p.kind == p.POSITIONAL_OR_KEYWORD and p.name != "parameters"]
    return [f"{path}: {key}: {_name(fn)} needs `{name}` (e.g. {key}=dict({name}=1.0))"
            for name in required if name not in node]


def _clip_type_problems(cfg: Any, path: str) -> list[str]:
    clip = (cfg.get("optim_wrapper") or {}).get("clip_grad") if isinstance(cfg, dict) else None
    if isinstance(clip, dict) and _clip_function(clip.get("type", "norm")) is None:
        return [f"{path}: optim_wrapper.clip_grad.type: {clip.get('type')!r} is not a kind of clipping mmengine "
                "knows; use 'norm' (clip_grad_norm_, the default) or 'value' (clip_grad_value_)"]
    return []


def _name(fn: Any) -> str:
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, type):
        return f"{owner.__name__}.{fn.__name__}"
    return getattr(fn, "__name__", repr(fn))


def accepted_arguments(fn: Any) -> tuple[set[str], bool]:
    """``(names, open_ended)``: the keyword names ``fn`` takes, following ``**kwargs`` into base
    classes; ``open_ended`` when ``**kwargs`` still takes any other name.

    >>> names, open_ended = accepted_arguments(lambda a, *, b=1: None)
    >>> sorted(names), open_ended
    (['a', 'b'], False)
    """
    if isinstance(fn, ReadKeys):
        return set(fn.keys), False
    names: set[str] = set()
    for target in _signature_targets(fn):
        try:
            parameters = inspect.signature(target).parameters.values()
        except (TypeError, ValueError):
            return names, True
        names |= {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        if not any(p.kind == p.VAR_KEYWORD for p in parameters):
            return names, False
    return names | _forwarded_names(fn), True


def _signature_targets(fn: Any) -> list[Any]:
    from mmengine.hooks import CheckpointHook
    from mmengine.runner import Runner
    if not isinstance(fn, type):
        return [fn]
    targets = []
    for cls in fn.__mro__:
        if "__init__" in cls.__dict__ and cls is not object:
            targets.append(cls.__dict__["__init__"])
        if cls is CheckpointHook:
            # CheckpointHook keeps unknown keywords and hands them to Runner.save_checkpoint at each save.
            targets.append(Runner.save_checkpoint)
            break
    return targets


def _forwarded_names(fn: Any) -> set[str]:
    """Names an open-ended callable is known to pass its ``**kwargs`` on to."""
    target = getattr(fn, "forwards_kwargs_to", None)  # a callable, or its dotted import path
    if isinstance(target, str):
        from sfttool.registry import resolve_type
        target = resolve_type(target)
    if target is not None:
        return accepted_arguments(target)[0]
    if getattr(fn, "__name__", "") == "from_pretrained" and isinstance(getattr(fn, "__self__", None), type):
        return _from_pretrained_names() | _popped(fn)  # an Auto class pops a few of its own
    return set()


def _popped(fn: Any) -> set[str]:
    """Names a function reads from its ``**kwargs`` (``kwargs.pop('x')``, ``kwargs.get('x')``)."""
    try:
        return set(re.findall(r"kwargs\.(?:pop|get)\(\s*[\"'](\w+)", inspect.getsource(fn)))
    except (OSError, TypeError):
        return set()


@functools.cache
def _from_pretrained_names() -> frozenset[str]:
    """What HF ``from_pretrained`` reads from its ``**kwargs`` (its own options, the model config's and
    the tokenizer's common attributes), read from transformers' source so it follows the version."""
    from transformers import PretrainedConfig, PreTrainedModel
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    names = set(PretrainedConfig().to_dict()) | set(PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES)
    for target in (PreTrainedModel.from_pretrained, PreTrainedTokenizerBase.from_pretrained,
                   PreTrainedTokenizerBase._from_pretrained, PreTrainedTokenizerBase.__init__):
        target = getattr(target, "__func__", target)
        names |= set(inspect.signature(target).parameters) | _popped(target)
    return frozenset(names - {"kwargs", "self", "cls"})
