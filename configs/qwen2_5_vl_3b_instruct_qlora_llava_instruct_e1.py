"""QLoRA (4-bit language model + LoRA adapter) of Qwen2.5-VL-3B-Instruct on LLaVA-Instruct-150K (158k
conversations about COCO images, liuhaotian/LLaVA-Instruct-150K), 1 epoch. The processor renders each row
and expands each image into its tokens as at inference; the vision tower and projector stay frozen and
unquantized (docs/multimodal.md).

At a glance: QLoRA SFT (image-text) | 3.8B | LLaVA-Instruct-150K, 158k image conversations (hub) | one 16 GB GPU

Memory (estimate): of the 3.8B params, bitsandbytes quantizes the language model's Linear layers (2.8B x
0.55 bytes = 1.5 GB); its embeddings (0.31B, shared with the head) and the vision tower and projector
(0.67B) stay unquantized, in float32 once prepared for k-bit training (3.9 GB); the adapter with its
gradients and Adam state (r=64: 119M params, 1.9 GB) and activations (one 2048-token row with up to 4
images of at most 1024 tokens each, gradient checkpointing: about 3 GB): about 10 GB: one 16 GB GPU.

Data: the conversations file is read from the hub; the images are COCO train2017 (download them, e.g.
http://images.cocodataset.org/zips/train2017.zip, and set image_folder to the unzipped folder).

    sfttool train qwen2_5_vl_3b_instruct_qlora_llava_instruct_e1
    sfttool copy-cfg qwen2_5_vl_3b_instruct_qlora_llava_instruct_e1 .   # an editable copy
"""

from mmengine.config import read_base
from mmengine.dataset import DefaultSampler
from mmengine.hooks import CheckpointHook
from mmengine.optim import AmpOptimWrapper, CosineAnnealingLR, LinearLR
from torch.optim import AdamW
from transformers import AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

from sfttool.dataset import process_hf_dataset
from sfttool.dataset.collate_fns import default_collate_fn
from sfttool.dataset.data_path import load_data_path
from sfttool.dataset.map_fns import llava_map_fn
from sfttool.engine.hooks import DatasetInfoHook, EvaluateChatHook, ThroughputHook
from sfttool.engine.runner import TrainLoop
from sfttool.model import SupervisedFinetune

# Shared parts: the LoRA adapter and 4-bit settings (peft.py), hooks, environment
# and logging (runtime.py). `sfttool copy-cfg` copies them next to your copy.
with read_base():
    from ._base_.peft import *
    from ._base_.runtime import *

###############################################################################
#                          PART 1  Settings                                   #
###############################################################################
# Model
pretrained_model_name_or_path = 'Qwen/Qwen2.5-VL-3B-Instruct'
# What trains: LoRA on the language model; the vision tower and the projector (Qwen's patch merger)
# stay frozen. freeze_projector=False trains the projector whole beside the adapter (saved with it);
# lora_vision_tower=True puts LoRA on the vision tower too. See docs/multimodal.md.
freeze_vision_tower = True
freeze_projector = True
lora_vision_tower = False
# Image resolution: Qwen2.5-VL makes one token per 28 x 28 pixels; images are resized into these bounds
# (here 4 to 1024 tokens per image), which bounds the memory an image takes.
min_pixels = 4 * 28 * 28
max_pixels = 1024 * 28 * 28

# Data: LLaVA/XTuner rows ({"image": ..., "conversations": [{"from": "human", "value": "<image>\n..."}, ...]})
data_path = 'liuhaotian/LLaVA-Instruct-150K'
data_files = 'llava_instruct_150k.json'   # the file of that hub repository to read (None for a local data_path)
image_folder = './data/coco/train2017'    # where the rows' image paths are read from
dataset_map_fn = llava_map_fn             # XTuner's name; <image> leads its message
max_length = 2048            # tokens per row; a cut never falls inside an image (docs/multimodal.md)
pack_to_max_length = True    # several whole samples per row, each with its own images

