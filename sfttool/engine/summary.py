"""The run's one-paragraph summary: what is trained, on what, for how long, and
where the outputs go. Printed on rank 0 before the first iteration and kept in
the run's log file; with ``--verbose`` the full config and hook table follow it.

    Training ./models/smollm2 with LoRA (r=8) in float32 on CPU (2 threads): 0.92 M of 135.4 M
    parameters trained (0.68 %). LoRA on down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj.
    Data: 57 rows, 9,120 tokens; about 2,560 tokens per optimizer step
    (batch 1 x 16 accumulation x 1 process). 57 iterations = 4 optimizer steps = 1 epoch. Outputs in
    ./work_dirs/demo (checkpoints, log, config); the adapter goes to ./work_dirs/demo/hf_adapter.
"""
from __future__ import annotations

import os
from typing import Any

from sfttool.engine.assemble import iters_per_epoch, total_iters, train_loop_cfg
from sfttool.engine.spec import RunSpec
from sfttool.engine.tracking import auto_tracking_note
from sfttool.model.vision import trained_parts
from sfttool.parallel.sampler import shares_rows_by_group


def count_parameters(model: Any) -> tuple[int, int]:
    """(trained, total) parameters, 4-bit and ZeRO-3-partitioned weights at their full size."""
    from sfttool.engine.hooks.throughput_hook import logical_numel

    trained = total = 0
    for param in model.parameters():
        n = logical_numel(param)
        total += n
        trained += n if param.requires_grad else 0
    return trained, total


def dataset_tokens(dataset: Any) -> int | None:
    """Tokens in the built dataset, or None when it is not a table of ``input_ids`` (a stream)."""
    import pyarrow.compute as pc

    if "input_ids" not in (getattr(dataset, "column_names", None) or []):
        return None
    ids = dataset.select_columns(["input_ids"]).with_format("arrow")[:]["input_ids"]
    return int(pc.sum(pc.list_value_length(ids)).as_py() or 0)


def method(cfg: Any, model: Any) -> str:
    llm = (cfg.get("model") or {}).get("llm") or {}
    if not getattr(model, "use_lora", False):
        return "full fine-tuning"
    rank = ((cfg.get("model") or {}).get("lora") or {}).get("r")
    name = "QLoRA" if isinstance(llm, dict) and llm.get("quantization_config") is not None else "LoRA"
    return f"{name} (r={rank})" if rank is not None else name


def lora_targets(model: Any) -> str:
    """`` LoRA on q_proj, v_proj.`` (what the adapters sit on), or '' without LoRA."""
    from sfttool.model.lora import target_summary

    llm = getattr(model, "llm", None)
    if not getattr(model, "use_lora", False) or not hasattr(llm, "peft_config"):
        return ""
    return f" LoRA on {target_summary(llm)}."


def _millions(n: int) -> str:
    return f"{n / 1e6:.2f} M"


def model_source(cfg: Any, model: Any) -> str:
    """The model's name or folder as the config gives it; where the config builds the folder
    (``dict(type=export_smollm2)``), the folder it was loaded from."""
    llm = (cfg.get("model") or {}).get("llm") or {}
    source = llm.get("pretrained_model_name_or_path") if isinstance(llm, dict) else None
    if isinstance(source, (str, os.PathLike)):
        return str(source)
    loaded = getattr(getattr(model, "llm", None), "name_or_path", None)  # peft forwards it to the base model
    return str(loaded) if loaded else "the model"


def plural(count: int | float, noun: str, text: str | None = None) -> str:
    """``plural(1, 'step')`` -> ``'1 step'``, ``plural(1200, 'step')`` -> ``'1,200 steps'``."""
    shown = text if text is not None else f"{count:,}"
    return f"{shown} {noun}{'' if count == 1 else 's'}"


def for_people(value: float) -> str:
    """One decimal; two significant digits below 0.05, so a short run is not 0.

    >>> [for_people(v) for v in (3.0, 0.0952381, 2.46, 0.0125)]
    ['3', '0.1', '2.5', '0.013']
    """
    return f"{round(value, 1):g}" if round(value, 1) else f"{value:.2g}"


