"""Every rule of a run that ties settings together, in one module: checked before any process group,
dataset or model exists, and every problem reported at once.

    report(run_checks(cfg, options, world_size))     # raises when the run cannot start

What each rule compares: the config's own keys (``config.validate``: required keys, argument names,
data files); the trackers ``report_to`` names against what is installed; a preference config's validation
(its loader, loss type and evaluator); each dataset builder's settings against each other (its own checks, run early);
``sequence_parallel_size`` against the sampler, validation, a streamed dataset, the model
type and the number of processes; the ``--deepspeed`` preset against the optimizer wrapper and the
batch; ``--resume`` against the work dir and ``--deepspeed``; the work dir itself (checked last: it is
created then, so a refused run leaves none); and, as a warning, the checkpoint interval against the
accumulation.

Three rules need what is built, and run where it first exists (``engine.train``): the model's
attention heads against ``sequence_parallel_size`` (``check_built_model``), the data's token ids
against the embedding table (``preflight.check_vocabulary``) and the template against the tokenizer
(``preflight.check_template``).

With ``--nproc-per-node`` the launching process checks once, for the planned number of processes; the
processes it starts do not report again (``CHECKED_BY_LAUNCHER``).
"""
from __future__ import annotations

import copy
import inspect
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from sfttool.config import ConfigError, validate_config
from sfttool.config.arguments import typed_nodes
from sfttool.config.settings import setting
from sfttool.dataset.data_sources import process_data_sources
from sfttool.dataset.settings import LAZY_SETTINGS, check_lazy_settings
from sfttool.dataset.pipeline import check_settings as check_pipeline_settings
from sfttool.dataset.pipeline import process_hf_dataset
from sfttool.dataset.prompts import validation_problems as prompt_validation_problems
from sfttool.dataset.errors import DatasetError
from sfttool.dataset.source_stages import check_sources
from sfttool.dataset.streaming_sources import StreamingDataSources, stream_problems
from sfttool.dataset.streaming import StreamingPackedDataset, refuse_changed_results
from sfttool.dataset.streaming import check_settings as check_stream_settings
from sfttool.engine.deepspeed import deepspeed_config
from sfttool.engine.grpo_loop import check_loop_config
from sfttool.engine.launch import CHECKED_BY_LAUNCHER
from sfttool.engine.preflight import check_work_dir, resolve_resume, resolve_work_dir, warn
from sfttool.engine.spec import TrainOptions, accumulative_counts, trains_on_pairs, validation_enabled
from sfttool.engine.tracking import check_trackers
from sfttool.errors import SfttoolError
from sfttool.model import moe
from sfttool.model.sft import SupervisedFinetune
from sfttool.model.vision import base_model, is_vision_language
from sfttool.parallel.groups import SequenceParallelError, check_world_size
from sfttool.parallel.sampler import shares_rows_by_group
from sfttool.registry import ConfigBuildError, resolve_type, type_name


@dataclass
class Findings:
    errors: list[SfttoolError] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def run_checks(cfg: Any, options: TrainOptions, world_size: int) -> Findings:
    """Every rule that can be checked before anything is built, for ``world_size`` processes."""
    found = Findings()
    found.errors += [ConfigError(line) for line in validate_config(cfg, cfg.filename)]
    _collect(found.errors, check_trackers, cfg)
    found.errors += [ConfigError(line) for line in preference_validation_problems(cfg, cfg.filename)]
    found.errors += [ConfigError(line) for line in prompt_validation_problems(cfg, cfg.filename)]
    if type_name((cfg.get("train_cfg") or {}).get("type")) == "GRPOLoop":  # its rounds fit its steps
        _collect(found.errors, check_loop_config, cfg)
    found.errors += dataset_setting_problems(cfg)
    found.errors += [ConfigError(line) for line in stream_sampler_problems(cfg) + lazy_validation_problems(cfg)]
    found.errors += sequence_parallel_problems(cfg, world_size)
    found.errors += router_aux_loss_problems(cfg)
    _collect(found.errors, check_lora_targets, cfg)
    if options.deepspeed:
        _collect(found.errors, deepspeed_config, options.deepspeed, cfg, world_size=world_size)
    work_dir = resolve_work_dir(cfg, options.work_dir)
    _collect(found.errors, resolve_resume, options.resume, work_dir, options.deepspeed)
    if not found.errors:  # only now: checking the work dir creates it (a dry run's is removed again)
        _collect(found.errors, check_work_dir, work_dir, options.resume, not options.dry_run)
    found.warnings += [w for w in (checkpoint_interval_warning(cfg),) if w]
    return found


