"""Hooks the engine tests put into configs (by dotted path: ``engine_helpers.X``)."""
from __future__ import annotations

import os
from pathlib import Path

import torch
from mmengine.hooks import Hook

TINY_CONFIG = '''
from datasets import load_dataset
from mmengine.dataset import DefaultSampler
from mmengine.hooks import CheckpointHook, IterTimerHook, LoggerHook, ParamSchedulerHook, DistSamplerSeedHook
from mmengine.optim import AmpOptimWrapper, CosineAnnealingLR, LinearLR
from peft import LoraConfig
from torch.optim import AdamW
from transformers import AutoModelForCausalLM, AutoTokenizer

from sfttool.dataset import process_hf_dataset
from sfttool.dataset.collate_fns import default_collate_fn
from sfttool.dataset.map_fns import template_map_fn_factory
from sfttool.engine.hooks import DatasetInfoHook, EvaluateChatHook, ThroughputHook
from sfttool.engine.runner import TrainLoop
from sfttool.model import SupervisedFinetune
from sfttool.utils import PROMPT_TEMPLATE

model_dir = {model_dir!r}
data_file = {data_file!r}
prompt_template = PROMPT_TEMPLATE.{template}
max_length = 128
batch_size = {batch_size}
accumulative_counts = {accumulative_counts}
max_epochs = {max_epochs}
lr = {lr}
seed = 7

tokenizer = dict(type=AutoTokenizer.from_pretrained, pretrained_model_name_or_path=model_dir)
model = dict(
    type=SupervisedFinetune,
    use_activation_checkpointing=False,
    llm=dict(type=AutoModelForCausalLM.from_pretrained, pretrained_model_name_or_path=model_dir,
             dtype={dtype!r}{quant}),
    lora={lora})

train_dataset = dict(
    type=process_hf_dataset,
    dataset=dict(type=load_dataset, path='json', data_files=data_file),
    tokenizer=tokenizer, max_length=max_length,
    template_map_fn=dict(type=template_map_fn_factory, template=prompt_template),
    pack_to_max_length=True, shuffle_before_pack=True, map_num_proc=1, seed=seed)

train_dataloader = dict(
    batch_size=batch_size, num_workers=0, dataset=train_dataset,
    sampler=dict(type=DefaultSampler, shuffle=True, seed=seed),
    collate_fn=dict(type=default_collate_fn))

optim_wrapper = dict(
    type=AmpOptimWrapper, dtype='bfloat16', loss_scale='dynamic',
    optimizer=dict(type=AdamW, lr=lr, betas=(0.9, 0.999), weight_decay=0),
    clip_grad=dict(max_norm=1, error_if_nonfinite=False),
    accumulative_counts=accumulative_counts)

param_scheduler = [
    dict(type=LinearLR, start_factor=1e-5, by_epoch=True, begin=0, end=0.03 * max_epochs,
         convert_to_iter_based=True),
    dict(type=CosineAnnealingLR, eta_min=0.0, by_epoch=True, begin=0.03 * max_epochs, end=max_epochs,
         convert_to_iter_based=True),
]
train_cfg = dict(type=TrainLoop, max_epochs=max_epochs)

'''

# The runtime part (PART 5 of a built-in config), shared by the test configs.
RUNTIME = '''
custom_hooks = {custom_hooks}
default_hooks = dict(
    timer=dict(type=IterTimerHook),
    logger=dict(type=LoggerHook, log_metric_by_epoch=False, interval=1),
    param_scheduler=dict(type=ParamSchedulerHook),
    sampler_seed=dict(type=DistSamplerSeedHook),
    checkpoint=dict(type=CheckpointHook, by_epoch=False, interval={save_steps}, max_keep_ckpts={keep}))
env_cfg = dict(cudnn_benchmark=False, mp_cfg=dict(mp_start_method='fork', opencv_num_threads=0),
               dist_cfg=dict(backend='nccl'))
log_processor = dict(by_epoch=False)
randomness = dict(seed=seed, deterministic=False)
'''
TINY_CONFIG += RUNTIME

