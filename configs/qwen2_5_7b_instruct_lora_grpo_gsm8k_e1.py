"""GRPO (online RL from rewards) of Qwen2.5-7B-Instruct with LoRA (bf16 base weights + adapter)
on GSM8K's grade-school math word problems (openai/gsm8k, config 'main', 7,473 training
questions), 1 epoch. The reward is the final answer checked against GSM8K's (`accuracy`:
math-verify when installed, else a numeric comparison; see docs/rl.md).

At a glance: LoRA GRPO | 7.6B | GSM8K, 7.5k questions (hub) | one 40 GB GPU

Per process and generation round: 8 questions x 8 sampled completions = 64, trained in 8
micro-batches of 8 = one optimizer step (DAPO's token-mean loss, clip-higher, truncated
completions masked, no KL term and so no reference model). 7,473 questions / 8 per round = 934
rounds = 934 optimizer steps on one GPU.

Memory (estimate): 7.6B params x 2 bytes (bf16) = 15.2 GB, plus the adapter and its Adam state,
the KV cache of 64 generations of up to 512 + 768 tokens (~4.5 GB) and the activations of a
micro-batch (gradient checkpointing): one 40 GB GPU. Generation takes most of a step's time;
rollout_engine='vllm' (the `vllm` extra) makes it several times faster on GPUs.

    sfttool train qwen2_5_7b_instruct_lora_grpo_gsm8k_e1
    sfttool copy-cfg qwen2_5_7b_instruct_lora_grpo_gsm8k_e1 .   # an editable copy
"""

from mmengine.config import read_base
from mmengine.dataset import DefaultSampler
from mmengine.hooks import CheckpointHook
from mmengine.optim import AmpOptimWrapper, CosineAnnealingLR, LinearLR
from torch.optim import AdamW
from transformers import AutoModelForCausalLM, AutoTokenizer

from sfttool.dataset import build_prompt_dataset
from sfttool.dataset.collate_fns import prompt_collate_fn
from sfttool.dataset.data_path import load_data_path
from sfttool.dataset.map_fns import gsm8k_map_fn
from sfttool.engine.grpo_loop import GRPOLoop
from sfttool.engine.hooks import EvaluateChatHook, ThroughputHook
from sfttool.model import GRPO
from sfttool.utils import PROMPT_TEMPLATE

# Shared parts: the LoRA adapter and 4-bit settings (peft.py), hooks, environment
# and logging (runtime.py). `sfttool copy-cfg` copies them next to your copy.
with read_base():
    from ._base_.peft import *
    from ._base_.runtime import *

###############################################################################
#                          PART 1  Settings                                   #
###############################################################################
# Model
pretrained_model_name_or_path = 'Qwen/Qwen2.5-7B-Instruct'
use_varlen_attn = False   # True needs flash-attn; packed samples are isolated either way

# Data: data_path is a hub name, or a local .json/.jsonl/.csv/.parquet file, a folder or a glob
data_path = 'openai/gsm8k'
data_subset = 'main'         # the hub dataset's configuration (None for a local file)
data_split = 'train'
dataset_map_fn = gsm8k_map_fn    # question -> prompt; the number after '####' -> solution
prompt_template = PROMPT_TEMPLATE.hf_chat_template   # the model's own chat template + generation prompt
SYSTEM = 'Please reason step by step, and put your final answer within \\boxed{}.'
max_prompt_length = 512      # GSM8K's questions render to 60-250 tokens
prompt_overflow = 'error'    # or 'truncate' (keep the last max_prompt_length tokens) or 'drop'

# Rewards: functions, built-in names ('accuracy', 'format', 'length') or dotted paths
reward_funcs = ['accuracy']
reward_weights = [1.0]

# Sampling
num_generations = 8          # completions per prompt (the group)
generation_batch_size = 64   # completions per process per generation round: 8 prompts x 8
max_completion_length = 768
temperature = 1.0
top_p = 1.0
rollout_engine = 'hf'        # transformers' generate; 'vllm' on GPUs (pip install 'sfttool[vllm]')

# Reference and clipping
beta = 0.0                   # KL coefficient; 0: no reference model is kept or run
epsilon = 0.2
epsilon_high = 0.28          # DAPO's clip-higher: [1 - 0.2, 1 + 0.28]

# Optimisation
loss_type = 'dapo'           # or grpo, bnpo, dr_grpo
importance_sampling_level = 'token'   # or 'sequence' (GSPO)
scale_rewards = 'group'      # or 'batch', 'none'
mask_truncated_completions = True
num_iterations = 1           # μ: passes over each round's completions
batch_size = 8               # completions per micro-batch (forward + backward) per process
accumulative_counts = 8      # micro-batches per optimizer step
# => 8 x 8 = 64 completions per optimizer step = one generation round per process
max_packed_length = 4096     # tokens per packed row of a micro-batch (prompt + completion samples)
dataloader_num_workers = 0
max_epochs = 1
lr = 1e-5
betas = (0.9, 0.99)
weight_decay = 0
max_norm = 1                 # gradient clipping
warmup_ratio = 0.03
seed = 42

# Save
save_steps = 400             # a checkpoint every 400 iterations = 50 optimizer steps
save_total_limit = 2         # keep the newest 2 (-1 keeps all)

# Logging: every optimizer step (its reward, KL, lengths, clipped fraction); sampled completions
log_interval = accumulative_counts
log_completions_steps = 25   # every 25 optimizer steps: prompts, completions, rewards in the log
num_logged_prompts = 2