# Scheduler & optimizer
batch_size = 1               # packed rows per device per iteration
accumulative_counts = 16     # iterations (micro-batches) per optimizer step
# => up to 1 x 2048 x 16 = 32768 tokens per optimizer step per GPU
dataloader_num_workers = 4   # images are loaded and processed in the workers
max_epochs = 1
lr = 2e-4
betas = (0.9, 0.999)
weight_decay = 0
max_norm = 1                 # gradient clipping
warmup_ratio = 0.03          # warm-up over the first 3% of iterations
seed = 42

# Save
save_steps = 512             # a checkpoint every 512 iterations = 32 optimizer steps (a step boundary)
save_total_limit = 2         # keep the newest 2 (-1 keeps all)

# Tracking: 'auto' is TensorBoard when it is installed (pip install 'sfttool[tensorboard]'), else none
# (the run's summary says which); or a list of 'tensorboard', 'wandb', 'mlflow', [] for none.
report_to = 'auto'

# Sample generations during training: each question about the image (one image for all of them)
evaluation_freq = 500        # every 500 iterations, plus before and after training
evaluation_max_new_tokens = 300
evaluation_images = image_folder + '/000000033471.jpg'   # the first row's image (a bus)
evaluation_inputs = ['What are the colors of the bus in the image?', 'Describe this picture.']

###############################################################################
#                      PART 2  Model & Processor                              #
###############################################################################
# The processor renders rows (its chat template) and turns images into pixels and tokens; the
# tokenizer is its own, named here for the hooks.
processor = dict(
    type=AutoProcessor.from_pretrained,
    pretrained_model_name_or_path=pretrained_model_name_or_path,
    size=dict(shortest_edge=min_pixels, longest_edge=max_pixels))   # pixels, not edges (transformers' names)
tokenizer = dict(
    type=AutoTokenizer.from_pretrained,
    pretrained_model_name_or_path=pretrained_model_name_or_path,
    padding_side='right')

model = dict(
    type=SupervisedFinetune,
    freeze_vision_tower=freeze_vision_tower,
    freeze_projector=freeze_projector,
    lora_vision_tower=lora_vision_tower,
    llm=dict(
        type=AutoModelForImageTextToText.from_pretrained,
        pretrained_model_name_or_path=pretrained_model_name_or_path,
        dtype='bfloat16',
        quantization_config=qlora_4bit),   # NF4 for the language model only, from _base_/peft.py
    lora=lora_config)

###############################################################################
#                      PART 3  Dataset & Dataloader                           #
###############################################################################
train_dataset = dict(
    type=process_hf_dataset,
    dataset=dict(type=load_data_path, path=data_path, **(dict(data_files=data_files) if data_files else {})),
    processor=processor,
    image_folder=image_folder,
    max_length=max_length,
    dataset_map_fn=dataset_map_fn,
    template_map_fn=None,        # the processor's chat template renders the rows
    remove_unused_columns=True,
    shuffle_before_pack=True,
    pack_to_max_length=pack_to_max_length,
    seed=seed)

train_dataloader = dict(
    batch_size=batch_size,
    num_workers=dataloader_num_workers,
    dataset=train_dataset,
    sampler=dict(type=DefaultSampler, shuffle=True, seed=seed),
    collate_fn=dict(type=default_collate_fn))   # adds the batch's pixel_values (and image_grid_thw)

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
# Hooks of this run: dataset statistics before training, sample answers about an image every
# `evaluation_freq` iterations and before and after training, throughput in the log.
custom_hooks = [
    dict(type=DatasetInfoHook, tokenizer=tokenizer),
    dict(type=EvaluateChatHook, tokenizer=tokenizer, processor=processor, every_n_iters=evaluation_freq,
         evaluation_inputs=evaluation_inputs, evaluation_images=evaluation_images,
         max_new_tokens=evaluation_max_new_tokens),
    dict(type=ThroughputHook),
]

# Timer, logger, lr scheduler and sampler-seed hooks come from _base_/runtime.py;
# the checkpoint hook depends on this run's settings.
default_hooks = dict(
    **base_hooks,
    checkpoint=dict(type=CheckpointHook, by_epoch=False, interval=save_steps,
                    max_keep_ckpts=save_total_limit))

randomness = dict(seed=seed, deterministic=False)
# env_cfg, visualizer, log_level, load_from, resume, log_processor: _base_/runtime.py
