"""A tiny LoRA run (and a full fine-tune config) for the convert / merge /
chat tests: configs written on the spot, trained once per session with
`sfttool train` in-process."""
from __future__ import annotations

from pathlib import Path

import pytest

TINY_CONFIG = '''
from datasets import load_dataset
from mmengine.hooks import CheckpointHook
from mmengine.dataset import DefaultSampler
from mmengine.optim import OptimWrapper
from peft import LoraConfig
from torch.optim import AdamW
from transformers import AutoModelForCausalLM, AutoTokenizer

from sfttool.dataset import process_hf_dataset
from sfttool.dataset.collate_fns import default_collate_fn
from sfttool.dataset.map_fns import template_map_fn_factory
from sfttool.engine.runner import TrainLoop
from sfttool.model import SupervisedFinetune
from sfttool.utils import PROMPT_TEMPLATE

model_dir = {model_dir!r}
prompt_template = PROMPT_TEMPLATE.qwen_chat
max_length = 128

tokenizer = dict(type=AutoTokenizer.from_pretrained, pretrained_model_name_or_path=model_dir,
                 padding_side='right')
model = dict(
    type=SupervisedFinetune,
    use_activation_checkpointing=False,
    llm=dict(type=AutoModelForCausalLM.from_pretrained, pretrained_model_name_or_path=model_dir,
             dtype='float32'),
    lora={lora})

train_dataset = dict(
    type=process_hf_dataset,
    dataset=dict(type=load_dataset, path='json', data_files={data!r}),
    tokenizer=tokenizer, max_length=max_length,
    template_map_fn=dict(type=template_map_fn_factory, template=prompt_template),
    remove_unused_columns=True, pack_to_max_length=True, seed=0)
train_dataloader = dict(batch_size=2, num_workers=0, dataset=train_dataset,
                        sampler=dict(type=DefaultSampler, shuffle=True, seed=0),
                        collate_fn=dict(type=default_collate_fn))

optim_wrapper = dict(type=OptimWrapper, optimizer=dict(type=AdamW, lr=1e-2, weight_decay=0))
param_scheduler = []
train_cfg = dict(type=TrainLoop, max_iters={iters})
default_hooks = dict(checkpoint=dict(type=CheckpointHook, by_epoch=False, interval={iters}, max_keep_ckpts=1))
randomness = dict(seed=0, deterministic=False)
log_level = 'WARNING'
'''

LORA = "dict(type=LoraConfig, r=8, lora_alpha=16, lora_dropout=0.0, target_modules=None, task_type='CAUSAL_LM')"


def write_tiny_config(path: Path, model_dir: Path, data: Path, lora: bool = True, iters: int = 4) -> Path:
    path.write_text(TINY_CONFIG.format(model_dir=str(model_dir), data=str(data), lora=LORA if lora else None,
                                       iters=iters))
    return path


@pytest.fixture(scope="session")
def lora_cfg_path(tmp_path_factory, tiny_llama_dir, tiny_sft_jsonl) -> Path:
    return write_tiny_config(tmp_path_factory.mktemp("lora_cfg") / "tiny_lora.py", tiny_llama_dir, tiny_sft_jsonl)


@pytest.fixture(scope="session")
def full_cfg_path(tmp_path_factory, tiny_llama_dir, tiny_sft_jsonl) -> Path:
    return write_tiny_config(tmp_path_factory.mktemp("full_cfg") / "tiny_full.py", tiny_llama_dir,
                             tiny_sft_jsonl, lora=False)


def train_once(cfg_path: Path, work_dir: Path, deepspeed: str | None = None) -> Path:
    from sfttool.engine.train import train

    train(str(cfg_path), work_dir=str(work_dir), deepspeed=deepspeed)
    return work_dir


@pytest.fixture(scope="session")
def lora_run(tmp_path_factory, lora_cfg_path) -> Path:
    """Work dir of a 4-step LoRA run: iter_4.pth and hf_adapter/."""
    return train_once(lora_cfg_path, tmp_path_factory.mktemp("lora_run"))


@pytest.fixture(scope="session")
def full_run(tmp_path_factory, full_cfg_path) -> Path:
    """Work dir of a 4-step full fine-tune: iter_4.pth and hf_model/."""
    return train_once(full_cfg_path, tmp_path_factory.mktemp("full_run"))


@pytest.fixture(scope="session", params=["zero2", "zero3"])
def lora_deepspeed_run(request, tmp_path_factory, lora_cfg_path) -> Path:
    """Work dir of the 4-step LoRA run under DeepSpeed (one process): iter_4.pth/ is a folder."""
    return train_once(lora_cfg_path, tmp_path_factory.mktemp(f"lora_{request.param}"), deepspeed=request.param)