LORA = "dict(type=LoraConfig, r=8, lora_alpha=16, lora_dropout={dropout}, bias='none', task_type='CAUSAL_LM')"
QUANT = (", quantization_config=dict(type='transformers.BitsAndBytesConfig', load_in_4bit=True, "
         "bnb_4bit_compute_dtype='float32', bnb_4bit_quant_type='nf4', bnb_4bit_use_double_quant=False)")


def write_config(path: Path, model_dir, data_file, *, batch_size=1, accumulative_counts=2, max_epochs=2,
                 lr=1e-3, lora=True, dropout=0.1, qlora=False, save_steps=8, keep=2,
                 custom_hooks="[]", dtype="float32", template="qwen_chat") -> Path:
    text = TINY_CONFIG.format(model_dir=str(model_dir), data_file=str(data_file), batch_size=batch_size,
                              accumulative_counts=accumulative_counts, max_epochs=max_epochs, lr=lr,
                              lora=LORA.format(dropout=dropout) if lora else "None",
                              quant=QUANT if qlora else "", save_steps=save_steps, keep=keep,
                              custom_hooks=custom_hooks, dtype=dtype, template=template)
    path.write_text(text)
    return path



def lockstep_config(path: Path, model_dir, data_file, custom_hooks: str = "") -> Path:
    """40 packed rows / 2 ranks = 20 iterations per rank (10 optimizer steps), checkpoints every 10
    iterations, dropout on; each rank dumps its weights at the end (``DumpWeightsHook``)."""
    hooks = f"[dict(type='engine_helpers.DumpWeightsHook'), {custom_hooks}]"
    return write_config(path, model_dir, data_file, max_epochs=1, lr=5e-3, save_steps=10, custom_hooks=hooks)


def two_ranks(deepspeed: str | None = None) -> list[str]:
    """The `sfttool train` flags of a two-process run (DDP, or DeepSpeed with that preset)."""
    return ["--nproc-per-node", "2", *(["--deepspeed", deepspeed] if deepspeed else [])]


class Interrupted(RuntimeError):
    """Raised by ``StopAfterIter`` to simulate a run killed after a checkpoint."""


class StopAfterIter(Hook):
    """Raise after iteration ``n`` (after the checkpoint hook has run)."""

    priority = "LOWEST"

    def __init__(self, n: int):
        self.n = n

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
        if runner.iter + 1 == self.n:
            raise Interrupted(f"stopped after iteration {self.n}")


class DumpWeightsHook(Hook):
    """After training, each rank writes its full trainable weights to
    ``work_dir/weights_rank<r>.pt`` (gathered first under ZeRO-3)."""

    priority = "LOWEST"

    def after_train(self, runner):
        import contextlib

        from mmengine.dist import get_rank

        from sfttool.engine.runner import unwrap_model

        model = unwrap_model(runner.model)
        params = [p for p in model.parameters()]
        engine = getattr(runner.model, "model", None)
        zero3 = callable(getattr(engine, "zero_optimization_partition_weights", None)) \
            and engine.zero_optimization_partition_weights()
        ctx = contextlib.nullcontext()
        if zero3:
            import deepspeed
            ctx = deepspeed.zero.GatheredParameters(params, modifier_rank=None)
        with ctx:
            state = {n: p.detach().clone().float().cpu() for n, p in model.named_parameters() if p.requires_grad}
        torch.save(state, os.path.join(runner.work_dir, f"weights_rank{get_rank()}.pt"))


def logged(work_dir, key: str = "loss") -> list[float]:
    """Values of ``key`` per logged optimizer step, from the newest run's ``vis_data/scalars.json``."""
    import json
    from pathlib import Path

    runs = sorted(p for p in Path(work_dir).glob("*/vis_data/scalars.json"))
    values = []
    for line in runs[-1].read_text().splitlines():
        record = json.loads(line)
        if key in record:
            values.append(record[key])
    return values


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