def report(found: Findings) -> None:
    """The warnings, then the errors: one as it is, several as one error listing each."""
    for warning in found.warnings:
        warn(warning)
    if len(found.errors) == 1:
        raise found.errors[0]
    if found.errors:
        nested = ("\n    ".join(line.strip() for line in str(e).splitlines()) for e in found.errors)
        raise ConfigError("the run has problems:\n  " + "\n  ".join(nested))


def checked_by_launcher() -> bool:
    return os.environ.get(CHECKED_BY_LAUNCHER) == "1"


def _collect(errors: list, check: Callable, *args: Any, **kwargs: Any) -> None:
    """Run a check that raises its one problem; keep the problem."""
    try:
        check(*args, **kwargs)
    except SfttoolError as exc:
        errors.append(exc)


# ---------------------------------------------------------------------------
# The rules.

def preference_validation_problems(cfg: Any, path: str) -> list[str]:
    """A preference config's validation: PART 1's ``val_ratio`` / ``val_data_path`` need a ``val_dataloader``
    to act on; ``KTO`` and ``kto_pair`` cannot give a held-out loss (its KL baseline is a micro-batch mean, so the loss
    of a pair depends on the batch it is in); the evaluator is the pairs' (``PairValMetric``), not SFT's
    token loss. One line each."""
    if type_name((cfg.get("model") or {}).get("type")).endswith("KTO") and validation_enabled(cfg):
        return [f"{path}: KTO has no held-out loss (its KL baseline is the mean over a micro-batch): set val_ratio = 0 "
                "and val_data_path = None (or val_dataloader = None)"]
    if not trains_on_pairs(cfg):
        return []
    problems = []
    asked = [k for k in ("val_ratio", "val_data_path") if cfg.get(k)]
    if asked and cfg.get("val_dataloader") is None:
        problems.append(f"{path}: {', '.join(asked)}: the config has no val_dataloader to validate with; add the "
                        "validation lines of a built-in DPO config (val_dataloader, val_cfg, val_evaluator: see "
                        f"docs/preference.md) or remove {' and '.join(asked)}")
    if not validation_enabled(cfg):
        return problems
    if (cfg.get("model") or {}).get("loss_type") == "kto_pair":
        problems.append(f"{path}: model.loss_type='kto_pair' has no held-out loss (its KL baseline is the mean over "
                        "a micro-batch, so a pair's loss depends on its batch): set val_ratio = 0 and val_data_path "
                        "= None, or choose another loss_type")
    if type_name((cfg.get("val_evaluator") or {}).get("type")).endswith("ValLossMetric"):
        problems.append(f"{path}: val_evaluator: ValLossMetric measures the SFT token loss; a preference run "
                        "validates with val_evaluator = dict(type=PairValMetric) (from sfttool.engine.validation)")
    return problems


def _check_pipeline(a: dict) -> None:
    check_pipeline_settings(a["max_length"], a["pack_to_max_length"], a["use_varlen_attn"], a["pack_strategy"],
                            a["with_image_token"], a["max_dataset_length"])
    check_lazy_settings(a["lazy_encode"], {name: a[name] for name in LAZY_SETTINGS}, a["rename_maps"],
                        a["do_dataset_tokenization"], a["pack_strategy"])


