"""What a run decides, or checks, on its own before it builds anything expensive: the
work dir and ``--resume`` (checked with the other rules by ``engine.checks``), the
seed, the model's dtype on a machine without a GPU, the template against the
tokenizer, and (once the data is built) that its token ids fit the model. Each
check fails with one line naming the key or path and the fix.
"""
from __future__ import annotations

import copy
import logging
import os
import warnings
from pathlib import Path
from typing import Any

from mmengine.logging import print_log

from sfttool.config import ConfigError, find_config
from sfttool.config.settings import setting
from sfttool.dataset.config_node import dataset_node, is_built_by, is_process_hf_dataset
from sfttool.dataset.data_sources import process_data_sources
from sfttool.dataset.resolve import template_of
from sfttool.dataset.template_check import template_warnings
from sfttool.engine.safety import WorkDirError, apply_trust_remote_code, check_work_dir_writable, remote_code_warning
from sfttool.model.build import configured_dtype
from sfttool.registry import build_if_config
from sfttool.utils.checkpoint_file import find_latest_checkpoint

# On a machine without a GPU a half-precision model is loaded in float32 unless this is set to 1.
CPU_HALF_PRECISION_ENV = "SFTTOOL_CPU_HALF_PRECISION"


def warn(message: str) -> None:
    """One warning line, to the terminal and the run's log file."""
    print_log(message, logger="current", level=logging.WARNING)


def announce_config(config: str) -> None:
    """Configs are Python and are executed: say which file, before running it."""
    if os.environ.get("RANK", "0") == "0":
        print(f"[sfttool] executing config {find_config(config)}", flush=True)


def remote_code_policy(cfg: Any, trust_remote_code: bool) -> None:
    """trust_remote_code is off unless the config or --trust-remote-code asks; warn when on
    (on stderr, before any logger exists: a refused work dir still shows it first)."""
    allowed = apply_trust_remote_code(cfg, trust_remote_code)
    if allowed:
        warnings.warn(remote_code_warning(allowed), stacklevel=2)


def resolve_work_dir(cfg: Any, work_dir: str | None) -> Path:
    """``--work-dir``, else the config's ``work_dir``, else ``./work_dirs/<config name>``."""
    return Path(work_dir or setting(cfg, "work_dir") or Path("work_dirs") / Path(cfg.filename).stem).resolve()


def check_work_dir(work_dir: Path, resume: str | None, keep: bool = True) -> None:
    """A writable folder, and without an earlier run's checkpoints unless ``--resume``
    continues it: a run started over would overwrite its ``iter_N.pth``,
    ``last_checkpoint``, dumped config and HF export. ``keep=False`` (a dry run, which
    saves nothing there): a folder the check had to create is removed again."""
    if work_dir.is_file():
        raise WorkDirError(f"work dir {work_dir} is a file, not a folder; choose another folder with --work-dir")
    check_work_dir_writable(work_dir, keep=keep)
    earlier = None if resume else find_latest_checkpoint(work_dir)
    if earlier is not None:
        raise WorkDirError(f"{work_dir} already holds checkpoints of an earlier run (newest: {earlier.name}); "
                           "pass --resume to continue it, or choose another --work-dir (or remove those checkpoints)")


def resolve_resume(resume: str | None, work_dir: Path, deepspeed: str | None = None) -> str | None:
    """``--resume`` (auto) -> the work dir's latest complete checkpoint; a path -> itself.
    Either must be of the kind ``--deepspeed`` loads: a folder with it, a file without."""
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


# ---------------------------------------------------------------------------
# The model's dtype on a machine without a GPU.

HALF = ("bfloat16", "float16")


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
    return model_cfg_in(model_cfg, "float32"), (
        f"no GPU: the model is loaded in float32, not the config's {dtype} (about 2x faster on CPU); the export "
        f"is saved in {dtype}. Set {CPU_HALF_PRECISION_ENV}=1 to train in {dtype}")


def model_cfg_in(model_cfg: Any, dtype: str | None, router_aux_loss_coef: float | None = None) -> Any:
    """``model_cfg`` loading the LLM in ``dtype`` and weighing an MoE router's load-balancing loss by
    PART 1's ``router_aux_loss_coef`` (None: the model's own): itself when it does already, else a
    changed copy."""
    new_dtype = dtype is not None and configured_dtype(model_cfg) != dtype
    if not new_dtype and router_aux_loss_coef is None:
        return model_cfg
    changed = copy.deepcopy(model_cfg)
    if new_dtype:
        llm = changed["llm"]
        llm.pop("torch_dtype", None)
        llm["dtype"] = dtype
    if router_aux_loss_coef is not None:
        changed["router_aux_loss_coef"] = router_aux_loss_coef
    return changed


# ---------------------------------------------------------------------------
# Checks of what was built.

def template_problems(cfg: Any) -> list[str]:
    """What ``check-custom-dataset`` finds wrong with the template for this tokenizer: a render that
    differs from the tokenizer's own chat_template, markers that are not special tokens."""
    node = dataset_node(cfg)
    takes_template = is_process_hf_dataset(node) or is_built_by(node, process_data_sources)
    if not takes_template or node.get("template_map_fn") is None:
        return []
    template = template_of(node["template_map_fn"])
    if template is None:
        return []
    tokenizer = build_if_config(node["tokenizer"], "train_dataloader.dataset.tokenizer")
    return template_warnings(template, tokenizer)


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
