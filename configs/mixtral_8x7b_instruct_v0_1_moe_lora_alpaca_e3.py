"""LoRA (bfloat16 base weights + adapter) of Mixtral-8x7B-Instruct-v0.1, a mixture-of-experts model (8
experts, 2 per token: 46.7B parameters, 12.9B active), on Alpaca (52k single-turn instructions,
tatsu-lab/alpaca), 3 epochs. LoRA sits on attention and on every expert (fused expert weights, through
peft's target_parameters); the router's load-balancing loss is part of the training loss (docs/moe.md).

At a glance: LoRA SFT (MoE) | 46.7B | Alpaca, 52k instructions (hub) | 2 x 80 GB GPUs with ZeRO-3

Memory (estimate): 46.7B params x 2 bytes (bfloat16 weights) = 93 GB, plus the adapter (r=8 on
attention and 8 x 32 experts: 112M params, 0.2 GB), its gradients and float32 Adam state (1.1 GB), and
activations (one 2048-token row, gradient checkpointing): more than one 80 GB GPU holds, so: 2 x 80 GB
GPUs with ZeRO-3 (`--deepspeed zero3`), each holding half the weights (47 GB) and its share of the rest.

    sfttool train mixtral_8x7b_instruct_v0_1_moe_lora_alpaca_e3 --nproc-per-node 2 --deepspeed zero3
    sfttool copy-cfg mixtral_8x7b_instruct_v0_1_moe_lora_alpaca_e3 .   # an editable copy
"""

from mmengine.config import read_base
from mmengine.dataset import DefaultSampler
from mmengine.hooks import CheckpointHook
from mmengine.optim import AmpOptimWrapper, CosineAnnealingLR, LinearLR
from torch.optim import AdamW
from transformers import AutoModelForCausalLM, AutoTokenizer

from sfttool.dataset import process_hf_dataset
from sfttool.dataset.collate_fns import default_collate_fn
from sfttool.dataset.data_path import load_data_path
from sfttool.dataset.split import validation_split
from sfttool.dataset.map_fns import alpaca_map_fn, template_map_fn_factory
from sfttool.engine.hooks import DatasetInfoHook, EarlyStoppingHook, EvaluateChatHook, ThroughputHook
from sfttool.engine.runner import TrainLoop
from sfttool.engine.validation import ValLoop, ValLossMetric
from sfttool.model import SupervisedFinetune
from sfttool.utils import PROMPT_TEMPLATE, SYSTEM_TEMPLATE

# Shared parts: the LoRA adapter and 4-bit settings (peft.py), hooks, environment
# and logging (runtime.py). `sfttool copy-cfg` copies them next to your copy.
with read_base():
    from ._base_.peft import *
    from ._base_.runtime import *

###############################################################################
#                          PART 1  Settings                                   #
###############################################################################
# Model
pretrained_model_name_or_path = 'mistralai/Mixtral-8x7B-Instruct-v0.1'
use_varlen_attn = False   # True needs flash-attn; packed samples are isolated either way
# Mixture of experts: where LoRA goes ('all', 'attention' or 'experts'; the router never unless named in
# model.lora), and the weight of the router's load-balancing loss in the training loss (sfttool reads
# it here; None: the model's own, 0.02 for this model; 0 leaves it out). The log shows it as aux_loss. See docs/moe.md.
lora_targets = 'all'
router_aux_loss_coef = None

# Data: data_path is a hub name, or a local .json/.jsonl/.csv/.parquet file, a folder or a glob
data_path = 'tatsu-lab/alpaca'
dataset_map_fn = alpaca_map_fn   # Alpaca's instruction/input/output -> `conversation` rows
prompt_template = PROMPT_TEMPLATE.mixtral
max_length = 2048            # tokens per row; longer samples are truncated
pack_to_max_length = True    # several whole samples per row, never split

# Scheduler & optimizer
batch_size = 1               # packed rows per device per iteration
accumulative_counts = 16     # iterations (micro-batches) per optimizer step
# => up to 1 x 2048 x 16 = 32768 tokens per optimizer step per GPU
dataloader_num_workers = 0
max_epochs = 3
lr = 2e-4
betas = (0.9, 0.999)
weight_decay = 0
max_norm = 1                 # gradient clipping
warmup_ratio = 0.03          # warm-up over the first 3% of iterations
seed = 42

# Save
save_steps = 512             # a checkpoint every 512 iterations = 32 optimizer steps (a step boundary)
save_total_limit = 2         # keep the newest 2 (-1 keeps all)

# Validation: a seeded share of the rows held out before packing (no row in both),
# or a separate file; val/loss is the mean over every trained token of that set.
val_data_path = None         # a file, folder, glob or hub name (the data_path rules); wins over val_ratio
val_ratio = 0.02             # 2% of the rows ...
max_val_rows = 200           # ... at most 200: each validation costs ~200 samples' forward passes
val_interval = 100           # optimizer steps between validations; one more at the end
early_stopping_patience = None   # stop after this many validations without improvement (None: never)
early_stopping_min_delta = 0.0   # an improvement must lower val/loss by more than this
export_best = False          # True: the end-of-training HF export holds the best validation's weights

# Tracking: 'auto' is TensorBoard when it is installed (pip install 'sfttool[tensorboard]'), else none
# (the run's summary says which); or a list of 'tensorboard', 'wandb', 'mlflow', [] for none.
# Every run also writes work_dir/loss.png; `sfttool plot WORK_DIR` draws it for any run.
report_to = 'auto'

# Sample generations during training
evaluation_freq = 500        # every 500 iterations, plus before and after training
evaluation_max_new_tokens = 600   # tokens per sample answer; on a CPU, 40-60 keeps each evaluation short
SYSTEM = SYSTEM_TEMPLATE.alpaca
evaluation_inputs = ['Give three tips for staying healthy.',
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
    type=SupervisedFinetune,
    use_varlen_attn=use_varlen_attn,
    lora_targets=lora_targets,   # 'all': attention + experts; the router stays out of LoRA
    llm=dict(
        type=AutoModelForCausalLM.from_pretrained,
        pretrained_model_name_or_path=pretrained_model_name_or_path,
        trust_remote_code=False,
        dtype='bfloat16'),
    # r=8: 112M adapter params with the experts; dropout 0: peft runs LoRA on fused experts without it
    lora=dict(lora_config, r=8, lora_alpha=16, lora_dropout=0.0))

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
