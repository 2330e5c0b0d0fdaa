"""DPO (sigmoid loss) of Qwen2.5-7B-Instruct with LoRA (bf16 base weights + adapter)
on UltraFeedback (binarized, ~61k preference pairs, HuggingFaceH4/ultrafeedback_binarized,
split train_prefs), 1 epoch.

At a glance: LoRA DPO | 7.6B | UltraFeedback, ~61k pairs (hub) | one 40 GB GPU

Memory (estimate): 7.6B params x 2 bytes (bf16) = 15.2 GB, plus the adapter, its Adam
state and activations (one 4096-token row, gradient checkpointing): one 40 GB GPU.
The reference model is the same base with the adapter switched off: no second copy.
Each step runs the policy forward+backward and the reference forward (no graph) over the
packed row.

    sfttool train qwen2_5_7b_instruct_lora_dpo_ultrafeedback_e1
    sfttool copy-cfg qwen2_5_7b_instruct_lora_dpo_ultrafeedback_e1 .   # an editable copy

To start from an SFT run: merge its adapter into the base first (`sfttool merge`) and point
`pretrained_model_name_or_path` at the merged folder (see docs/preference.md).
"""

from mmengine.config import read_base
from mmengine.dataset import DefaultSampler
from mmengine.hooks import CheckpointHook
from mmengine.optim import AmpOptimWrapper, CosineAnnealingLR, LinearLR
from torch.optim import AdamW
from transformers import AutoModelForCausalLM, AutoTokenizer

from sfttool.dataset import build_preference_dataset
from sfttool.dataset.collate_fns import preference_collate_fn
from sfttool.dataset.data_path import load_data_path
from sfttool.dataset.map_fns import ultrafeedback_binarized_map_fn
from sfttool.dataset.split import validation_split
from sfttool.engine.hooks import DatasetInfoHook, EarlyStoppingHook, EvaluateChatHook, ThroughputHook
from sfttool.engine.runner import TrainLoop
from sfttool.engine.validation import PairValMetric, ValLoop
from sfttool.model import DPO
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
use_varlen_attn = False   # True needs flash-attn; packed sequences are isolated either way

# Data: data_path is a hub name, or a local .json/.jsonl/.csv/.parquet file, a folder or a glob
data_path = 'HuggingFaceH4/ultrafeedback_binarized'
data_split = 'train_prefs'   # the split holding the pairs ('train' for a local file)
dataset_map_fn = ultrafeedback_binarized_map_fn   # whole conversations -> prompt + one-message answers
prompt_template = PROMPT_TEMPLATE.qwen_chat
max_length = 2048            # tokens per sequence (prompt + answer); longer prompts lose early turns
max_packed_length = 4096     # tokens per packed row: whole pairs, chosen + rejected together

# DPO
loss_type = 'sigmoid'        # or robust, hinge, ipo, kto_pair, sppo_hard, nca_pair, simpo
beta = 0.1                   # KL strength: smaller lets the policy move further from the reference
label_smoothing = 0.0
precompute_ref_log_probs = False  # True: one reference pass before training, steps skip its forward

# Validation: a seeded share of the pairs held out before packing (val_ratio), or pairs of their own
# (val_data_path); val/loss, val/rewards/accuracies and val/rewards/margins are means over every held-out pair.
val_data_path = None         # a file, folder, glob or hub name (the data_path rules); wins over val_ratio
val_data_split = 'test_prefs' # the split of val_data_path (its held-out pairs; 'train' for a local file)
val_ratio = 0.01             # 1% of the pairs ...
max_val_rows = 200           # ... at most 200: each validation costs ~200 pairs' forward passes
val_interval = 100           # optimizer steps between validations; one more at the end
best_metric = 'val/loss'     # or 'val/rewards/accuracies': what save_best and early stopping watch
best_metric_rule = 'less'    # lower is better; 'greater' for 'val/rewards/accuracies'
early_stopping_patience = None   # stop after this many validations without improvement (None: never)
early_stopping_min_delta = 0.0   # an improvement must beat the best by more than this
export_best = False          # True: the end-of-training HF export holds the best validation's weights

# Scheduler & optimizer
batch_size = 1               # packed rows per device per iteration
accumulative_counts = 16     # iterations (micro-batches) per optimizer step
# => up to 1 x 4096 x 16 = 65536 tokens (at least 16 pairs) per optimizer step per GPU
dataloader_num_workers = 0
max_epochs = 1
lr = 5e-6
betas = (0.9, 0.999)
weight_decay = 0
max_norm = 1                 # gradient clipping
warmup_ratio = 0.1           # warm-up over the first 10% of iterations
seed = 42

