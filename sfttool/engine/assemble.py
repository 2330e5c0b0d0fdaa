"""Assembling the runner from a config and what the run built (model, dataset):
the data loader, the loop, the learning-rate schedule, the optimizer wrapper
and the hooks, in one place each. ``build_runner`` gives mmengine's ``Runner``,
or its ``FlexibleRunner`` with a DeepSpeed strategy.

Hooks and loops are assembled in ``hooks`` and ``train_loop_cfg``: a feature
that adds a hook or a loop adds it there. What the run decided (its length, accumulation,
sequence parallelism, trackers, name) comes from its ``spec.RunSpec``.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import logging
from typing import Any, Iterator

from mmengine.logging import MMLogger
from mmengine.runner import FlexibleRunner, Runner, get_priority
from mmengine.registry import HOOKS

from sfttool import compat
from sfttool.engine.checkpoint import AtomicCheckpointHook, RNGStateHook
from sfttool.engine.deepspeed import (deepspeed_config, deepspeed_optim_wrapper, deepspeed_strategy,
                                      register_moe_leaf_modules)
from sfttool.engine.hooks.plot_hook import LossPlotHook
from sfttool.engine.hooks.preemption_hook import PreemptionHook
from sfttool.engine.hooks.progress_hook import ProgressHook
from sfttool.engine.hooks.step_logger_hook import log_processor_cfg, step_logger
from sfttool.engine.hooks.stop_hook import StopAfterHook
from sfttool.engine.nonfinite import DEFAULT_MAX_CONSECUTIVE_NONFINITE, guard_optim_wrapper_cfg
from sfttool.engine.runner import TrainLoop
from sfttool.engine.schedulers import resolve_param_schedulers
from sfttool.engine.spec import RunSpec
from sfttool.engine.tracking import visualizer_cfg
from sfttool.parallel.groups import get_data_parallel_world_size
from sfttool.parallel.sampler import train_sampler
from sfttool.parallel.setup import setup_sequence_parallel
from sfttool.registry import BUILDER, build, resolve_type


def build_runner(cfg: Any, spec: RunSpec, model: Any, dataset: Any, validation: dict):
    """The runner of ``spec``'s run: the config's loop, data loader, schedule, optimizer and hooks, the
    built ``model`` and ``dataset``, and ``validation`` (the Runner's val_* arguments, or {})."""
    setup_sequence_parallel(spec.sequence_parallel_size, model)  # before the sampler and the loop read the ranks
    per_epoch = iters_per_epoch(cfg, spec, dataset)
    loop = train_loop_cfg(cfg, spec.dry_run)
    full_run = total_iters(loop, per_epoch)
    default_hooks, custom_hooks = hooks(cfg, spec, spec.this_run_iters(full_run))
    common = dict(
        model=model, work_dir=str(spec.work_dir), train_dataloader=dataloader_cfg(cfg, dataset), train_cfg=loop,
        # the schedule of the full run, also when --max-steps stops early: --resume continues it unchanged
        param_scheduler=resolve_param_schedulers(cfg.get("param_scheduler"), per_epoch, full_run, spec.accumulation),
        default_hooks=default_hooks, custom_hooks=custom_hooks, launcher=spec.launcher, env_cfg=env_cfg(cfg),
        log_processor=log_processor_cfg(cfg.get("log_processor")), log_level=cfg.get("log_level", "INFO"),
        visualizer=visualizer_cfg(cfg, spec.trackers), randomness=dict(cfg.get("randomness") or {}, seed=spec.seed),
        resume=spec.resume_from is not None, load_from=spec.resume_from or cfg.get("load_from"), cfg=cfg,
        experiment_name=spec.name, **validation)
    if spec.deepspeed:
        return _deepspeed_runner(cfg, model, spec, common)
    if spec.launcher != "none":  # the Runner reads the wrapper from its cfg
        common["cfg"] = cfg = copy.deepcopy(cfg)
        cfg.model_wrapper_cfg = compat.cpu_ddp_wrapper_cfg(cfg.get("model_wrapper_cfg"),
                                                           cfg.get("find_unused_parameters", False))
    return Runner(optim_wrapper=optim_wrapper_cfg(cfg), **common)


# ---------------------------------------------------------------------------
# Data and loop

def dataloader_cfg(cfg: Any, dataset: Any, key: str = "train_dataloader") -> dict:
    """``train_dataloader`` (or ``key``) with the built dataset and resolved callables
    (mmengine's registries do not know dotted paths a dumped config holds)."""
    dl = dict(cfg[key])
    dl["dataset"] = dataset
    collate = dl.get("collate_fn")
    if isinstance(collate, dict):
        args = {k: v for k, v in collate.items() if k != "type"}
        dl["collate_fn"] = functools.partial(resolve_type(collate["type"], f"{key}.collate_fn.type"), **args)
    sampler = dl.get("sampler")
    if isinstance(sampler, dict) and isinstance(sampler.get("type"), str) and "." in sampler["type"]:
        dl["sampler"] = dict(sampler, type=resolve_type(sampler["type"], f"{key}.sampler.type"))
    if key == "train_dataloader":
        dl["sampler"] = train_sampler(dl.get("sampler"))
    return dl


def iters_per_epoch(cfg: Any, spec: RunSpec, dataset: Any) -> int:
    """Micro-batches per epoch per rank (mmengine's ``DefaultSampler`` pads to equal shares; the ranks of a
    sequence-parallel group share theirs)."""
    share = -(-len(dataset) // get_data_parallel_world_size())
    own = getattr(train_loop_cfg(cfg)["type"], "iterations_per_epoch", None)  # GRPOLoop: its generation rounds'
    if own is not None:
        return int(own(cfg, share))
    return max(1, -(-share // spec.batch_size))


def train_loop_cfg(cfg: Any, dry_run: bool = False) -> dict:
    """``train_cfg`` with its type resolved; a loop that shows a dry run its own way (``accepts_dry_run``)
    is told about ``--dry-run``."""
    loop = dict(cfg.train_cfg)
    loop["type"] = resolve_type(loop["type"], "train_cfg.type") if "type" in loop else TrainLoop
    if dry_run and getattr(loop["type"], "accepts_dry_run", False):
        loop["dry_run"] = True
    return loop


def total_iters(loop: dict, per_epoch: int) -> int:
    if loop.get("max_iters") is not None:
        return int(loop["max_iters"])
    return int(-(-float(loop["max_epochs"]) * per_epoch // 1))


def optim_wrapper_cfg(cfg: Any) -> dict:
    return guard_optim_wrapper_cfg(compat.cpu_optim_wrapper_type(dict(cfg.optim_wrapper)))


def env_cfg(cfg: Any) -> dict:
    env = dict(cfg.get("env_cfg") or {})
    env["dist_cfg"] = dict(env.get("dist_cfg") or {})
    # on CPU the dumped env names the backend a process group uses there (gloo), not the config's nccl
    env["dist_cfg"]["backend"] = compat.cpu_dist_backend(env["dist_cfg"].get("backend"),
                                                         warn=False)  # init_distributed warned
    return env


# ---------------------------------------------------------------------------
# Hooks

def hooks(cfg: Any, spec: RunSpec, iterations: int) -> tuple[dict, list]:
    """(default_hooks, custom_hooks): the checkpoint hook made atomic, the logger's interval no longer
    than the run, our hooks built with sfttool's builder (their tokenizer configs too), then the
    hooks every run gets: RNG state for exact resume, progress, preemption, a loss plot, an early stop."""
    default = dict(cfg.get("default_hooks") or {})
    default["checkpoint"] = _checkpoint_hook(default.get("checkpoint"), spec)
    interval = _cap_logger_interval(default, iterations)
    default["logger"] = step_logger(default["logger"])  # train lines at optimizer-step ends
    default = {name: _build_hook(h, f"default_hooks.{name}") for name, h in default.items()}
    custom = [_build_hook(h, f"custom_hooks[{i}]") for i, h in enumerate(cfg.get("custom_hooks") or [])]
    every_run = [RNGStateHook(), ProgressHook(interval=interval)] + _preemption_hook(custom) + _plot_hook(custom)
    if spec.dry_run or spec.max_steps:
        every_run.append(StopAfterHook(iterations=iterations, save=not spec.dry_run))
    return default, custom + every_run


def _checkpoint_hook(node: Any, spec: RunSpec) -> Any:
    ckpt = dict(node or {})
    ckpt.pop("type", None)
    ckpt["by_epoch"] = False  # TrainLoop counts iterations
    if spec.dry_run:  # it writes into a temporary folder anyway: spend no time on it
        ckpt.update(interval=-1, save_last=False)
    return AtomicCheckpointHook(**ckpt)


def _cap_logger_interval(default: dict, iterations: int) -> int:
    """A log interval longer than the run logs nothing (a run of 8 iterations with interval 10
    printed no loss and wrote no scalars): cap it at the run's length. Returns the interval."""
    if "logger" not in default:  # mmengine would add its LoggerHook with interval 10
        default["logger"] = dict(type="LoggerHook")
    logger = default["logger"]
    if isinstance(logger, dict):
        interval = min(int(logger.get("interval", 10)), max(iterations, 1))
        default["logger"] = dict(logger, interval=interval)
        return interval
    return max(min(int(getattr(logger, "interval", 10)), iterations), 1)


def _plot_hook(custom: list) -> list:
    """``work_dir/loss.png`` at the end of every run, unless the config lists its own LossPlotHook."""
    return [] if any(isinstance(h, LossPlotHook) for h in custom) else [LossPlotHook()]


def _preemption_hook(custom: list) -> list:
    """SIGTERM/SIGINT -> checkpoint at the next step boundary, exit 128+signal
    (every run gets it unless the config lists its own)."""
    return [] if any(isinstance(h, PreemptionHook) for h in custom) else [PreemptionHook()]


def _build_hook(hook: Any, key: str) -> Any:
    """Through sfttool's ``build`` (errors name the config key), except a bare name that only mmengine's
    hook registry holds, which mmengine builds."""
    kind = hook.get("type") if isinstance(hook, dict) else None
    if isinstance(kind, str) and "." not in kind and kind not in BUILDER and kind in HOOKS:
        return hook
    if isinstance(hook, dict) and "priority" in hook:  # mmengine's key for the runner, not the hook's argument
        hook = dict(hook)
        priority = hook.pop("priority")
        built = build(hook, key)
        built.priority = get_priority(priority)
        return built
    return build(hook, key)


# ---------------------------------------------------------------------------
# DeepSpeed

def _deepspeed_runner(cfg: Any, model: Any, spec: RunSpec, common: dict):
    ds = deepspeed_config(spec.deepspeed, cfg, spec.world_size)
    register_moe_leaf_modules(model)  # before DeepSpeed wraps the model and sets its ZeRO-3 hooks
    strategy = deepspeed_strategy(ds, lora=bool(getattr(model, "use_lora", False)))
    return FlexibleRunner(strategy=strategy, optim_wrapper=_guarded(
        deepspeed_optim_wrapper(dict(cfg.optim_wrapper)), cfg.optim_wrapper), **common)


def _guarded(ds_wrapper: dict, user_cfg: Any) -> dict:
    """The non-finite loss guard on DeepSpeed's wrapper (counts and stops; DeepSpeed skips)."""
    limit = user_cfg.get("max_consecutive_nonfinite", DEFAULT_MAX_CONSECUTIVE_NONFINITE)
    return guard_optim_wrapper_cfg(dict(ds_wrapper, max_consecutive_nonfinite=limit))


# ---------------------------------------------------------------------------
# The run's log before the runner exists

@contextlib.contextmanager
def setup_log(name: str) -> Iterator[list]:
    """A fresh current logger for what happens before the runner exists (the dataset's counts, model
    loading): printed as usual, and kept so the run's log file gets it too. Without it (mmengine 0.10.x:
    ``print_log(logger="current")`` writes to the newest MMLogger, and the run's own exists only once
    the runner is built), a second run in the same process logged its set-up into the first run's file."""
    records: list = []
    logger = MMLogger.get_instance(f"{name}_setup")
    keeper = logging.Handler()
    keeper.emit = records.append
    logger.addHandler(keeper)
    try:
        yield records
    finally:
        logger.removeHandler(keeper)


def replay_setup_log(runner: Any, records: list) -> None:
    """Write what ``setup_log`` kept into the run's log file."""
    for handler in runner.logger.handlers:
        if isinstance(handler, logging.FileHandler):
            for record in records:
                handler.handle(record)
