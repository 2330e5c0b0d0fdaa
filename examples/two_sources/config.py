"""Fine-tune SmolLM2-135M-Instruct with LoRA on two sources mixed: the demo's self-identity
conversations (filtered to one turn each) and the support conversations of `custom_dataset/`
(OpenAI `messages`, converted by `openai_map_fn`; 12 rows, oversampled three times in order by
their `slice`). Samples are drawn from them at random, 75 % / 25 %, until the first runs out, and
packed together.

Run from the repository root (the data paths are relative to where you run):

    sfttool check-custom-dataset examples/two_sources/config.py
    sfttool train examples/two_sources/config.py
"""

from mmengine.config import read_base
from mmengine.dataset import DefaultSampler
from mmengine.hooks import CheckpointHook, IterTimerHook, LoggerHook, ParamSchedulerHook
from mmengine.optim import AmpOptimWrapper, CosineAnnealingLR, LinearLR
from peft import LoraConfig
from torch.optim import AdamW
from transformers import AutoModelForCausalLM, AutoTokenizer

from sfttool.assets import export_smollm2
from sfttool.dataset import process_data_sources
from sfttool.dataset.collate_fns import default_collate_fn
from sfttool.dataset.map_fns import openai_map_fn, template_map_fn_factory
from sfttool.engine.hooks import EvaluateChatHook
from sfttool.engine.runner import TrainLoop
from sfttool.model import SupervisedFinetune
from sfttool.utils import PROMPT_TEMPLATE

# A relative import inside read_base() loads filters.py from this folder.
with read_base():
    from .filters import one_turn

# PART 1  Settings
pretrained_model_name_or_path = dict(type=export_smollm2)   # or an HF folder / hub name
data_sources = [
    dict(name='identity', data_path='examples/self_identity/data.jsonl', filter_fn=one_turn),
    dict(name='support', data_path='examples/custom_dataset/messages.jsonl', map_fn=openai_map_fn,
         slice=range(36)),   # 12 rows, each used 3 times, in order
]
mix_strategy = 'interleave'            # 'concat': each source's rows in turn (a ratio per source)
mix_probabilities = [0.75, 0.25]       # the chance of each source for every sample drawn
stopping_strategy = 'first_exhausted'  # stop when a source runs out ('all_exhausted': when all have)
pack_per_source = False                # pack samples of both sources together
prompt_template = PROMPT_TEMPLATE.hf_chat_template          # SmolLM2's own ChatML template
max_length = 512
max_epochs = 3
lr = 1e-3
seed = 0

# PART 2  Model & tokenizer
tokenizer = dict(type=AutoTokenizer.from_pretrained,
                 pretrained_model_name_or_path=pretrained_model_name_or_path, padding_side='right')
model = dict(
    type=SupervisedFinetune,
    use_activation_checkpointing=False,
    llm=dict(type=AutoModelForCausalLM.from_pretrained,
             pretrained_model_name_or_path=pretrained_model_name_or_path, dtype='float32'),
    lora=dict(type=LoraConfig, r=16, lora_alpha=32, lora_dropout=0.05, target_modules='all-linear',
              task_type='CAUSAL_LM'))

# PART 3  Dataset & dataloader: each source loaded, sliced, mapped, filtered -> template -> tokens
# -> mixed -> packed rows
train_dataset = dict(
    type=process_data_sources,
    data_sources=data_sources,
    mix_strategy=mix_strategy,
    mix_probabilities=mix_probabilities,
    stopping_strategy=stopping_strategy,
    pack_per_source=pack_per_source,
    tokenizer=tokenizer,
    max_length=max_length,
    template_map_fn=dict(type=template_map_fn_factory, template=prompt_template),
    pack_to_max_length=True,
    seed=seed)
train_dataloader = dict(batch_size=1, num_workers=0, dataset=train_dataset,
                        sampler=dict(type=DefaultSampler, shuffle=True, seed=seed),
                        collate_fn=dict(type=default_collate_fn))

# PART 4  Optimizer & schedule: 10% linear warm-up, then cosine
optim_wrapper = dict(type=AmpOptimWrapper, optimizer=dict(type=AdamW, lr=lr, weight_decay=0),
                     clip_grad=dict(max_norm=1, error_if_nonfinite=False), dtype='bfloat16')
param_scheduler = [
    dict(type=LinearLR, start_factor=1e-5, by_epoch=True, convert_to_iter_based=True, begin=0, end=0.1 * max_epochs),
    dict(type=CosineAnnealingLR, eta_min=0.0, by_epoch=True, convert_to_iter_based=True,
         begin=0.1 * max_epochs, end=max_epochs),
]
train_cfg = dict(type=TrainLoop, max_epochs=max_epochs)

# PART 5  Runtime
custom_hooks = [dict(type=EvaluateChatHook, tokenizer=tokenizer, max_new_tokens=60,
                     evaluation_inputs=['Who are you?', 'How do I reset my Brightline router?'],
                     prompt_template=prompt_template)]
default_hooks = dict(timer=dict(type=IterTimerHook), logger=dict(type=LoggerHook, interval=5),
                     param_scheduler=dict(type=ParamSchedulerHook),
                     checkpoint=dict(type=CheckpointHook, by_epoch=False, interval=1000, max_keep_ckpts=1))
randomness = dict(seed=seed, deterministic=False)
log_processor = dict(by_epoch=False)