def _check_stream(a: dict) -> None:
    refuse_changed_results(a["max_dataset_length"], a["rename_maps"], a["do_dataset_tokenization"])
    check_stream_settings(a["max_length"], a["buffer_size"], a["encode_chunk"], a["rows_per_epoch"],
                          a["pack_to_max_length"], a["use_varlen_attn"], a["pack_strategy"], a["with_image_token"])


def _check_sources(a: dict) -> None:
    check_pipeline_settings(a["max_length"], a["pack_to_max_length"], a["use_varlen_attn"], a["pack_strategy"], False)
    check_sources(a["data_sources"], a["mix_strategy"], a["mix_probabilities"], a["stopping_strategy"])


def _check_streamed_sources(a: dict) -> None:
    check_stream_settings(a["max_length"], a["buffer_size"], a["encode_chunk"], a["rows_per_epoch"],
                          a["pack_to_max_length"], a["use_varlen_attn"], a["pack_strategy"], False)
    problems = stream_problems(a["data_sources"], a["pack_per_source"]) if isinstance(a["data_sources"], list) else []
    if problems:
        raise DatasetError("\n".join(problems))
    check_sources(a["data_sources"], a["mix_strategy"], a["mix_probabilities"], a["stopping_strategy"])


# The dataset builders' own checks of their settings (run again when the dataset is built), and what they read.
_SETTINGS = ("max_length", "pack_to_max_length", "use_varlen_attn", "pack_strategy", "with_image_token",
             "max_dataset_length")
DATASET_SETTING_CHECKS = {
    process_hf_dataset: (_check_pipeline, _SETTINGS + ("lazy_encode", *LAZY_SETTINGS, "rename_maps",
                                                      "do_dataset_tokenization")),
    StreamingPackedDataset: (_check_stream, _SETTINGS + ("rename_maps", "do_dataset_tokenization", "buffer_size",
                                                         "encode_chunk", "rows_per_epoch")),
    process_data_sources: (_check_sources, ("max_length", "pack_to_max_length", "use_varlen_attn", "pack_strategy",
                                            "data_sources", "mix_strategy", "mix_probabilities",
                                            "stopping_strategy")),
    StreamingDataSources: (_check_streamed_sources, ("max_length", "pack_to_max_length", "use_varlen_attn",
                                                     "pack_strategy", "buffer_size", "encode_chunk", "rows_per_epoch",
                                                     "data_sources", "mix_strategy", "mix_probabilities",
                                                     "stopping_strategy", "pack_per_source")),
}


def dataset_setting_problems(cfg: Any) -> list[SfttoolError]:
    """The settings of every ``process_hf_dataset`` / ``StreamingPackedDataset`` node, checked now (with the
    builder's defaults for what the node leaves out) instead of once its dataset is built, after the process
    group exists. A setting the config builds lazily (a typed node) is left to the builder. A problem the
    validation set's copy of the settings repeats is said once, for the first key."""
    problems: dict[str, SfttoolError] = {}
    for key, node, fn, _ in typed_nodes(cfg):
        check, names = DATASET_SETTING_CHECKS.get(fn, (None, ()))
        defaults = {n: p.default for n, p in inspect.signature(fn).parameters.items()} if check else {}
        args = {name: node.get(name, defaults.get(name)) for name in names}
        if check is not None and not any(isinstance(v, dict) and "type" in v for v in args.values()):
            found: list[SfttoolError] = []
            _collect(found, check, args)
            for error in found:
                problems.setdefault(str(error), type(error)(f"{key}: {error}"))
    return list(problems.values())


