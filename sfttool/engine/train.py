"""The train entry, in build order:

    config -> checks (every rule at once) -> spec -> process group -> seed
    -> template check -> dataset (rank 0 first) -> model -> runner -> train
    -> HF export (work_dir/hf_adapter or work_dir/hf_model)

The checks come first so a mistake costs seconds, not a processed dataset;
then the run is decided once (``spec.RunSpec``) and every stage reads its
settings from that. The process group comes before the dataset because
building it waits on the group (rank 0 preprocesses, the others then read the
cache), and the seed comes before the model so every rank starts from the same
LoRA initialisation. Each step is one call into the module that owns it:
``checks``, ``spec``, ``processes``, ``assemble`` (the runner), ``export``;
``summary`` is what the terminal shows.
"""
from __future__ import annotations

import contextlib
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

from mmengine.runner import set_random_seed

from sfttool import compat
from sfttool.config import load_config
from sfttool.dataset.resolve import skip_bad_rows_in
from sfttool.engine import checks, preflight
from sfttool.engine.assemble import build_runner, replay_setup_log, setup_log
from sfttool.engine.checkpoint import check_checkpoint_fits, ignore_frozen_weights_on_load
from sfttool.engine.cpu_threads import choose_cpu_threads
from sfttool.engine.export import save_hf
from sfttool.engine.hooks.preemption_hook import TrainingPreempted, signal_handlers_restored
from sfttool.engine.processes import (build_dataset_rank0_first, close_process_group, init_distributed,
                                      one_process_rank_env, world_size_from_env)
from sfttool.engine.runner import DRY_RUN_INFO
from sfttool.engine.spec import RunSpec, TrainOptions, build_spec
from sfttool.engine.summary import announce_summary
from sfttool.engine.validation import restore_best_weights, validation_runner_args
from sfttool.registry import build


def train(config: str, **flags: Any) -> Path:
    """Run one training process (``torchrun`` starts one per device). Returns the work dir.

    ``flags`` are ``spec.TrainOptions``'s: ``work_dir``, ``deepspeed``, ``resume``, ``seed``,
    ``cfg_options``, ``trust_remote_code``, ``max_steps`` (stop after that many optimizer steps,
    with a checkpoint), ``dry_run`` (build and check everything, process the data, run one
    iteration, keep nothing but the dataset cache), ``verbose`` (the full config and hook table on
    the terminal too), ``strict`` (a template that does not match the tokenizer is an error),
    ``skip_bad_rows`` (the datasets drop, counted, the rows whose trained answers the template cannot
    render, instead of stopping)."""
    options = TrainOptions(**flags)
    compat.quiet_library_noise()
    with compat.quiet_console(options.verbose):
        cfg, spec = prepare(config, options)
        with one_process_rank_env(spec.deepspeed is not None):
            init_distributed(cfg, spec.deepspeed is not None)
            try:
                run(cfg, spec)
            except TrainingPreempted:  # every rank stopped at the same step, so they can still leave together
                close_process_group(spec.launcher)
                raise
            close_process_group(spec.launcher)
    return spec.work_dir


def check(config: str, options: TrainOptions, world_size: int) -> Any:
    """Load the config and check every rule for ``world_size`` processes (what the launcher runs once
    before starting them). Returns the config."""
    cfg = load_run_config(config, options)
    checks.report(checks.run_checks(cfg, options, world_size))
    return cfg


def load_run_config(config: str, options: TrainOptions) -> Any:
    """The config with ``--cfg-options`` merged and ``--skip-bad-rows`` set on its datasets."""
    cfg = load_config(config, options.cfg_options)
    if options.skip_bad_rows:
        skip_bad_rows_in(cfg)
    return cfg


def prepare(config: str, options: TrainOptions) -> tuple[Any, RunSpec]:
    """The config, checked, and the run decided: everything that can fail before anything is built
    fails here, in seconds. Processes the launcher started were checked by it."""
    preflight.announce_config(config)
    cfg = load_run_config(config, options)
    preflight.remote_code_policy(cfg, options.trust_remote_code)  # its warning shows even if a check refuses
    if not checks.checked_by_launcher():
        checks.report(checks.run_checks(cfg, options, world_size_from_env()))
    compat.apply_training()  # imports deepspeed (seconds): only once the config is known to be good
    choose_cpu_threads(options.deepspeed is not None)
    if options.seed is not None:
        preflight.apply_seed(cfg, options.seed)
    return cfg, build_spec(cfg, options, world_size_from_env())


def run(cfg: Any, spec: RunSpec) -> None:
    """Build in order, train, export. A dry run trains in a temporary work dir and exports nothing."""
    set_random_seed(spec.seed)
    with setup_log(spec.name) as records:  # data and model loading, before the runner's log file exists
        preflight.check_template(cfg, spec.strict)  # seconds, before the data is processed
        dataset = build_dataset_rank0_first(cfg.train_dataloader.dataset)
        validation = validation_runner_args(cfg, spec)  # val_dataloader/val_cfg/val_evaluator, or {}
        model = build(preflight.model_cfg_in(cfg.model, spec.precision, spec.router_aux_loss_coef), "model")
        if spec.precision_note:
            preflight.warn(spec.precision_note)
        checks.check_built_model(model, spec.sequence_parallel_size)  # the attention heads: now they exist
        preflight.check_vocabulary(dataset, model)  # else an IndexError (a device-side assert on GPU) at step 1
        ignore_frozen_weights_on_load(model)  # a LoRA checkpoint holds the adapter only, by design
        if spec.resume_from and not spec.deepspeed:  # DeepSpeed's folders load only with its own objects
            check_checkpoint_fits(spec.resume_from, model)  # another model's checkpoint: one line, now
        prepare_data = getattr(model, "prepare_train_data", None)
        if prepare_data is not None:  # a pass over the data the model needs first (DPO's precomputed reference)
            dataset = _prepared(prepare_data, dataset, validation, cfg.get("optim_wrapper"))
    with _scratch_work_dir(spec) as runner_spec:
        runner = build_runner(cfg, runner_spec, model, dataset, validation)
        runner.message_hub.update_info(DRY_RUN_INFO, spec.dry_run)
        replay_setup_log(runner, records)
        announce_summary(runner, cfg, model, dataset, spec)
        with signal_handlers_restored():  # the PreemptionHook's SIGTERM/SIGINT handlers end with the run
            runner.train()
        if not spec.dry_run:
            restore_best_weights(runner, spec)  # export_best: the HF export holds the best validation's weights
            save_hf(runner, cfg, spec.work_dir)


def _prepared(prepare_data: Any, dataset: Any, validation: dict, optim_wrapper: Any) -> Any:
    """The training set after the model's pass over it; the validation set (in ``validation``'s
    loader) gets the same pass, in the same call, before the model frees what the pass used."""
    if not validation:
        return prepare_data(dataset, optim_wrapper)
    loader = validation["val_dataloader"]
    dataset, loader["dataset"] = prepare_data(dataset, optim_wrapper, val_dataset=loader["dataset"])
    return dataset


@contextlib.contextmanager
def _scratch_work_dir(spec: RunSpec) -> Iterator[RunSpec]:
    """A dry run writes its logs and config dump into a temporary folder, removed afterwards, so the
    real work dir holds nothing a later run (or ``--resume``) would trip over."""
    if not spec.dry_run:
        yield spec
        return
    scratch = Path(tempfile.mkdtemp(prefix="sfttool-dry-run-"))
    try:
        yield replace(spec, work_dir=scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