# Tracking: 'auto' is TensorBoard when it is installed (pip install 'sfttool[tensorboard]'), else none
# (the run's summary says which); or a list of 'tensorboard', 'wandb', 'mlflow', [] for none.
# Every run also writes work_dir/loss.png; `sfttool plot WORK_DIR` draws it for any run.
report_to = 'auto'

# Sample generations during training (greedy)
evaluation_freq = 2000       # every 2000 iterations, plus before and after training
evaluation_max_new_tokens = 512
evaluation_inputs = ['Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in '
                     'May. How many clips did Natalia sell altogether in April and May?']

###############################################################################
#                      PART 2  Model & Tokenizer                              #
###############################################################################
tokenizer = dict(
    type=AutoTokenizer.from_pretrained,
    pretrained_model_name_or_path=pretrained_model_name_or_path,
    trust_remote_code=False,
    padding_side='right')

model = dict(
    type=GRPO,
    tokenizer=tokenizer,
    reward_funcs=reward_funcs,
    reward_weights=reward_weights,
    num_generations=num_generations,
    max_completion_length=max_completion_length,
    temperature=temperature,
    top_p=top_p,
    rollout_engine=rollout_engine,
    beta=beta,
    epsilon=epsilon,
    epsilon_high=epsilon_high,
    loss_type=loss_type,
    importance_sampling_level=importance_sampling_level,
    scale_rewards=scale_rewards,
    mask_truncated_completions=mask_truncated_completions,
    max_packed_length=max_packed_length,
    use_varlen_attn=use_varlen_attn,
    llm=dict(
        type=AutoModelForCausalLM.from_pretrained,
        pretrained_model_name_or_path=pretrained_model_name_or_path,
        trust_remote_code=False,
        dtype='bfloat16'),
    lora=dict(lora_config, lora_dropout=0.0))   # r=64, alpha=16; no dropout: the sampling policy is the policy

###############################################################################
#                      PART 3  Dataset & Dataloader                           #
###############################################################################
train_dataset = dict(
    type=build_prompt_dataset,
    dataset=dict(type=load_data_path, path=data_path, name=data_subset),
    split=data_split,
    tokenizer=tokenizer,
    max_prompt_length=max_prompt_length,
    prompt_overflow=prompt_overflow,
    dataset_map_fn=dataset_map_fn,
    prompt_template=prompt_template,
    system=SYSTEM,
    seed=seed)

train_dataloader = dict(
    batch_size=generation_batch_size // num_generations,   # prompts per process per generation round
    num_workers=dataloader_num_workers,
    dataset=train_dataset,
    sampler=dict(type=DefaultSampler, shuffle=True, seed=seed),
    collate_fn=dict(type=prompt_collate_fn))

###############################################################################
#                    PART 4  Scheduler & Optimizer                            #
###############################################################################
optim_wrapper = dict(
    type=AmpOptimWrapper,       # bf16 autocast on a GPU; a plain float32 OptimWrapper on CPU, with a warning
    optimizer=dict(type=AdamW, lr=lr, betas=betas, weight_decay=weight_decay),
    clip_grad=dict(max_norm=max_norm, error_if_nonfinite=False),
    accumulative_counts=accumulative_counts,
    loss_scale='dynamic',
    dtype='bfloat16')

# Linear warm-up from lr x 1e-5 over the first warmup_ratio of the run, then cosine to 0.
# Bounds are in epochs (warmup_ratio x max_epochs), converted to iterations at run time.
param_scheduler = [
    dict(type=LinearLR, start_factor=1e-5, by_epoch=True, convert_to_iter_based=True,
         begin=0, end=warmup_ratio * max_epochs),
    dict(type=CosineAnnealingLR, eta_min=0.0, by_epoch=True, convert_to_iter_based=True,
         begin=warmup_ratio * max_epochs, end=max_epochs),
]

# One iteration is one micro-batch; a generation round is generation_batch_size / batch_size
# micro-batches, passed over num_iterations times.
train_cfg = dict(type=GRPOLoop, max_epochs=max_epochs, num_iterations=num_iterations, micro_batch_size=batch_size,
                 log_completions_steps=log_completions_steps, num_logged_prompts=num_logged_prompts)

###############################################################################
#                            PART 5  Runtime                                  #
###############################################################################
# Hooks of this run: sample generations every `evaluation_freq` iterations and before and
# after training, throughput in the log.
custom_hooks = [
    dict(type=EvaluateChatHook, tokenizer=tokenizer, every_n_iters=evaluation_freq,
         evaluation_inputs=evaluation_inputs, system=SYSTEM, prompt_template=prompt_template,
         max_new_tokens=evaluation_max_new_tokens),
    dict(type=ThroughputHook),
]

# Timer, lr scheduler and sampler-seed hooks come from _base_/runtime.py; the logger
# (each step's rewards beside the loss) and the checkpoint hook depend on this run's settings.
default_hooks = dict(
    base_hooks,
    logger=dict(base_hooks['logger'], interval=log_interval),
    checkpoint=dict(type=CheckpointHook, by_epoch=False, interval=save_steps,
                    max_keep_ckpts=save_total_limit))

randomness = dict(seed=seed, deterministic=False)
# env_cfg, visualizer, log_level, load_from, resume, log_processor: _base_/runtime.py