# Save
save_steps = 512             # a checkpoint every 512 iterations = 32 optimizer steps (a step boundary)
save_total_limit = 2         # keep the newest 2 (-1 keeps all)

# Logging: the loss, rewards/chosen, /rejected, /margins, /accuracies of an optimizer step (means over its
# pairs), at the end of each step that holds a multiple of log_interval iterations (here every step)
log_interval = 10

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
    type=DPO,
    loss_type=loss_type,
    beta=beta,
    label_smoothing=label_smoothing,
    precompute_ref_log_probs=precompute_ref_log_probs,
    use_varlen_attn=use_varlen_attn,
    llm=dict(
        type=AutoModelForCausalLM.from_pretrained,
        pretrained_model_name_or_path=pretrained_model_name_or_path,
        trust_remote_code=False,
        dtype='bfloat16'),
    lora=lora_config)                  # r=64, alpha=16, every linear layer but the head

###############################################################################
#                      PART 3  Dataset & Dataloader                           #
###############################################################################
train_dataset = dict(
    type=build_preference_dataset,
    dataset=dict(type=validation_split, dataset=dict(type=load_data_path, path=data_path), part='train',
                 val_ratio=val_ratio, max_val_rows=max_val_rows, val_data_path=val_data_path, seed=seed,
                 split=data_split, val_split=val_data_split),
    split=data_split,
    tokenizer=tokenizer,
    max_length=max_length,
    dataset_map_fn=dataset_map_fn,
    prompt_template=prompt_template,
    max_packed_length=max_packed_length,
    shuffle_before_pack=True,
    use_varlen_attn=use_varlen_attn,
    seed=seed)

train_dataloader = dict(
    batch_size=batch_size,
    num_workers=dataloader_num_workers,
    dataset=train_dataset,
    sampler=dict(type=DefaultSampler, shuffle=True, seed=seed),
    collate_fn=dict(type=preference_collate_fn, use_varlen_attn=use_varlen_attn))

# The held-out pairs go through the same encoding and packing (PART 1's val_* settings).
val_dataloader = dict(
    batch_size=batch_size,
    num_workers=dataloader_num_workers,
    dataset=dict(train_dataset, dataset=dict(train_dataset['dataset'], part='val')),
    sampler=dict(type=DefaultSampler, shuffle=False),
    collate_fn=dict(type=preference_collate_fn, use_varlen_attn=use_varlen_attn))

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

# val_interval counts optimizer steps; the loop counts iterations (accumulative_counts per step).
train_cfg = dict(type=TrainLoop, max_epochs=max_epochs, val_interval=val_interval * accumulative_counts)
val_cfg = dict(type=ValLoop)
val_evaluator = dict(type=PairValMetric)   # the mean loss and rewards over every held-out pair

###############################################################################
#                            PART 5  Runtime                                  #
###############################################################################
# Hooks of this run: dataset statistics before training, sample generations every
# `evaluation_freq` iterations and before and after training, throughput in the log.
custom_hooks = [
    dict(type=DatasetInfoHook, tokenizer=tokenizer),
    dict(type=EvaluateChatHook, tokenizer=tokenizer, every_n_iters=evaluation_freq,
         evaluation_inputs=evaluation_inputs, system=SYSTEM, prompt_template=prompt_template,
         max_new_tokens=evaluation_max_new_tokens),
    dict(type=ThroughputHook),
    dict(type=EarlyStoppingHook, patience=early_stopping_patience, min_delta=early_stopping_min_delta,
         monitor=best_metric, rule=best_metric_rule),
]

# Timer, lr scheduler and sampler-seed hooks come from _base_/runtime.py; the logger
# (the rewards beside the loss) and the checkpoint hook depend on this run's settings.
default_hooks = dict(
    base_hooks,
    logger=dict(base_hooks['logger'], interval=log_interval),
    checkpoint=dict(type=CheckpointHook, by_epoch=False, interval=save_steps,
                    max_keep_ckpts=save_total_limit,
                    save_best=best_metric, rule=best_metric_rule))   # best_<metric>_iter_N.pth, outside the rotation

randomness = dict(seed=seed, deterministic=False)
# env_cfg, visualizer, log_level, load_from, resume, log_processor: _base_/runtime.py
