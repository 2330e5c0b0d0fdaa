"""KTO (Kahneman-Tversky optimisation) of Qwen2.5-7B-Instruct with LoRA (bf16 base weights + adapter)
on KTO-mix-14k (trl-lib/kto-mix-14k: 13,500 unpaired completions, each labelled desirable or not), 1 epoch.

At a glance: LoRA KTO | 7.6B | KTO-mix-14k, 13.5k labelled completions (hub) | one 40 GB GPU

KTO trains on thumbs-up/down data: one completion per row, no pairs. Each micro-batch also scores
every prompt with another row's completion, the KL baseline of the loss (docs/preference.md), so a
micro-batch holds at least 2 rows.

Memory (estimate): 7.6B params x 2 bytes (bf16) = 15.2 GB, plus the adapter, its Adam state and
activations (4 rows of up to 2048 tokens, each with its KL sequence beside it, gradient
checkpointing): one 40 GB GPU. The reference model is the same base with the adapter switched
off: no second copy.

    sfttool train qwen2_5_7b_instruct_lora_kto_mix14k_e1
    sfttool copy-cfg qwen2_5_7b_instruct_lora_kto_mix14k_e1 .   # an editable copy

To start from an SFT run: merge its adapter into the base first (`sfttool merge`) and point
`pretrained_model_name_or_path` at the merged folder (see docs/preference.md).
"""

from mmengine.config import read_base
from mmengine.dataset import DefaultSampler
from mmengine.hooks import CheckpointHook
from mmengine.optim import AmpOptimWrapper, CosineAnnealingLR, LinearLR
from torch.optim import AdamW
from transformers import AutoModelForCausalLM, AutoTokenizer

from sfttool.dataset import build_kto_dataset
from sfttool.dataset.collate_fns import kto_collate_fn
from sfttool.dataset.data_path import load_data_path
from sfttool.engine.hooks import EvaluateChatHook, ThroughputHook
from sfttool.engine.runner import TrainLoop
from sfttool.model import KTO
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

# Data: data_path is a hub name, or a local .json/.jsonl/.csv/.parquet file, a folder or a glob.
# Each row: a prompt (a conversation ending with a user message, or a string), a completion (one
# assistant message, or a string) and a label (true: desirable, false: undesirable).
data_path = 'trl-lib/kto-mix-14k'
data_split = 'train'         # the split holding the rows ('train' for a local file)
dataset_map_fn = None        # rows are in the KTO format already; a map fn writes prompt/completion/label
prompt_template = PROMPT_TEMPLATE.qwen_chat
max_length = 2048            # tokens per example (prompt + completion); longer completions are cut, counted

# KTO
beta = 0.1                   # KL strength: smaller lets the policy move further from the reference
desirable_weight = 1.0       # raise the weight of the rarer kind of example, so both weigh alike
undesirable_weight = 1.0

# Scheduler & optimizer
batch_size = 4               # examples per device per iteration: at least 2 (the KL baseline)
accumulative_counts = 8      # iterations (micro-batches) per optimizer step
# => 4 x 8 = 32 examples per optimizer step per GPU
dataloader_num_workers = 0
max_epochs = 1
lr = 5e-6
betas = (0.9, 0.999)
weight_decay = 0
max_norm = 1                 # gradient clipping
warmup_ratio = 0.1           # warm-up over the first 10% of iterations
seed = 42

# Save
save_steps = 256             # a checkpoint every 256 iterations = 32 optimizer steps (a step boundary)
save_total_limit = 2         # keep the newest 2 (-1 keeps all)

# Logging: the loss, kl, rewards/chosen and rewards/rejected of an optimizer step, at the end of each
# step that holds a multiple of log_interval iterations (here every step)
log_interval = 8

# Tracking: 'auto' is TensorBoard when it is installed (pip install 'sfttool[tensorboard]'), else none
# (the run's summary says which); or a list of 'tensorboard', 'wandb', 'mlflow', [] for none.
# Every run also writes work_dir/loss.png; `sfttool plot WORK_DIR` draws it for any run.
report_to = 'auto'

# Sample generations during training
evaluation_freq = 500        # every 500 iterations, plus before and after training
evaluation_max_new_tokens = 600   # tokens per sample answer; on a CPU, 40-60 keeps each evaluation short
SYSTEM = ''
evaluation_inputs = ['Can you explain what a large language model is, briefly?',
                     'Please tell me five scenic spots in Shanghai']

###############################################################################
#                      PART 2  Model & Tokenizer                              #
###############################################################################
tokenizer = dict(
    type=AutoTokenizer.from_pretrained,
    pretrained_model_name_or_path=pretrained_model_name_or_path,
    trust_remote_code=False,
    padding_side='right')

model = dict(
    type=KTO,
    beta=beta,
    desirable_weight=desirable_weight,
    undesirable_weight=undesirable_weight,
    llm=dict(
        type=AutoModelForCausalLM.from_pretrained,
        pretrained_model_name_or_path=pretrained_model_name_or_path,
        trust_remote_code=False,
        dtype='bfloat16'),
    lora=lora_config)                  # r=64, alpha=16, every linear layer but the head

###############################################################################
#                      PART 3  Dataset & Dataloader                           #
###############################################################################
# One example per row, in file order (the sampler shuffles); no validation: KTO's held-out loss would
# depend on the micro-batch each example lands in (its KL baseline).
train_dataset = dict(
    type=build_kto_dataset,
    dataset=dict(type=load_data_path, path=data_path),
    split=data_split,
    tokenizer=tokenizer,
    max_length=max_length,
    dataset_map_fn=dataset_map_fn,
    prompt_template=prompt_template)

train_dataloader = dict(
    batch_size=batch_size,
    num_workers=dataloader_num_workers,
    dataset=train_dataset,
    sampler=dict(type=DefaultSampler, shuffle=True, seed=seed),
    collate_fn=dict(type=kto_collate_fn, max_length=max_length))

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

train_cfg = dict(type=TrainLoop, max_epochs=max_epochs)

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
# (each step's kl and rewards beside the loss) and the checkpoint hook depend on this run's settings.
default_hooks = dict(
    base_hooks,
    logger=dict(base_hooks['logger'], interval=log_interval),
    checkpoint=dict(type=CheckpointHook, by_epoch=False, interval=save_steps,
                    max_keep_ckpts=save_total_limit))

randomness = dict(seed=seed, deterministic=False)
# env_cfg, visualizer, log_level, load_from, resume, log_processor: _base_/runtime.py