def stream_sampler_problems(cfg: Any) -> list[str]:
    """A sampler on a streamed dataset (which reads its rows in its own seeded order): one line, else
    torch's DataLoader refuses it with a traceback once the model is built."""
    loader = cfg.get("train_dataloader") or {}
    kind = _type_of(loader.get("dataset"))
    if loader.get("sampler") is None:
        return []
    if _encodes_lazily(loader.get("dataset")):
        return ["train_dataloader.sampler: process_hf_dataset with lazy_encode=True reads its rows in its own "
                "seeded order (seed and epoch), as a stream does; set sampler=None"]
    if not _is_a(kind, torch.utils.data.IterableDataset):
        return []
    return [f"train_dataloader.sampler: {kind.__name__} is a stream, read in its own seeded order (set_epoch "
            "varies it per epoch); set sampler=None"]


def lazy_validation_problems(cfg: Any) -> list[str]:
    """A validation set encoded lazily (a train dataset node copied with its ``lazy_encode=True``): one line.
    Held-out rows are few and read whole at every evaluation: encoded once, eagerly."""
    loader = cfg.get("val_dataloader") or {}
    if not isinstance(loader, dict) or not _encodes_lazily(loader.get("dataset")):
        return []
    return ["val_dataloader.dataset: lazy_encode=True is for training data; the validation rows are encoded once, "
            "before training: set lazy_encode=False there, e.g. dataset=dict(train_dataset, lazy_encode=False, "
            "buffer_size=None, ...)"]


def _encodes_lazily(node: Any) -> bool:
    """A ``process_hf_dataset`` node with ``lazy_encode=True``: built, it is an iterable dataset."""
    return _type_of(node) is process_hf_dataset and node.get("lazy_encode") is True


def sequence_parallel_problems(cfg: Any, world_size: int) -> list[SfttoolError]:
    """``sequence_parallel_size`` against the sampler, validation, the dataset, the model and the
    number of processes."""
    size = setting(cfg, "sequence_parallel_size")
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        return [SequenceParallelError(f"sequence_parallel_size must be a positive integer (1: off), got {size!r}")]
    if size == 1:
        return []
    problems: list[SfttoolError] = []
    loader = cfg.get("train_dataloader") or {}
    if not shares_rows_by_group((loader.get("sampler") or {}).get("type")):
        problems.append(SequenceParallelError(
            f"sequence_parallel_size={size} needs train_dataloader.sampler = dict(type=SequenceParallelSampler, "
            "seed=None, shuffle=True) (from sfttool.parallel.sequence), so the ranks of a group read the same rows"))
    if validation_enabled(cfg):
        problems.append(SequenceParallelError(f"validation does not run with sequence_parallel_size={size}: "
                                              "set val_ratio = 0 and val_data_path = None (or val_dataloader = None)"))
    if _is_a(_type_of(loader.get("dataset")), torch.utils.data.IterableDataset):  # a stream shares rows by rank
        problems.append(SequenceParallelError(f"sequence_parallel_size={size} needs a map-style dataset: "
                                              "turn streaming off in train_dataloader.dataset"))
    elif _encodes_lazily(loader.get("dataset")):
        problems.append(SequenceParallelError(f"sequence_parallel_size={size} needs a map-style dataset: "
                                              "set lazy_encode=False in train_dataloader.dataset"))
    model = _type_of(cfg.get("model"))
    if isinstance(model, type) and not (issubclass(model, SupervisedFinetune)
                                        and (model.compute_loss is SupervisedFinetune.compute_loss
                                             or getattr(model, "trains_with_sequence_parallelism", False))):
        problems.append(SequenceParallelError(f"model.type={model.__name__} does not train with sequence "
                                              "parallelism (SupervisedFinetune and the preference models do): set "
                                              "sequence_parallel_size = 1"))
    _collect(problems, check_world_size, size, world_size)
    return problems