def run_length(iterations: int, full: int, accum: int, per_epoch: int) -> str:
    """``57 iterations = 4 optimizer steps = 3 epochs``: the steps this run takes (the full run's last
    may be short; a run stopped early takes only its whole ones).

    >>> run_length(1, 168, 16, 84)
    '1 iteration = 0 optimizer steps (16 iterations make one) = 0.012 epochs'
    """
    steps = -(-iterations // accum) if iterations >= full else iterations // accum
    text = f"{plural(iterations, 'iteration')} = {plural(steps, 'optimizer step')}"
    if steps == 0:
        text += f" ({accum} iterations make one)"
    epochs = iterations / per_epoch
    return f"{text} = {plural(epochs, 'epoch', for_people(epochs))}"


def summary_text(cfg: Any, model: Any, dataset: Any, spec: RunSpec) -> str:
    import torch

    from sfttool.model.hf_folder import export_folder_name

    source = model_source(cfg, model)
    dtype = next((str(p.dtype).replace("torch.", "") for p in model.parameters() if p.is_floating_point()), "?")
    device = "GPU" if torch.cuda.is_available() else f"CPU ({plural(torch.get_num_threads(), 'thread')})"
    trained, total = count_parameters(model)
    batch, accum, world_size = spec.batch_size, spec.accumulation, spec.world_size
    rows, tokens = len(dataset), dataset_tokens(dataset)
    per_epoch = iters_per_epoch(cfg, spec, dataset)
    full = total_iters(train_loop_cfg(cfg), per_epoch)
    iterations = spec.this_run_iters(full)
    # The ranks of one sequence-parallel group share each row: rows per step grow with the groups.
    sp = spec.sequence_parallel_size
    groups = max(world_size // sp, 1)
    processes = f"{world_size} process{'es' if world_size != 1 else ''}"
    if sp > 1:
        processes = f"{groups} data-parallel group{'s' if groups != 1 else ''} of {sp} sequence-parallel processes"
    data = f"Data: {rows:,} rows"
    if tokens is not None and rows:
        per_step = tokens / rows * batch * accum * groups
        data += (f", {tokens:,} tokens; about {per_step:,.0f} tokens per optimizer step "
                 f"(batch {batch} x {accum} accumulation x {processes})")
    repeated = repeated_rows(cfg, rows, groups)
    if repeated:
        data += (f"; the sampler repeats {plural(repeated, 'row')} each epoch so that the {groups} data-parallel "
                 "processes read as many (round_up=True)")
    steps = run_length(iterations, full, accum, per_epoch)
    if iterations < full:
        steps += f" of the run's {full:,} iterations" + (" (--dry-run)" if spec.dry_run else " (--max-steps)")
    outputs = (f"Dry run: nothing is saved (checked {spec.work_dir})" if spec.dry_run else
               f"Outputs in {spec.work_dir} (checkpoints, log, config); the "
               f"{'adapter' if getattr(model, 'use_lora', False) else 'model'} goes to "
               f"{spec.work_dir / export_folder_name(model)}")
    return (f"Training {source} with {method(cfg, model)} in {dtype} on {device}: {_millions(trained)} of "
            f"{_millions(total)} parameters trained ({100 * trained / max(total, 1):.2f} %).{lora_targets(model)}{trained_parts_note(model)} "
            f"{data}. {steps}. {outputs}.{auto_tracking_note(cfg)}")


def repeated_rows(cfg: Any, rows: int, replicas: int) -> int:
    """The rows the training sampler reads twice each epoch so that every data-parallel process reads as many:
    mmengine's ``DefaultSampler`` (and ``SequenceParallelSampler``) with ``round_up=True``, the default,
    takes the first rows of the epoch's order again. 0 for another sampler, whose sharing is its own."""
    sampler = dict(cfg.get("train_dataloader", {}).get("sampler") or {})
    if replicas <= 1 or not rows or not sampler.get("round_up", True):
        return 0
    if not shares_rows_by_group(sampler.get("type", "DefaultSampler")):
        return 0
    return -(-rows // replicas) * replicas - rows


def trained_parts_note(model: Any) -> str:
    """A vision-language checkpoint's sentence on what trains of each part, e.g. ' Vision tower (0.03 M):
    frozen; projector (0.01 M): full; language model (0.20 M): LoRA.'; '' for a text model."""
    parts = trained_parts(model.llm) if hasattr(model, "llm") else {}
    if not parts:
        return ""
    text = "; ".join(f"{part} ({_millions(size)}): {mode}" for part, (mode, size) in parts.items())
    return f" {text[0].upper()}{text[1:]}."


def announce_summary(runner: Any, cfg: Any, model: Any, dataset: Any, spec: RunSpec) -> None:
    """Log the summary (the log file keeps it); print it when the terminal shows no INFO lines."""
    from mmengine.dist import is_main_process

    from sfttool import compat

    text = summary_text(cfg, model, dataset, spec)
    runner.logger.info(text)
    if is_main_process() and not compat.console_is_verbose():
        print(f"[sfttool] {text}", flush=True)
