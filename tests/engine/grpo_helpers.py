"""Online-RL test configs and what they load by dotted path (``grpo_helpers.X``): reward functions, hooks."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import torch
from mmengine.hooks import Hook

from engine_helpers import RUNTIME

GRPO_CONFIG = '''
from mmengine.dataset import DefaultSampler
from mmengine.hooks import CheckpointHook, IterTimerHook, LoggerHook, ParamSchedulerHook, DistSamplerSeedHook
from mmengine.optim import AmpOptimWrapper, CosineAnnealingLR, LinearLR
from peft import LoraConfig
from torch.optim import AdamW
from transformers import AutoModelForCausalLM, AutoTokenizer

from sfttool.dataset import build_prompt_dataset
from sfttool.dataset.collate_fns import prompt_collate_fn
from sfttool.dataset.data_path import load_data_path
from sfttool.dataset.map_fns import gsm8k_map_fn
from sfttool.engine.grpo_loop import GRPOLoop
from sfttool.model import GRPO

model_dir = {model_dir!r}
data_file = {data_file!r}
seed = 7
num_generations = {num_generations}
generation_batch_size = {generation_batch_size}   # completions per process per round
batch_size = {batch_size}                         # completions per micro-batch
accumulative_counts = {accumulative_counts}
num_iterations = {num_iterations}
max_epochs = {max_epochs}
lr = 5e-3

tokenizer = dict(type=AutoTokenizer.from_pretrained, pretrained_model_name_or_path=model_dir)
model = dict(
    type=GRPO, tokenizer=tokenizer, reward_funcs={reward_funcs}, num_generations=num_generations,
    max_completion_length=8, temperature=1.0, beta={beta}, loss_type={loss_type!r}, epsilon=0.2, epsilon_high=0.28,
    scale_rewards={scale_rewards!r},
    use_activation_checkpointing=False,
    llm=dict(type=AutoModelForCausalLM.from_pretrained, pretrained_model_name_or_path=model_dir, dtype='float32'),
    lora=dict(type=LoraConfig, r=8, lora_alpha=16, lora_dropout={dropout}, bias='none', task_type='CAUSAL_LM'))

train_dataset = dict(
    type=build_prompt_dataset, dataset=dict(type=load_data_path, path=data_file), tokenizer=tokenizer,
    max_prompt_length=64, dataset_map_fn=gsm8k_map_fn, seed=seed)
train_dataloader = dict(
    batch_size=generation_batch_size // num_generations, num_workers=0, dataset=train_dataset,
    sampler=dict(type=DefaultSampler, shuffle=True, seed=seed), collate_fn=dict(type=prompt_collate_fn))

optim_wrapper = dict(
    type=AmpOptimWrapper, dtype='bfloat16', loss_scale='dynamic',
    optimizer=dict(type=AdamW, lr=lr, betas=(0.9, 0.999), weight_decay=0),
    clip_grad=dict(max_norm=1, error_if_nonfinite=False), accumulative_counts=accumulative_counts)
param_scheduler = {scheduler}
train_cfg = dict(type=GRPOLoop, max_epochs=max_epochs, num_iterations=num_iterations, micro_batch_size=batch_size,
                 log_completions_steps=1, num_logged_prompts=8)
''' + RUNTIME


# Warm-up and cosine, in epochs (converted to iterations, so a schedule depends on the micro-batch split).
SCHEDULE = """[
    dict(type=LinearLR, start_factor=0.1, by_epoch=True, begin=0, end=0.1 * max_epochs, convert_to_iter_based=True),
    dict(type=CosineAnnealingLR, eta_min=0.0, by_epoch=True, begin=0.1 * max_epochs, end=max_epochs,
         convert_to_iter_based=True)]"""


def write_grpo_config(path: Path, model_dir, data_file, *, num_generations=4, generation_batch_size=8, batch_size=4,
                      accumulative_counts=2, num_iterations=1, max_epochs=0.5, beta=0.0, loss_type="dapo",
                      scale_rewards="group",
                      reward_funcs="['grpo_helpers.letter_e', 'accuracy']", dropout=0.0, save_steps=100, keep=2,
                      custom_hooks="[]", scheduler=SCHEDULE) -> Path:
    path.write_text(GRPO_CONFIG.format(
        model_dir=str(model_dir), data_file=str(data_file), num_generations=num_generations,
        generation_batch_size=generation_batch_size, batch_size=batch_size, accumulative_counts=accumulative_counts,
        num_iterations=num_iterations, max_epochs=max_epochs, beta=beta, loss_type=loss_type,
        scale_rewards=scale_rewards,
        reward_funcs=reward_funcs, dropout=dropout, save_steps=save_steps, keep=keep, custom_hooks=custom_hooks,
        scheduler=scheduler))
    return path


def addition_rows(n: int = 16) -> list[dict]:
    """GSM8K-style rows: "What is a plus b?" with the answer after ####."""
    import random
    rng = random.Random(0)
    rows = []
    for _ in range(n):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        rows.append({"question": f"What is {a} plus {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"})
    return rows


def letter_e(completions, **columns):
    """How often the letter e appears (a reward a random tiny model's completions differ in)."""
    return [c[0]["content"].count("e") / 4 for c in completions]


def constant_one(completions, **columns):
    return [1.0 for _ in completions]


def adapter(work_dir) -> dict:
    from safetensors.torch import load_file
    return load_file(Path(work_dir) / "hf_adapter" / "adapter_model.safetensors")


class InitialWeightsHook(Hook):
    """Before training, write the trainable weights to ``work_dir/initial_weights.pt``."""

    def before_train(self, runner):
        from sfttool.engine.runner import unwrap_model
        model = unwrap_model(runner.model)
        state = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        torch.save(state, os.path.join(runner.work_dir, "initial_weights.pt"))


class SigtermAt(Hook):
    """Send SIGTERM to this process while iteration ``at`` (1-based) runs, as a scheduler would."""

    def __init__(self, at: int):
        self.at = at

    def before_train_iter(self, runner, batch_idx, data_batch=None):
        if runner.iter + 1 == self.at:
            os.kill(os.getpid(), signal.SIGTERM)
