"""QLoRA of LLaVA-1.5-7B (llava-hf/llava-1.5-7b-hf: a CLIP ViT-L/14-336 vision encoder, a two-layer MLP
projector and a Vicuna-7B language model) on LLaVA-Instruct-150K (158k conversations about COCO images,
liuhaotian/LLaVA-Instruct-150K), 1 epoch, as XTuner's LLaVA fine-tuning stage trains it: the language
model 4-bit with a LoRA adapter, the projector trained whole, the vision encoder frozen. The processor
renders each row and expands each image into its 576 tokens as at inference (docs/multimodal.md).

At a glance: QLoRA SFT (image-text) | 7.1B | LLaVA-Instruct-150K, 158k image conversations (hub) | one 16 GB GPU

Memory (estimate): of the 7.1B params, bitsandbytes quantizes the language model's Linear layers (6.5B x
0.55 bytes = 3.6 GB); its embeddings and head (0.26B) and the vision encoder and projector (0.32B) stay
unquantized, in float32 once prepared for k-bit training (2.3 GB); the adapter and the projector with
their gradients and Adam state (r=64: 160M + 21M params, 2.9 GB) and activations (one 2048-token row, up to
3 images of 576 tokens, gradient checkpointing: about 3 GB): about 12 GB: one 16 GB GPU.

Data: the conversations file is read from the hub; the images are COCO train2017 (download them, e.g.
http://images.cocodataset.org/zips/train2017.zip, and set image_folder to the unzipped folder).

    sfttool train llava_1_5_7b_hf_qlora_llava_instruct_e1
    sfttool copy-cfg llava_1_5_7b_hf_qlora_llava_instruct_e1 .   # an editable copy
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
pretrained_model_name_or_path = 'llava-hf/llava-1.5-7b-hf'
# What trains: LoRA on the language model and the projector whole beside it (saved with the adapter,
# merged by `sfttool convert merge`), as XTuner's LLaVA fine-tuning stage; the vision encoder stays frozen
# (lora_vision_tower=True puts LoRA on it). LLaVA's pretraining stage (the projector alone) is
# freeze_llm=True with lora=None. See docs/multimodal.md.
freeze_vision_tower = True
freeze_projector = False
lora_vision_tower = False

# Data: LLaVA/XTuner rows ({"image": ..., "conversations": [{"from": "human", "value": "<image>\n..."}, ...]})
data_path = 'liuhaotian/LLaVA-Instruct-150K'
data_files = 'llava_instruct_150k.json'   # the file of that hub repository to read (None for a local data_path)
image_folder = './data/coco/train2017'    # where the rows' image paths are read from
dataset_map_fn = llava_map_fn             # XTuner's name; <image> leads its message
max_length = 2048            # tokens per row (an image is 576); a cut never falls inside an image
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
    pretrained_model_name_or_path=pretrained_model_name_or_path)
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
        quantization_config=qlora_4bit),   # NF4 for the language model only (not the vision encoder, projector)
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
