"""The train entry, in build order:

    config -> validate -> process group -> seed -> dataset (rank 0 first)
    -> model -> runner (mmengine Runner, or FlexibleRunner for DeepSpeed)
    -> train -> HF export (work_dir/hf_adapter or work_dir/hf_model)

The process group comes first because building the dataset waits on it
(rank 0 preprocesses, the others then read the cache) and the seed comes
before the model so every rank starts from the same LoRA initialisation.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import logging
import os
from pathlib import Path
from typing import Any, Iterator

from sfttool import compat
from sfttool.config import ConfigError, load_config, validate_config
from sfttool.engine.processes import (build_dataset_rank0_first, close_process_group, init_distributed,
                                      one_process_rank_env)
from sfttool.registry import build, resolve_type

def train(config: str, work_dir: str | None = None, deepspeed: str | None = None, resume: str | None = None,
          seed: int | None = None, cfg_options: list[str] | dict | None = None,
          trust_remote_code: bool = False) -> Path:
    """Run one training process (``torchrun`` starts one per device). Returns the work dir."""
    announce_config(config)
    cfg = load_config(config, cfg_options)
    check_config(cfg)
    compat.apply_training()  # imports deepspeed (seconds): only once the config is known to be good
    remote_code_policy(cfg, trust_remote_code)
    work_dir, resume_from = check_run(cfg, work_dir, deepspeed, resume)
    if deepspeed:
        compat.limit_cpu_threads()
    misaligned = checkpoint_interval_warning(cfg)
    if misaligned:
        from mmengine.logging import print_log
        print_log(misaligned, logger="current", level=logging.WARNING)
    if seed is not None:
        apply_seed(cfg, seed)
    seed = _seed(cfg, seed)
    from sfttool.engine.hooks.preemption_hook import TrainingPreempted

    with one_process_rank_env(deepspeed is not None):
        launcher = init_distributed(cfg, deepspeed is not None)
        try:
            run(cfg, work_dir, launcher, seed, deepspeed, resume_from)
        except TrainingPreempted:  # every rank stopped at the same step, so they can still leave together
            close_process_group(launcher)
            raise
        close_process_group(launcher)
    return work_dir


def check_config(cfg: Any) -> None:
    """Every problem of the merged config at once, before anything is built."""
    from sfttool.engine.tracking import check_trackers

    errors = validate_config(cfg, cfg.filename)
    if errors:
        raise ConfigError("the config has problems:\n  " + "\n  ".join(errors))
    check_trackers(cfg)  # report_to's packages: one line naming the extra to install


def check_run(cfg: Any, work_dir: str | None, deepspeed: str | None, resume: str | None,
              world_size: int | None = None) -> tuple[Path, str | None]:
    """What else can fail before anything is built: the DeepSpeed JSON (before the work dir is made,
    so a refusal leaves nothing behind), the work dir (now, not at the first checkpoint hours later),
    ``--resume``. Returns the work dir and the checkpoint to resume from. The launcher runs it, after
    ``check_config``, for the planned ``world_size`` too, so a mistake is reported once rather than
    once per rank."""
    if deepspeed:
        from sfttool.engine.deepspeed import deepspeed_config
        deepspeed_config(deepspeed, cfg, world_size=world_size)
    work_dir = resolve_work_dir(cfg, work_dir)
    check_work_dir(work_dir, resume)
    return work_dir, resolve_resume(resume, work_dir, deepspeed)


def run(cfg: Any, work_dir: Path, launcher: str, seed: int, deepspeed: str | None, resume_from: str | None) -> None:
    from mmengine.runner import set_random_seed

    from sfttool.engine.checkpoint import check_checkpoint_fits, ignore_frozen_weights_on_load
    from sfttool.engine.hooks.preemption_hook import signal_handlers_restored
    from sfttool.engine.validation import restore_best_weights, validation_runner_args

    set_random_seed(seed)
    name = experiment_name(cfg)
    with setup_log(name) as records:  # dataset statistics and model loading, before the runner's log file exists
        dataset = build_dataset_rank0_first(cfg.train_dataloader.dataset)
        validation = validation_runner_args(cfg)  # val_dataloader/val_cfg/val_evaluator, or {}
        model = build(cfg.model, "model")
        check_vocabulary(dataset, model)  # else an IndexError (a device-side assert on GPU) at the first step
        ignore_frozen_weights_on_load(model)  # a LoRA checkpoint holds the adapter only, by design
        if resume_from and not deepspeed:  # DeepSpeed's folders load only with its own pickled objects: not checked
            check_checkpoint_fits(resume_from, model)  # another model's checkpoint: one line, before any building
    runner = build_runner(cfg, model, dataset, work_dir, launcher, seed, deepspeed, resume_from, name, validation)
    for handler in runner.logger.handlers:
        if isinstance(handler, logging.FileHandler):
            for record in records:
                handler.handle(record)
    with signal_handlers_restored():  # the PreemptionHook's SIGTERM/SIGINT handlers end with the run
        runner.train()
    restore_best_weights(runner, cfg)  # export_best: the HF export holds the best validation's weights
    save_hf(runner, cfg, work_dir)


def check_vocabulary(dataset: Any, model: Any) -> None:
    """Every token id in the data must have a row in the model's embedding table. A tokenizer with
    added tokens makes larger ids; ``model.tokenizer`` grows the embeddings to fit it, and an XTuner
    config that leaves it out would fail only inside the first forward."""
    import pyarrow.compute as pc

    column_names = getattr(dataset, "column_names", None) or []
    embeddings = getattr(model, "llm", model).get_input_embeddings()
    if "input_ids" not in column_names or embeddings is None or len(dataset) == 0:
        return  # a streamed or custom dataset: ids are not known before training
    ids = dataset.select_columns(["input_ids"]).with_format("arrow")[:]["input_ids"]
    biggest = pc.max(pc.list_flatten(ids)).as_py()
    if biggest is not None and biggest >= embeddings.num_embeddings:
        raise ConfigError(
            f"the data holds token id {biggest} but the model's embedding table has {embeddings.num_embeddings} "
            "rows: the tokenizer has tokens the model lacks (added special tokens?); set "
            "model=dict(..., tokenizer=tokenizer) so SupervisedFinetune grows the embeddings to fit it")


def announce_config(config: str) -> None:
    """Configs are Python and are executed: say which file, before running it."""
    from sfttool.config import find_config

    if os.environ.get("RANK", "0") == "0":
        print(f"[sfttool] executing config {find_config(config)}", flush=True)


def remote_code_policy(cfg: Any, trust_remote_code: bool) -> None:
    """trust_remote_code is off unless the config or --trust-remote-code asks; warn when on."""
    import warnings

    from sfttool.engine.safety import apply_trust_remote_code, remote_code_warning

    allowed = apply_trust_remote_code(cfg, trust_remote_code)
    if allowed:
        warnings.warn(remote_code_warning(allowed), stacklevel=2)


def accumulative_counts(cfg: Any) -> int:
    """Iterations per optimizer step."""
    return (cfg.get("optim_wrapper") or {}).get("accumulative_counts") or 1


def checkpoint_interval_warning(cfg: Any) -> str | None:
    """A warning when periodic checkpoints fall inside an accumulation window: the gradients gathered
    since the last optimizer step are not saved, so a resume from such a checkpoint is not exact."""
    accumulation = accumulative_counts(cfg)
    interval = ((cfg.get("default_hooks") or {}).get("checkpoint") or {}).get("interval")
    if isinstance(interval, int) and isinstance(accumulation, int) and interval % accumulation:
        return (f"default_hooks.checkpoint.interval={interval} is not a multiple of "
                f"optim_wrapper.accumulative_counts={accumulation}: its checkpoints fall inside an optimizer "
                "step, and a resume from one drops that step's gathered gradients; use a multiple "
                f"(e.g. {interval - interval % accumulation or accumulation})")
    return None


def apply_seed(cfg: Any, seed: int) -> None:
    """``--seed``: every seed the config copied from its ``seed`` setting, not only ``randomness.seed``
    (model initialisation, dropout) but the data's too (the dataset's shuffle before packing, subset and
    mixing; the sampler's order), as a changed ``seed = ...`` in PART 1 would."""
    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if "type" in node and "seed" in node:
                node["seed"] = seed
            for value in node.values():
                walk(value)
        elif isinstance(node, (list, tuple)):
            for value in node:
                walk(value)

    cfg.randomness = dict(cfg.get("randomness") or {}, seed=seed)
    walk(cfg.train_dataloader)
    walk(cfg.get("val_dataloader"))  # its validation_split must hold out the rows the training split left out


