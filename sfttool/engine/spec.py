"""One run, decided once: ``RunSpec``, built from the checked config and the command line before
anything is constructed, frozen, and handed to every stage instead of the raw config's settings.

    options = TrainOptions(work_dir="w", max_steps=10)            # what `sfttool train` was told
    spec = build_spec(cfg, options, world_size=1)                 # after engine.checks passed
    spec.accumulation, spec.sequence_parallel_size, spec.validation, spec.trackers

A new ``sfttool train`` flag is a field of ``TrainOptions`` (the CLI forwards every field to the
launched processes as it is) and, where the run reads it, of ``RunSpec``.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from sfttool import compat
from sfttool.config.settings import has_setting, setting
from sfttool.engine.hooks.dataset_info_hook import configured_max_length
from sfttool.engine.preflight import model_cfg_for_device, resolve_resume, resolve_work_dir
from sfttool.engine.tracking import tracker_names
from sfttool.model.build import configured_dtype
from sfttool.registry import type_name


@dataclass(frozen=True)
class TrainOptions:
    """The flags of ``sfttool train`` (``engine.train.train``'s keyword arguments)."""
    work_dir: str | None = None
    deepspeed: str | None = None        # a preset name or a DeepSpeed JSON path
    resume: str | None = None           # 'auto' (the work dir's latest checkpoint) or a checkpoint path
    seed: int | None = None             # every seed the config copied, data order included
    cfg_options: Any = ()               # KEY=VALUE strings (or a dict)
    trust_remote_code: bool = False
    max_steps: int | None = None        # stop after this many optimizer steps, with a checkpoint
    dry_run: bool = False               # one iteration, nothing kept
    verbose: bool = False               # the full config and hook table on the terminal too
    strict: bool = False                # a template that does not match the tokenizer is an error
    skip_bad_rows: bool = False         # drop, counted, rows whose trained answers the template cannot render

    def command_line(self) -> list[str]:
        """The same flags as ``sfttool train`` arguments (what the launcher gives each process)."""
        args: list[str] = []
        for field in fields(self):
            value, flag = getattr(self, field.name), "--" + field.name.replace("_", "-")
            if field.name == "cfg_options":
                args += [part for option in value for part in ("--cfg-options", option)]
            elif isinstance(value, bool):
                args += [flag] if value else []
            elif value is not None:
                args += [flag, str(value)]
        return args


@dataclass(frozen=True)
class RunSpec:
    """Everything the run decided before building anything (``build_spec``)."""
    work_dir: Path
    name: str = "run"                  # mmengine's experiment name, numbered from a process's second run
    seed: int = 0
    method: str = "SupervisedFinetune"  # the model type: SFT, DPO, ORPO, RewardModel ...
    precision: str | None = None       # the dtype the LLM is loaded in here (None: the checkpoint's)
    precision_note: str | None = None  # why it differs from the config's, on a machine without a GPU
    sequence_parallel_size: int = 1
    max_length: int | None = None      # what the training data is processed to, when the config says it
    batch_size: int = 1                # rows per micro-batch per data-parallel rank
    accumulation: int = 1              # micro-batches per optimizer step
    validation: bool = False
    max_epochs: float | None = None    # the loop's length (train_cfg), one of the two
    max_iters: int | None = None
    max_steps: int | None = None       # --max-steps: optimizer steps this run stops after
    dry_run: bool = False
    trackers: tuple[str, ...] = ()     # report_to's names
    export_best: bool = False
    deepspeed: str | None = None
    resume_from: str | None = None     # the checkpoint --resume resolved to
    world_size: int = 1
    strict: bool = False
    router_aux_loss_coef: float | None = None  # PART 1's override of the MoE model's own (None: the model's)

    @property
    def launcher(self) -> str:
        """mmengine's launcher name: 'pytorch' with several processes."""
        return "pytorch" if self.world_size > 1 else "none"

    def this_run_iters(self, full_run: int) -> int:
        """Iterations this process runs at most: the full run, or what ``--max-steps``/``--dry-run`` allow."""
        if self.dry_run:
            return 1
        if self.max_steps:
            return min(full_run, self.max_steps * self.accumulation)
        return full_run


def build_spec(cfg: Any, options: TrainOptions, world_size: int) -> RunSpec:
    """The spec of a run of ``cfg`` (already checked by ``engine.checks``) with ``options`` on
    ``world_size`` processes."""
    import torch

    work_dir = resolve_work_dir(cfg, options.work_dir)
    loop = cfg.get("train_cfg") or {}
    model_cfg, note = model_cfg_for_device(cfg.get("model"), torch.cuda.is_available())
    return RunSpec(
        work_dir=work_dir, name=compat.numbered_run_name(experiment_name(cfg)), seed=run_seed(cfg, options.seed),
        method=type_name((cfg.get("model") or {}).get("type")), precision=configured_dtype(model_cfg),
        precision_note=note, sequence_parallel_size=setting(cfg, "sequence_parallel_size"),
        max_length=configured_max_length(cfg), batch_size=int(cfg.train_dataloader.get("batch_size", 1)),
        accumulation=accumulative_counts(cfg), validation=validation_enabled(cfg),
        max_epochs=loop.get("max_epochs"), max_iters=loop.get("max_iters"), max_steps=options.max_steps,
        dry_run=options.dry_run, trackers=tuple(tracker_names(setting(cfg, "report_to"))),
        export_best=bool(setting(cfg, "export_best")), deepspeed=options.deepspeed,
        resume_from=resolve_resume(options.resume, work_dir, options.deepspeed),
        world_size=world_size, strict=options.strict,
        router_aux_loss_coef=setting(cfg, "router_aux_loss_coef"))


# ---------------------------------------------------------------------------
# Each value, read from the config in one place.

def experiment_name(cfg: Any) -> str:
    """The config's ``experiment_name``, else its file name."""
    return setting(cfg, "experiment_name") or (Path(cfg.filename).stem if cfg.filename else "run")


def run_seed(cfg: Any, seed: int | None) -> int:
    """``--seed``, else ``randomness.seed``, else the config's ``seed``, else 0."""
    if seed is not None:
        return seed
    randomness = cfg.get("randomness") or {}
    return int(randomness.get("seed") if randomness.get("seed") is not None else setting(cfg, "seed") or 0)


def accumulative_counts(cfg: Any) -> int:
    """Iterations per optimizer step."""
    return (cfg.get("optim_wrapper") or {}).get("accumulative_counts") or 1


def trains_on_pairs(cfg: Any) -> bool:
    """The training set is built by ``build_preference_dataset`` (DPO, ORPO, reward models)."""
    cfg = getattr(cfg, "_cfg_dict", cfg)  # a loaded Config is not a dict; its ConfigDict is
    dataset = ((cfg.get("train_dataloader") or {}).get("dataset") or {}) if isinstance(cfg, dict) else {}
    return isinstance(dataset, dict) and type_name(dataset.get("type")).endswith("build_preference_dataset")


def validation_enabled(cfg: Any) -> bool:
    """A ``val_dataloader`` is set, and -- in a config with PART 1's ``val_data_path`` / ``val_ratio`` --
    one of them gives it rows."""
    if cfg.get("val_dataloader") is None:
        return False
    if has_setting(cfg, "val_ratio") or has_setting(cfg, "val_data_path"):
        return bool(setting(cfg, "val_data_path") or setting(cfg, "val_ratio"))
    return True
