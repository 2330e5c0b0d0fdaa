"""QLoRA (4-bit language model + LoRA adapter) of Gemma-3-4B-IT (google/gemma-3-4b-it: a SigLIP vision tower,
a projector and a Gemma 3 language model) on LLaVA-Instruct-150K (158k conversations about COCO images,
liuhaotian/LLaVA-Instruct-150K), 1 epoch. The processor renders each row and expands each image into its 256
tokens as at inference; the vision tower and projector stay frozen and unquantized (docs/multimodal.md).

At a glance: QLoRA SFT (image-text) | 4.3B | LLaVA-Instruct-150K, 158k image conversations (hub) | one 16 GB GPU

Memory (estimate): of the 4.3B params, bitsandbytes quantizes the language model's Linear layers (3.2B x
0.55 bytes = 1.8 GB); its embeddings (0.67B: a 262k-token vocabulary x 2560, shared with the head) and the
vision tower and projector (0.42B) stay unquantized, in float32 once prepared for k-bit training (4.4 GB);
the adapter with its gradients and Adam state (r=64: 119M params, 1.9 GB) and activations (one 2048-token
row with up to 7 images of 256 tokens each, gradient checkpointing, the 262k-token head 512 positions at a
time: about 4 GB): about 12 GB: one 16 GB GPU.

Gated on the hub: accept the licence and `huggingface-cli login` (or point
`pretrained_model_name_or_path` at a local copy) before training.

Data: the conversations file is read from the hub; the images are COCO train2017 (download them, e.g.
http://images.cocodataset.org/zips/train2017.zip, and set image_folder to the unzipped folder).

    sfttool train gemma3_4b_it_qlora_llava_instruct_e1
    sfttool copy-cfg gemma3_4b_it_qlora_llava_instruct_e1 .   # an editable copy
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
pretrained_model_name_or_path = 'google/gemma-3-4b-it'
# What trains: LoRA on the language model; the vision tower (SigLIP) and the projector
# (multi_modal_projector: pools the tower's 64 x 64 patches to 16 x 16 and maps them into the language
# model) stay frozen. freeze_projector=False trains the projector whole beside the adapter (saved with it);
# lora_vision_tower=True puts LoRA on the vision tower too. See docs/multimodal.md.
freeze_vision_tower = True
freeze_projector = True
lora_vision_tower = False
# Image resolution: none to set. Gemma 3's processor resizes every image to 896 x 896 (its SigLIP tower's
# input, whatever the image's size or aspect ratio) and makes 256 tokens of it, about 260 of max_length with
# the markers around them. Pan-and-scan (extra crops of wide images, do_pan_and_scan) stays off, as in the
# processor's own call: sfttool makes each image's pixels that way, one 896 x 896 view.

# Data: LLaVA/XTuner rows ({"image": ..., "conversations": [{"from": "human", "value": "<image>\n..."}, ...]})
data_path = 'liuhaotian/LLaVA-Instruct-150K'
data_files = 'llava_instruct_150k.json'   # the file of that hub repository to read (None for a local data_path)
image_folder = './data/coco/train2017'    # where the rows' image paths are read from
dataset_map_fn = llava_map_fn             # XTuner's name; <image> leads its message
max_length = 2048            # tokens per row (an image is 256); a cut never falls inside an image
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

# Attention: SDPA, sfttool's default (Gemma 3 has no attention-logit soft-capping, which kept Gemma 2 on
# eager). The tokens of one image attend to each other both ways: sfttool gives a packed batch with images
# its masks for that, each sample seeing only itself (docs/multimodal.md).
model = dict(
    type=SupervisedFinetune,
    freeze_vision_tower=freeze_vision_tower,
    freeze_projector=freeze_projector,
    lora_vision_tower=lora_vision_tower,
    llm=dict(
        type=AutoModelForImageTextToText.from_pretrained,
        pretrained_model_name_or_path=pretrained_model_name_or_path,
        dtype='bfloat16',                  # as Gemma 3 was trained (float16 overflows in its activations)
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