def _seed(cfg: Any, seed: int | None) -> int:
    if seed is not None:
        return seed
    randomness = cfg.get("randomness") or {}
    return int(randomness.get("seed") if randomness.get("seed") is not None else cfg.get("seed", 0) or 0)


# ---------------------------------------------------------------------------
# The runner

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
    return dl


def iters_per_epoch(cfg: Any, dataset: Any) -> int:
    """Micro-batches per epoch per rank (mmengine's ``DefaultSampler`` pads to equal shares)."""
    from mmengine.dist import get_world_size

    share = -(-len(dataset) // get_world_size())
    return max(1, -(-share // int(cfg.train_dataloader.get("batch_size", 1))))


def train_loop_cfg(cfg: Any) -> dict:
    from sfttool.engine.runner import TrainLoop

    loop = dict(cfg.train_cfg)
    loop["type"] = resolve_type(loop["type"], "train_cfg.type") if "type" in loop else TrainLoop
    return loop


def total_iters(loop: dict, per_epoch: int) -> int:
    if loop.get("max_iters") is not None:
        return int(loop["max_iters"])
    return int(-(-float(loop["max_epochs"]) * per_epoch // 1))


def optim_wrapper_cfg(cfg: Any) -> dict:
    ow = compat.cpu_optim_wrapper_type(dict(cfg.optim_wrapper))
    try:
        from sfttool.engine.nonfinite import guard_optim_wrapper_cfg
    except ImportError:  # the guard is optional
        return ow
    return guard_optim_wrapper_cfg(ow)


def hooks(cfg: Any) -> tuple[dict, list]:
    """(default_hooks, custom_hooks): the checkpoint hook made atomic, our
    hooks built with sfttool's builder (their tokenizer configs too), RNG
    state saved for exact resume."""
    from sfttool.engine.checkpoint import AtomicCheckpointHook, RNGStateHook

    default = dict(cfg.get("default_hooks") or {})
    ckpt = dict(default.get("checkpoint") or {})
    ckpt.pop("type", None)
    ckpt["by_epoch"] = False  # TrainLoop counts iterations
    default["checkpoint"] = AtomicCheckpointHook(**ckpt)
    custom = [_build_hook(h, f"custom_hooks[{i}]") for i, h in enumerate(cfg.get("custom_hooks") or [])]
    return default, custom + [RNGStateHook()] + _preemption_hook(custom) + _plot_hook(custom)


def _plot_hook(custom: list) -> list:
    """``work_dir/loss.png`` at the end of every run, unless the config lists its own LossPlotHook."""
    from sfttool.engine.hooks.plot_hook import LossPlotHook

    return [] if any(isinstance(h, LossPlotHook) for h in custom) else [LossPlotHook()]


def _preemption_hook(custom: list) -> list:
    """SIGTERM/SIGINT -> checkpoint at the next step boundary, exit 128+signal
    (every run gets it unless the config lists its own)."""
    from sfttool.engine.hooks.preemption_hook import PreemptionHook

    return [] if any(isinstance(h, PreemptionHook) for h in custom) else [PreemptionHook()]


def _build_hook(hook: Any, key: str) -> Any:
    if isinstance(hook, dict) and isinstance(hook.get("type"), str) and "." not in hook["type"]:
        try:
            resolve_type(hook["type"], key)
        except Exception:
            return hook  # a name in mmengine's own hook registry: mmengine builds it
    return build(hook, key)


def resolve_work_dir(cfg: Any, work_dir: str | None) -> Path:
    """``--work-dir``, else the config's ``work_dir``, else ``./work_dirs/<config name>``."""
    return Path(work_dir or cfg.get("work_dir") or Path("work_dirs") / Path(cfg.filename).stem).resolve()


def check_work_dir(work_dir: Path, resume: str | None) -> None:
    """A writable folder, and without an earlier run's checkpoints unless ``--resume``
    continues it: a run started over would overwrite its ``iter_N.pth``,
    ``last_checkpoint``, dumped config and HF export."""
    from sfttool.engine.checkpoint import find_latest_checkpoint
    from sfttool.engine.safety import WorkDirError, check_work_dir_writable

    if work_dir.is_file():
        raise WorkDirError(f"work dir {work_dir} is a file, not a folder; choose another folder with --work-dir")
    check_work_dir_writable(work_dir)
    earlier = None if resume else find_latest_checkpoint(work_dir)
    if earlier is not None:
        raise WorkDirError(f"{work_dir} already holds checkpoints of an earlier run (newest: {earlier.name}); "
                           "pass --resume to continue it, or choose another --work-dir (or remove those checkpoints)")


def resolve_resume(resume: str | None, work_dir: Path, deepspeed: str | None = None) -> str | None:
    """``--resume`` (auto) -> the work dir's latest complete checkpoint; a path -> itself.
    Either must be of the kind ``--deepspeed`` loads: a folder with it, a file without."""
    from sfttool.engine.checkpoint import find_latest_checkpoint

    if not resume:
        return None
    if resume == "auto":
        path = find_latest_checkpoint(work_dir)
        if path is None:
            raise ConfigError(f"--resume: no checkpoint (iter_*.pth) in {work_dir}; "
                              "train without --resume or pass a checkpoint path")
    else:
        path = Path(resume)
        if not path.exists():
            raise ConfigError(f"--resume {resume}: no such checkpoint")
    path = path.resolve()
    if deepspeed and not path.is_dir():
        raise ConfigError(f"--resume {path} was saved without DeepSpeed (a file; DeepSpeed saves a folder); "
                          "resume it without --deepspeed")
    if not deepspeed and path.is_dir():
        raise ConfigError(f"--resume {path} is a DeepSpeed checkpoint (a folder); resume it with --deepspeed "
                          "and the preset it was trained with")
    return str(path)


_runs_in_this_process = itertools.count(1)


@contextlib.contextmanager
def setup_log(name: str) -> Iterator[list]:
    """A fresh current logger for what happens before the runner exists (the dataset's counts, model
    loading): printed as usual, and kept so the run's log file gets it too. Without it, a second run in
    the same process logged its set-up into the first run's file."""
    from mmengine.logging import MMLogger

    records: list = []
    logger = MMLogger.get_instance(f"{name}_setup")
    keeper = logging.Handler()
    keeper.emit = records.append
    logger.addHandler(keeper)
    try:
        yield records
    finally:
        logger.removeHandler(keeper)


def experiment_name(cfg: Any) -> str:
    """The run's name: the config's (or its ``experiment_name``), numbered from the second run of a process.

    mmengine names a run's message hub and logger ``<name>_<timestamp to the second>`` and hands back an
    existing instance of that name, so a second run started in the same process within the same second
    (tests, notebooks) inherited the first run's checkpoint bookkeeping -- and deleted its own new
    checkpoints as "older than the last K" -- and logged into the first run's file. Every rank runs
    ``train`` the same number of times, so the numbers agree across ranks."""
    name = cfg.get("experiment_name") or (Path(cfg.filename).stem if cfg.filename else "run")
    n = next(_runs_in_this_process)
    return name if n == 1 else f"{name}_run{n}"


def build_runner(cfg: Any, model: Any, dataset: Any, work_dir: Path, launcher: str, seed: int,
                 deepspeed: str | None, resume_from: str | None, name: str, validation: dict | None = None):
    """``resume_from``: a checkpoint path already resolved by ``resolve_resume``, or None.
    ``validation``: the Runner's val_dataloader/val_cfg/val_evaluator (``validation_runner_args``)."""
    from sfttool.engine.schedulers import resolve_param_schedulers
    from sfttool.engine.tracking import visualizer_cfg

    loop = train_loop_cfg(cfg)
    per_epoch = iters_per_epoch(cfg, dataset)
    default_hooks, custom_hooks = hooks(cfg)
    env_cfg = dict(cfg.get("env_cfg") or {})
    env_cfg["dist_cfg"] = dict(env_cfg.get("dist_cfg") or {})
    if launcher != "none":  # one process needs no backend: no warning about nccl then
        env_cfg["dist_cfg"]["backend"] = compat.cpu_dist_backend(env_cfg["dist_cfg"].get("backend"))
    common = dict(
        model=model, work_dir=str(work_dir), train_dataloader=dataloader_cfg(cfg, dataset), train_cfg=loop,
        param_scheduler=resolve_param_schedulers(cfg.get("param_scheduler"), per_epoch, total_iters(loop, per_epoch),
                                                 accumulative_counts(cfg)),
        default_hooks=default_hooks, custom_hooks=custom_hooks, launcher=launcher, env_cfg=env_cfg,
        log_processor=cfg.get("log_processor") or dict(by_epoch=False), log_level=cfg.get("log_level", "INFO"),
        visualizer=visualizer_cfg(cfg), randomness=dict(cfg.get("randomness") or {}, seed=seed),
        resume=resume_from is not None, load_from=resume_from or cfg.get("load_from"), cfg=cfg,
        experiment_name=name, **(validation or {}))
    if deepspeed:
        return _deepspeed_runner(cfg, model, deepspeed, common)
    from mmengine.runner import Runner

    if launcher != "none":  # the Runner reads the wrapper from its cfg
        common["cfg"] = cfg = copy.deepcopy(cfg)
        cfg.model_wrapper_cfg = compat.cpu_ddp_wrapper_cfg(cfg.get("model_wrapper_cfg"),
                                                           cfg.get("find_unused_parameters", False))
    return Runner(optim_wrapper=optim_wrapper_cfg(cfg), **common)


def _deepspeed_runner(cfg: Any, model: Any, deepspeed: str, common: dict):
    from mmengine.runner._flexible_runner import FlexibleRunner

    from sfttool.engine.deepspeed import deepspeed_config, deepspeed_optim_wrapper, deepspeed_strategy

    ds = deepspeed_config(deepspeed, cfg)
    strategy = deepspeed_strategy(ds, lora=bool(getattr(model, "use_lora", False)))
    return FlexibleRunner(strategy=strategy, optim_wrapper=_guarded(deepspeed_optim_wrapper(dict(cfg.optim_wrapper)),
                                                                    cfg.optim_wrapper), **common)


def _guarded(ds_wrapper: dict, user_cfg: Any) -> dict:
    """The non-finite loss guard on DeepSpeed's wrapper (counts and stops; DeepSpeed skips)."""
    from sfttool.engine.nonfinite import DEFAULT_MAX_CONSECUTIVE_NONFINITE, guard_optim_wrapper_cfg

    limit = user_cfg.get("max_consecutive_nonfinite", DEFAULT_MAX_CONSECUTIVE_NONFINITE)
    return guard_optim_wrapper_cfg(dict(ds_wrapper, max_consecutive_nonfinite=limit))


# ---------------------------------------------------------------------------
# HF export

def save_hf(runner: Any, cfg: Any, work_dir: Path) -> Path | None:
    """LoRA: ``work_dir/hf_adapter`` (peft adapter, loadable with
    ``PeftModel.from_pretrained``); full fine-tune: ``work_dir/hf_model``. The
    tokenizer is saved beside it. Under ZeRO-3 the weights are gathered first."""
    from mmengine.dist import barrier, is_main_process

    from sfttool.engine.runner import unwrap_model

    model = unwrap_model(runner.model)
    llm = getattr(model, "llm", None)
    if llm is None:
        return None
    out = work_dir / ("hf_adapter" if getattr(model, "use_lora", False) else "hf_model")
    with _gathered(runner.model, model):
        if is_main_process():
            with _kv_cache_on(llm):  # training turned it off; the saved model is for inference
                llm.save_pretrained(str(out), safe_serialization=True)
            tokenizer = cfg.get("tokenizer")
            if tokenizer is not None:
                build(tokenizer, "tokenizer").save_pretrained(str(out))
            # `sfttool chat` and `convert merge` read the training template from it.
            cfg.dump(str(out / "sfttool_config.py"))
            runner.logger.info(f"Saved the {'adapter' if out.name == 'hf_adapter' else 'model'} to {out}")
    barrier()
    return out


@contextlib.contextmanager
def _kv_cache_on(llm: Any) -> Iterator[None]:
    config = getattr(llm, "config", None)
    before = getattr(config, "use_cache", None)
    if config is not None:
        config.use_cache = True
    try:
        yield
    finally:
        if config is not None:
            config.use_cache = before


def _gathered(wrapped: Any, model: Any):
    """ZeRO-3 partitions parameters across ranks: gather them for saving."""
    from sfttool.engine.runner import deepspeed_engine

    partitioned = getattr(deepspeed_engine(wrapped), "zero_optimization_partition_weights", None)
    if callable(partitioned) and partitioned():
        import deepspeed

        # A LoRA export holds only the trained weights (the adapter, and embeddings when they grew): gather
        # those, not the whole frozen base model at once, which is what ZeRO-3 exists to avoid holding.
        lora = getattr(model, "use_lora", False)
        params = [p for p in model.parameters() if p.requires_grad or not lora]
        return deepspeed.zero.GatheredParameters(params, modifier_rank=None)
    return contextlib.nullcontext()
