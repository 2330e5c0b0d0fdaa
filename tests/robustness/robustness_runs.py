"""A tiny LoRA training config and two ways to run `sfttool train`: in a subprocess (faults such
as signals, kill -9 and process-wide limits need a process of their own) or in this process."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent

CONFIG = '''
from datasets import load_dataset
from mmengine.dataset import DefaultSampler
from mmengine.hooks import CheckpointHook, LoggerHook
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
{extra_imports}
model_dir = {model_dir!r}
seed = 3
tokenizer = dict(type=AutoTokenizer.from_pretrained, pretrained_model_name_or_path=model_dir)
model = dict(type=SupervisedFinetune, use_activation_checkpointing=False,
             llm=dict(type=AutoModelForCausalLM.from_pretrained, pretrained_model_name_or_path=model_dir,
                      dtype='float32'),
             lora=dict(type=LoraConfig, r=4, lora_alpha=8, lora_dropout=0.1, bias='none', task_type='CAUSAL_LM'))
train_dataloader = dict(
    batch_size=1, num_workers=0,
    dataset=dict(type=process_hf_dataset, dataset=dict(type=load_dataset, path='json', data_files={data_file!r}),
                 tokenizer=tokenizer, max_length=128, pack_to_max_length=True, map_num_proc=1, seed=seed,
                 template_map_fn=dict(type=template_map_fn_factory, template=PROMPT_TEMPLATE.qwen_chat),
                 {dataset_extra}),
    sampler=dict(type=DefaultSampler, shuffle=True, seed=seed),
    collate_fn=dict(type=default_collate_fn))
optim_wrapper = dict(type=OptimWrapper, optimizer=dict(type=AdamW, lr=1e-3, weight_decay=0),
                     accumulative_counts=2{optim_extra})
param_scheduler = []
train_cfg = dict(type=TrainLoop, max_iters={max_iters})
custom_hooks = {custom_hooks}
default_hooks = dict(logger=dict(type=LoggerHook, interval=1),
                     checkpoint=dict(type=CheckpointHook, by_epoch=False, interval={save_every}, max_keep_ckpts=3))
log_processor = dict(by_epoch=False)
randomness = dict(seed=seed, deterministic=False)
'''


def write_config(path: Path, model_dir, data_file, *, max_iters=8, save_every=4, custom_hooks="[]",
                 optim_extra="", dataset_extra="", extra_imports="") -> Path:
    path.write_text(CONFIG.format(model_dir=str(model_dir), data_file=str(data_file), max_iters=max_iters,
                                  save_every=save_every, custom_hooks=custom_hooks, optim_extra=optim_extra,
                                  dataset_extra=dataset_extra, extra_imports=extra_imports))
    return path


def train_env(**extra) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def train_cmd(config: Path, work_dir: Path, *args: str, pause_before_rename: bool = False) -> list[str]:
    """``sfttool train``; ``pause_before_rename``: with the save pause of ``pause_before_rename.py`` armed."""
    entry = "pause_before_rename" if pause_before_rename else "sfttool.cli.main"
    return [sys.executable, "-m", entry, "train", str(config), "--work-dir", str(work_dir), *args]


def run_train(config: Path, work_dir: Path, *args: str, timeout: float = 300, **env) -> subprocess.CompletedProcess:
    return subprocess.run(train_cmd(config, work_dir, *args), env=train_env(**env), capture_output=True,
                          text=True, timeout=timeout)


def train_in_process(config: Path, work_dir: Path, *args: str) -> subprocess.CompletedProcess:
    """`sfttool train` in this process (for runs no fault is injected into from outside): the
    exit code and terminal output as ``run_train`` gives them, without a process start-up."""
    import traceback

    from click.testing import CliRunner

    from sfttool.cli.main import cli

    result = CliRunner().invoke(cli, ["train", str(config), "--work-dir", str(work_dir), *args])
    crash = result.exc_info if result.exception and not isinstance(result.exception, SystemExit) else None
    stderr = result.stderr + ("".join(traceback.format_exception(*crash)) if crash else "")
    return subprocess.CompletedProcess(args, result.exit_code, result.stdout, stderr)


def final_weights(work_dir: Path, it: int) -> dict:
    """The model state in ``iter_<it>.pth`` (loaded the safe way, as resume does)."""
    import torch

    from sfttool import compat

    compat.apply_training()
    return torch.load(work_dir / f"iter_{it}.pth", map_location="cpu", weights_only=True)["state_dict"]


def assert_same_weights(a: dict, b: dict) -> None:
    import torch

    assert a.keys() == b.keys() and len(a) > 0
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)
