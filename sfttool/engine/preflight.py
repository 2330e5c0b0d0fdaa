"""Everything a run checks or decides before it builds anything expensive: the
config, the DeepSpeed JSON, the work dir, ``--resume``, the seed, the model's
dtype on a machine without a GPU, the template against the tokenizer, and (once
the data is built) that its token ids fit the model. Each check fails with one
line naming the key or path and the fix.
"""
from __future__ import annotations

import copy
import logging
import os
from pathlib import Path
from typing import Any

from sfttool.config import ConfigError, validate_config

# On a machine without a GPU a half-precision model is loaded in float32 unless this is set to 1.
CPU_HALF_PRECISION_ENV = "SFTTOOL_CPU_HALF_PRECISION"


def warn(message: str) -> None:
    """One warning line, to the terminal and the run's log file."""
    from mmengine.logging import print_log

    print_log(message, logger="current", level=logging.WARNING)


def announce_config(config: str) -> None:
    """Configs are Python and are executed: say which file, before running it."""
    from sfttool.config import find_config

    if os.environ.get("RANK", "0") == "0":
        print(f"[sfttool] executing config {find_config(config)}", flush=True)


def check_config(cfg: Any) -> None:
    """Every problem of the merged config at once, before anything is built."""
    from sfttool.engine.tracking import check_trackers

    errors = validate_config(cfg, cfg.filename)
    if errors:
        raise ConfigError("the config has problems:\n  " + "\n  ".join(errors))
    check_trackers(cfg)
    from sfttool.registry import type_name
    if type_name((cfg.get("train_cfg") or {}).get("type")) == "GRPOLoop":  # its rounds fit its steps
        from sfttool.engine.grpo_loop import check_loop_config
        check_loop_config(cfg)  # report_to's packages: one line naming the extra to install


def remote_code_policy(cfg: Any, trust_remote_code: bool) -> None:
    """trust_remote_code is off unless the config or --trust-remote-code asks; warn when on
    (on stderr, before any logger exists: a refused work dir still shows it first)."""
    import warnings

    from sfttool.engine.safety import apply_trust_remote_code, remote_code_warning

    allowed = apply_trust_remote_code(cfg, trust_remote_code)
    if allowed:
        warnings.warn(remote_code_warning(allowed), stacklevel=2)


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


def run_seed(cfg: Any, seed: int | None) -> int:
    """``--seed``, else ``randomness.seed``, else the config's ``seed``, else 0."""
    if seed is not None:
        return seed
    randomness = cfg.get("randomness") or {}
    return int(randomness.get("seed") if randomness.get("seed") is not None else cfg.get("seed", 0) or 0)


# ---------------------------------------------------------------------------
# The model's dtype on a machine without a GPU.

HALF = ("bfloat16", "float16")


def dtype_name(dtype: Any) -> str | None:
    """``'bfloat16'`` for 'bfloat16', 'torch.bfloat16' or torch.bfloat16; None when unset."""
    return None if dtype is None else str(dtype).replace("torch.", "")


def configured_dtype(model_cfg: Any) -> str | None:
    """The dtype the config loads the LLM in (``model.llm.dtype``, or transformers 4's ``torch_dtype``)."""
    llm = (model_cfg or {}).get("llm") if isinstance(model_cfg, dict) else None
    if not isinstance(llm, dict):
        return None
    return dtype_name(llm.get("dtype", llm.get("torch_dtype")))


def model_cfg_for_device(model_cfg: Any, on_gpu: bool) -> tuple[Any, str | None]:
    """``(model config to build, note for the log)``. Without a GPU a bfloat16/float16 model trains
    in float32: CPUs run half-precision matmuls about 2x slower (measured: 50.5 s against 27.7 s per
    step), and the optimizer wrapper already falls back to float32. ``SFTTOOL_CPU_HALF_PRECISION=1``
    keeps the config's dtype. The config itself is unchanged, so what the run dumps (and ``convert``
    or the export) keeps the dtype it named."""
    dtype = configured_dtype(model_cfg)
    if on_gpu or dtype not in HALF:
        return model_cfg, None
    if os.environ.get(CPU_HALF_PRECISION_ENV) == "1":
        return model_cfg, (f"no GPU: training in {dtype} as the config asks ({CPU_HALF_PRECISION_ENV}=1); "
                           "float32 is about 2x faster on CPU")
    changed = copy.deepcopy(model_cfg)
    llm = changed["llm"]
    llm.pop("torch_dtype", None)
    llm["dtype"] = "float32"
    return changed, (f"no GPU: the model is loaded in float32, not the config's {dtype} (about 2x faster on "
                     f"CPU); the export is saved in {dtype}. Set {CPU_HALF_PRECISION_ENV}=1 to train in {dtype}")


# ---------------------------------------------------------------------------
# Checks of what was built.

def template_problems(cfg: Any) -> list[str]:
    """What ``check-custom-dataset`` finds wrong with the template for this tokenizer: markers that
    are not special tokens, a render that differs from the tokenizer's own chat_template."""
    from sfttool.dataset.resolve import template_of
    from sfttool.registry import build_if_config
    from sfttool.tools.check_dataset import (Findings, check_against_chat_template, check_markers,
                                             dataset_node, is_process_hf_dataset)

    node = dataset_node(cfg)
    if not is_process_hf_dataset(node) or node.get("template_map_fn") is None:
        return []
    template = template_of(node["template_map_fn"])
    if template is None:
        return []
    findings = Findings(lambda message: None)
    tokenizer = build_if_config(node["tokenizer"], "train_dataloader.dataset.tokenizer")
    check_against_chat_template(template, tokenizer, findings)  # first: it names the first differing text
    check_markers(template, tokenizer, findings)
    return findings.warnings


def check_template(cfg: Any, strict: bool) -> None:
    """The template check of ``check-custom-dataset``, where the user trains: a warning, or with
    ``--strict`` an error (a template of another model family trains a format the model never saw)."""
    problems = template_problems(cfg)
    if problems and strict:
        first = problems[0].replace(":\n  ", "; ").replace("\n  ", "; ")
        raise ConfigError(f"{cfg.filename}: {first} (--strict; without it this is a warning)")
    for problem in problems:
        warn(problem)


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
