"""XTuner 0.2's Llama-3 DPO config (configs/dpo/llama/llama3_8b_instruct_dpo_qlora_varlenattn.py)
runs after replacing the package name, pointed at the tiny Llama and a local preference file."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from sfttool import assets
from sfttool.cli.main import cli

# XTuner's file with `xtuner` replaced by `sfttool`; only the model path, the dataset and the lengths and
# epochs are changed (marked CHANGED), to fit the tiny assets.
XTUNER_DPO_LLAMA3 = '''
import torch
from datasets import load_dataset
from mmengine.dataset import DefaultSampler
from mmengine.hooks import (CheckpointHook, DistSamplerSeedHook, IterTimerHook,
                            LoggerHook, ParamSchedulerHook)
from mmengine.optim import AmpOptimWrapper, CosineAnnealingLR, LinearLR
from peft import LoraConfig
from torch.optim import AdamW
from transformers import (AutoModelForCausalLM, AutoTokenizer,
                          BitsAndBytesConfig)

from sfttool.dataset.collate_fns.preference_collate_fn import \\
    preference_collate_fn
from sfttool.dataset.preference_dataset import (build_preference_dataset,
                                                orpo_dpo_mix_40k_map_fn)
from sfttool.engine.hooks import (EvaluateChatHook,
                                  VarlenAttnArgsToMessageHubHook)
from sfttool.engine.runner import TrainLoop
from sfttool.model.dpo import DPO
from sfttool.parallel.sequence import SequenceParallelSampler
from sfttool.utils import PROMPT_TEMPLATE, SYSTEM_TEMPLATE

#######################################################################
#                          PART 1  Settings                           #
#######################################################################
# Model
pretrained_model_name_or_path = {model_dir!r}  # CHANGED
use_varlen_attn = True
dpo_loss_type = 'sigmoid'  # One of ['sigmoid', 'hinge', 'ipo', 'kto_pair', 'sppo_hard', 'nca_pair', 'robust']  # noqa: E501
loss_beta = 0.1
label_smoothing = 0.0

# Data
prompt_template = PROMPT_TEMPLATE.llama3_chat
max_length = 128  # CHANGED
max_packed_length = max_length * 2

# parallel
sequence_parallel_size = 1

# Scheduler & Optimizer
batch_size = 1  # per_device
accumulative_counts = 16
accumulative_counts *= sequence_parallel_size
dataloader_num_workers = 0
max_epochs = 1  # CHANGED
optim_type = AdamW
lr = 5e-7  # refer to alignment handbook
betas = (0.9, 0.999)
weight_decay = 0
max_norm = 1  # grad clip
warmup_ratio = 0.03

# Save
save_steps = 500
save_total_limit = 2  # Maximum checkpoints to keep (-1 means unlimited)

# Evaluate the generation performance during the training
evaluation_freq = 500
SYSTEM = SYSTEM_TEMPLATE.alpaca
evaluation_inputs = [
    'What famous British actor, known for his role as Gandalf, also played Magneto in the X-Men films?'
]

#######################################################################
#                      PART 2  Model & Tokenizer                      #
#######################################################################
tokenizer = dict(
    type=AutoTokenizer.from_pretrained,
    pretrained_model_name_or_path=pretrained_model_name_or_path,
    trust_remote_code=True,
    padding_side='right')

model = dict(
    type=DPO,
    use_varlen_attn=use_varlen_attn,
    loss_type=dpo_loss_type,
    beta=loss_beta,
    label_smoothing=label_smoothing,
    llm=dict(
        type=AutoModelForCausalLM.from_pretrained,
        pretrained_model_name_or_path=pretrained_model_name_or_path,
        trust_remote_code=True,
        torch_dtype=torch.float16,
        quantization_config=dict(
            type=BitsAndBytesConfig,
            load_in_4bit=True,
            load_in_8bit=False,
            llm_int8_threshold=6.0,
            llm_int8_has_fp16_weight=False,
            bnb_4bit_compute_dtype=torch.float16,
            bnb_4bit_use_double_quant=True,
            bnb_4bit_quant_type='nf4')),
    lora=dict(
        type=LoraConfig,
        r=64,
        lora_alpha=16,
        lora_dropout=0.1,
        bias='none',
        task_type='CAUSAL_LM'))

#######################################################################
#                      PART 3  Dataset & Dataloader                   #
#######################################################################
sampler = SequenceParallelSampler \\
    if sequence_parallel_size > 1 else DefaultSampler

train_dataset = dict(
    type=build_preference_dataset,
    dataset=dict(type=load_dataset, path='json', data_files={data_file!r}),  # CHANGED
    tokenizer=tokenizer,
    max_length=max_length,
    dataset_map_fn=orpo_dpo_mix_40k_map_fn,
    is_dpo=True,
    is_reward=False,
    reward_token_id=-1,
    num_proc=32,
    use_varlen_attn=use_varlen_attn,
    max_packed_length=max_packed_length,
    shuffle_before_pack=True,
)

train_dataloader = dict(
    batch_size=batch_size,
    num_workers=dataloader_num_workers,
    dataset=train_dataset,
    sampler=dict(type=sampler, shuffle=True),
    collate_fn=dict(
        type=preference_collate_fn, use_varlen_attn=use_varlen_attn))

#######################################################################
#                    PART 4  Scheduler & Optimizer                    #
#######################################################################
optim_wrapper = dict(
    type=AmpOptimWrapper,
    optimizer=dict(
        type=optim_type, lr=lr, betas=betas, weight_decay=weight_decay),
    clip_grad=dict(max_norm=max_norm, error_if_nonfinite=False),
    accumulative_counts=accumulative_counts,
    loss_scale='dynamic',
    dtype='float16')

param_scheduler = [
    dict(
        type=LinearLR,
        start_factor=1e-5,
        by_epoch=True,
        begin=0,
        end=warmup_ratio * max_epochs,
        convert_to_iter_based=True),
    dict(
        type=CosineAnnealingLR,
        eta_min=0.0,
        by_epoch=True,
        begin=warmup_ratio * max_epochs,
        end=max_epochs,
        convert_to_iter_based=True)
]

train_cfg = dict(type=TrainLoop, max_epochs=max_epochs)

#######################################################################
#                           PART 5  Runtime                           #
#######################################################################
custom_hooks = [
    dict(
        type=EvaluateChatHook,
        tokenizer=tokenizer,
        every_n_iters=evaluation_freq,
        evaluation_inputs=evaluation_inputs,
        system=SYSTEM,
        prompt_template=prompt_template)
]

if use_varlen_attn:
    custom_hooks += [dict(type=VarlenAttnArgsToMessageHubHook)]

default_hooks = dict(
    timer=dict(type=IterTimerHook),
    logger=dict(type=LoggerHook, log_metric_by_epoch=False, interval=10),
    param_scheduler=dict(type=ParamSchedulerHook),
    checkpoint=dict(
        type=CheckpointHook,
        by_epoch=False,
        interval=save_steps,
        max_keep_ckpts=save_total_limit),
    sampler_seed=dict(type=DistSamplerSeedHook),
)

env_cfg = dict(
    cudnn_benchmark=False,
    mp_cfg=dict(mp_start_method='fork', opencv_num_threads=0),
    dist_cfg=dict(backend='nccl'),
)

visualizer = None
log_level = 'INFO'
load_from = None
resume = False
randomness = dict(seed=None, deterministic=False)
log_processor = dict(by_epoch=False)
'''


@pytest.fixture
def dpo_mix_jsonl(tmp_path):
    """Rows as mlabonne/orpo-dpo-mix-40k has them: whole conversations in `chosen` and `rejected`."""
    rows = []
    for i in range(6):
        question = {"role": "user", "content": f"What is {i} times two?"}
        rows.append({"source": "toy", "prompt": question["content"],
                     "chosen": [question, {"role": "assistant", "content": f"It is {2 * i}."}],
                     "rejected": [question, {"role": "assistant", "content": "I do not know."}]})
    return assets.write_jsonl(tmp_path / "dpo_mix.jsonl", rows)


@pytest.mark.slow
def test_xtuner_llama3_dpo_config_runs(tmp_path, tiny_llama_dir, dpo_mix_jsonl):
    cfg = tmp_path / "llama3_8b_instruct_dpo_qlora_varlenattn.py"
    cfg.write_text(XTUNER_DPO_LLAMA3.format(model_dir=str(tiny_llama_dir), data_file=str(dpo_mix_jsonl)))
    work = tmp_path / "work"
    result = CliRunner().invoke(cli, ["train", str(cfg), "--work-dir", str(work)])
    assert result.exit_code == 0, result.output
    (scalars,) = work.rglob("scalars.json")
    logged = [json.loads(line) for line in scalars.read_text().splitlines()]
    assert logged and "rewards/margins" in logged[-1]
    assert (work / "hf_adapter" / "adapter_config.json").is_file()