def router_aux_loss_problems(cfg: Any) -> list[SfttoolError]:
    """PART 1's ``router_aux_loss_coef``: a number >= 0, for a model trained by ``SupervisedFinetune``'s
    loss, whose config defines a router load-balancing loss (read from its ``config.json`` only)."""
    coef = setting(cfg, "router_aux_loss_coef")
    if coef is None:
        return []
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or coef < 0:
        return [ConfigError(f"router_aux_loss_coef must be a number >= 0 (0: leave the loss out), got {coef!r}")]
    model = _type_of(cfg.get("model"))
    if isinstance(model, type) and not (issubclass(model, SupervisedFinetune)
                                        and model.compute_loss is SupervisedFinetune.compute_loss):
        return [ConfigError(f"router_aux_loss_coef: model.type={model.__name__} does not add the router's "
                            "load-balancing loss (SupervisedFinetune does); remove router_aux_loss_coef")]
    config = _llm_config(cfg)
    if config is not None and getattr(config.get_text_config(), "router_aux_loss_coef", None) is None:
        return [ConfigError(f"router_aux_loss_coef={coef}: the model ({type(config).__name__}) has no router "
                            "load-balancing loss (a dense model, or an MoE balanced otherwise); remove the setting")]
    return []


def check_lora_targets(cfg: Any) -> None:
    """``model.lora``'s targets (or ``model.lora_targets``' choice) against the model's modules and
    parameters, on a copy of the model on the meta device (no weights: seconds even for a 30B model).
    Run for mixture-of-experts models and wherever the config names targets; the build checks again."""
    model, config = cfg.get("model") or {}, _llm_config(cfg)
    lora = model.get("lora") if isinstance(model, dict) else None
    if lora is None or config is None:
        return
    from sfttool.model.lora import build_lora_config, resolve_targets

    lora_config = build_lora_config(copy.deepcopy(lora))
    named = lora_config.target_modules is not None or lora_config.target_parameters
    which = model.get("lora_targets", "all")
    if not (named or which != "all" or _has_experts(config)):
        return
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            llm = AutoModelForCausalLM.from_config(config)
    except (ValueError, ImportError, TypeError):  # not a causal LM transformers can build: the build says
        return
    resolve_targets(llm, lora_config, which)


def _has_experts(config: Any) -> bool:
    text = config.get_text_config()
    return any(getattr(text, key, None) for key in ("num_experts", "num_local_experts", "n_routed_experts"))


def _llm_config(cfg: Any) -> Any:
    """The transformers config of ``model.llm`` when it names a model folder or hub id that resolves
    here (its ``config.json`` only), else None: the model build reports what is wrong."""
    llm = (cfg.get("model") or {}).get("llm")
    path = llm.get("pretrained_model_name_or_path") if isinstance(llm, dict) else None
    if not isinstance(path, (str, os.PathLike)):
        return None
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=bool(llm.get("trust_remote_code", False)))
    except (OSError, ValueError):
        return None


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


def check_built_model(model: Any, size: int) -> None:
    """What needs the built model: under sequence parallelism it is neither a mixture-of-experts model nor a
    vision-language checkpoint, and its attention heads (and key/value heads) divide among the ranks of a
    group."""
    if size == 1:
        return
    if moe.is_moe(model.llm):
        raise SequenceParallelError(f"sequence_parallel_size={size}: mixture-of-experts models do not train with "
                                    "sequence parallelism yet; set sequence_parallel_size = 1")
    if is_vision_language(model.llm):
        raise SequenceParallelError(f"sequence_parallel_size={size}: sequence parallelism is not available for "
                                    f"vision-language checkpoints ({type(base_model(model.llm)).__name__}) yet; "
                                    "set sequence_parallel_size = 1")
    config = model.llm.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % size or kv_heads % size:
        raise SequenceParallelError(f"sequence_parallel_size={size} must divide the model's attention heads "
                                    f"({heads}) and key/value heads ({kv_heads}): choose a divisor of both")


def _type_of(node: Any) -> Any:
    """The class or function a config node's ``type`` names, or None (unset, or unknown: the config
    check names it)."""
    kind = node.get("type") if isinstance(node, dict) else None
    if kind is None:
        return None
    try:
        return resolve_type(kind)
    except ConfigBuildError:
        return None


def _is_a(kind: Any, base: type) -> bool:
    return isinstance(kind, type) and issubclass(kind, base)
