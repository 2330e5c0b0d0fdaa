"""The train entry, in build order:

    config -> checks (config, DeepSpeed JSON, work dir, --resume, template)
    -> process group -> seed -> dataset (rank 0 first) -> model -> runner
    -> train -> HF export (work_dir/hf_adapter or work_dir/hf_model)

The checks come first so a mistake costs seconds, not a processed dataset.
The process group comes before the dataset because building it waits on the
group (rank 0 preprocesses, the others then read the cache), and the seed
comes before the model so every rank starts from the same LoRA
initialisation. Each step is one call into the module that owns it:
``preflight`` (checks and decisions), ``processes``, ``assemble`` (the
runner), ``export``; ``summary`` is what the terminal shows.
"""
from __future__ import annotations

import contextlib
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

from sfttool import compat
from sfttool.config import load_config
from sfttool.engine import preflight
from sfttool.engine.assemble import RunPlan, build_runner, experiment_name, replay_setup_log, setup_log
from sfttool.engine.cpu_threads import choose_cpu_threads
from sfttool.engine.processes import (build_dataset_rank0_first, close_process_group, init_distributed,
                                      one_process_rank_env)
from sfttool.registry import build


def train(config: str, work_dir: str | None = None, deepspeed: str | None = None, resume: str | None = None,
          seed: int | None = None, cfg_options: list[str] | dict | None = None, trust_remote_code: bool = False,
          max_steps: int | None = None, dry_run: bool = False, verbose: bool = False,
          strict: bool = False) -> Path:
    """Run one training process (``torchrun`` starts one per device). Returns the work dir.

    ``max_steps``: stop after that many optimizer steps, with a checkpoint. ``dry_run``: build and
    check everything, process the data, run one iteration, keep nothing but the dataset cache.
    ``verbose``: the full config and hook table on the terminal too. ``strict``: a template that
    does not match the tokenizer is an error."""
    compat.quiet_library_noise()
    with compat.quiet_console(verbose):
        cfg, plan = prepare(config, work_dir, deepspeed, resume, seed, cfg_options, trust_remote_code)
        plan.max_steps, plan.dry_run = max_steps, dry_run
        from sfttool.engine.hooks.preemption_hook import TrainingPreempted

        with one_process_rank_env(deepspeed is not None):
            plan.launcher = init_distributed(cfg, deepspeed is not None)
            try:
                run(cfg, plan, strict)
            except TrainingPreempted:  # every rank stopped at the same step, so they can still leave together
                close_process_group(plan.launcher)
                raise
            close_process_group(plan.launcher)
    return plan.work_dir


def prepare(config: str, work_dir: str | None, deepspeed: str | None, resume: str | None, seed: int | None,
            cfg_options: list[str] | dict | None, trust_remote_code: bool) -> tuple[Any, RunPlan]:
    """The config, checked, and what the command line decided: everything that can fail before
    anything is built fails here, in seconds."""
    preflight.announce_config(config)
    cfg = load_config(config, cfg_options)
    preflight.check_config(cfg)
    compat.apply_training()  # imports deepspeed (seconds): only once the config is known to be good
    preflight.remote_code_policy(cfg, trust_remote_code)
    work_dir, resume_from = preflight.check_run(cfg, work_dir, deepspeed, resume)
    choose_cpu_threads(deepspeed is not None)
    misaligned = preflight.checkpoint_interval_warning(cfg)
    if misaligned:
        preflight.warn(misaligned)
    if seed is not None:
        preflight.apply_seed(cfg, seed)
    return cfg, RunPlan(work_dir=work_dir, seed=preflight.run_seed(cfg, seed), deepspeed=deepspeed,
                        resume_from=resume_from)


def run(cfg: Any, plan: RunPlan, strict: bool = False) -> None:
    """Build in order, train, export. A dry run trains in a temporary work dir and exports nothing."""
    import torch
    from mmengine.runner import set_random_seed

    from sfttool.engine.checkpoint import check_checkpoint_fits, ignore_frozen_weights_on_load
    from sfttool.engine.hooks.preemption_hook import signal_handlers_restored
    from sfttool.engine.summary import announce_summary
    from sfttool.engine.validation import restore_best_weights, validation_runner_args
    from sfttool.parallel.setup import check_sequence_parallel_config

    set_random_seed(plan.seed)
    plan.name = experiment_name(cfg)
    with setup_log(plan.name) as records:  # data and model loading, before the runner's log file exists
        preflight.check_template(cfg, strict)  # seconds, before the data is processed
        check_sequence_parallel_config(cfg)  # the number of processes is known now, the data not processed yet
        dataset = build_dataset_rank0_first(cfg.train_dataloader.dataset)
        plan.validation = validation_runner_args(cfg)  # val_dataloader/val_cfg/val_evaluator, or {}
        model_cfg, dtype_note = preflight.model_cfg_for_device(cfg.model, torch.cuda.is_available())
        model = build(model_cfg, "model")
        if dtype_note:
            preflight.warn(dtype_note)
        preflight.check_vocabulary(dataset, model)  # else an IndexError (a device-side assert on GPU) at step 1
        ignore_frozen_weights_on_load(model)  # a LoRA checkpoint holds the adapter only, by design
        if plan.resume_from and not plan.deepspeed:  # DeepSpeed's folders load only with its own objects
            check_checkpoint_fits(plan.resume_from, model)  # another model's checkpoint: one line, now
        prepare = getattr(model, "prepare_train_data", None)
        if prepare is not None:  # a pass over the data the model needs first (DPO's precomputed reference)
            dataset = prepare(dataset, cfg.get("optim_wrapper"))
    with _scratch_work_dir(plan) as runner_plan:
        runner = build_runner(cfg, model, dataset, runner_plan)
        replay_setup_log(runner, records)
        announce_summary(runner, cfg, model, dataset, plan)
        with signal_handlers_restored():  # the PreemptionHook's SIGTERM/SIGINT handlers end with the run
            runner.train()
        if not plan.dry_run:
            from sfttool.engine.export import save_hf
            restore_best_weights(runner, cfg)  # export_best: the HF export holds the best validation's weights
            save_hf(runner, cfg, plan.work_dir)


@contextlib.contextmanager
def _scratch_work_dir(plan: RunPlan) -> Iterator[RunPlan]:
    """A dry run writes its logs and config dump into a temporary folder, removed afterwards, so the
    real work dir holds nothing a later run (or ``--resume``) would trip over."""
    if not plan.dry_run:
        yield plan
        return
    scratch = Path(tempfile.mkdtemp(prefix="sfttool-dry-run-"))
    try:
        yield replace(plan, work_dir=scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