class ThroughputProbe(Hook):
    """Write ``work_dir/throughput_probe.json``: the parameters ThroughputHook
    counted, and each iteration's trained / processed token fraction, from its batch."""

    priority = "LOWEST"

    def before_train(self, runner):
        from sfttool.engine.hooks import ThroughputHook

        self.record = {"params": next(h.params for h in runner.hooks if isinstance(h, ThroughputHook)),
                       "trained_fraction": {}}

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
        data = data_batch["data"]
        fraction = int((data["labels"] != -100).sum()) / data["input_ids"].numel()
        self.record["trained_fraction"][runner.iter + 1] = fraction

    def after_train(self, runner):
        import json

        with open(os.path.join(runner.work_dir, "throughput_probe.json"), "w") as f:
            json.dump(self.record, f)


class TimeProbe(Hook):
    """Write ``work_dir/timed_iterations.txt``: how many iteration times the message hub averages
    at the end of the run (the logged ``time``)."""

    priority = "LOWEST"

    def after_train(self, runner):
        buffer = runner.message_hub.log_scalars["train/time"]
        Path(runner.work_dir, "timed_iterations.txt").write_text(str(len(buffer.data[0])))


class DtypeProbe(Hook):
    """Write ``work_dir/trained_dtype.txt``: the dtype of the LLM's weights during training."""

    def before_train(self, runner):
        from sfttool.engine.runner import unwrap_model

        param = next(unwrap_model(runner.model).llm.parameters())
        Path(runner.work_dir, "trained_dtype.txt").write_text(str(param.dtype))


class RecordBatches(Hook):
    """Write ``work_dir/batches_rank<r>.pt``: every micro-batch this rank trained on, in order
    (``input_ids``, ``labels``, ``position_ids``)."""

    priority = "LOWEST"

    def before_train(self, runner):
        self.batches = []

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
        data = data_batch["data"]
        self.batches.append({k: data[k].clone() for k in ("input_ids", "labels", "position_ids")})

    def after_train(self, runner):
        from mmengine.dist import get_rank

        torch.save(self.batches, os.path.join(runner.work_dir, f"batches_rank{get_rank()}.pt"))


def samples_of(batch: dict) -> list[dict]:
    """The samples of a collated micro-batch (``position_ids`` restart at 0 at each), without the
    padding pseudo-samples (nothing trained): ``[{input_ids, labels}]`` as lists."""
    samples = []
    for ids, labels, positions in zip(batch["input_ids"].tolist(), batch["labels"].tolist(),
                                      batch["position_ids"].tolist()):
        starts = [i for i, p in enumerate(positions) if p == 0] + [len(positions)]
        for a, b in zip(starts, starts[1:]):
            if any(label != -100 for label in labels[a + 1:b]):
                samples.append({"input_ids": ids[a:b], "labels": labels[a:b]})
    return samples


def transformers_loss(model_dir, samples: list[dict]) -> float:
    """transformers' own loss (the mean over every trained token) on one right-padded batch of
    ``samples``, unpacked: the reference for what a step of those samples logs."""
    from transformers import AutoModelForCausalLM

    llm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    width = max(len(s["input_ids"]) for s in samples)
    pad = [width - len(s["input_ids"]) for s in samples]
    ids = torch.tensor([s["input_ids"] + [0] * p for s, p in zip(samples, pad)])  # [batch, width]
    labels = torch.tensor([s["labels"] + [-100] * p for s, p in zip(samples, pad)])
    mask = torch.tensor([[1] * len(s["input_ids"]) + [0] * p for s, p in zip(samples, pad)])
    with torch.no_grad():
        return llm(input_ids=ids, attention_mask=mask, labels=labels).loss.item()
