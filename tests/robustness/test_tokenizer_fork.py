"""Forked workers that tokenize never hang, whatever TOKENIZERS_PARALLELISM says (docs/reliability.md).

A fast tokenizer that has used its Rust thread pool deadlocks in a forked child that uses it again
when the variable is ``true``. Each case runs in its own process under a timeout, so a hang fails
the test by name instead of stopping the suite.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sfttool import assets
from robustness_runs import run_train

HERE = Path(__file__).parent
HANG_S = 240  # each case takes seconds; a deadlocked worker never returns
SETTINGS = ["true", "false"]

STREAM_CONFIG = '''
from datasets import load_dataset
from mmengine.hooks import CheckpointHook, LoggerHook
from mmengine.optim import OptimWrapper
from torch.optim import AdamW
from transformers import AutoModelForCausalLM, AutoTokenizer

from sfttool.dataset.collate_fns import default_collate_fn
from sfttool.dataset.map_fns import template_map_fn_factory
from sfttool.dataset.streaming import StreamingPackedDataset
from sfttool.engine.hooks import EvaluateChatHook
from sfttool.engine.runner import TrainLoop
from sfttool.model import SupervisedFinetune
from sfttool.utils import PROMPT_TEMPLATE

tokenizer = dict(type=AutoTokenizer.from_pretrained, pretrained_model_name_or_path={model_dir!r})
model = dict(type=SupervisedFinetune, use_activation_checkpointing=False,
             llm=dict(type=AutoModelForCausalLM.from_pretrained, pretrained_model_name_or_path={model_dir!r},
                      dtype='float32'))
train_dataloader = dict(
    batch_size=2, num_workers=2, sampler=None, collate_fn=dict(type=default_collate_fn),
    dataset=dict(type=StreamingPackedDataset, tokenizer=tokenizer, max_length=128, buffer_size=16, seed=0,
                 dataset=dict(type=load_dataset, path='json', data_files={data!r}, split='train', streaming=True),
                 template_map_fn=dict(type=template_map_fn_factory, template=PROMPT_TEMPLATE.qwen_chat),
                 rows_per_epoch=8))
optim_wrapper = dict(type=OptimWrapper, optimizer=dict(type=AdamW, lr=1e-3))
param_scheduler = []
train_cfg = dict(type=TrainLoop, max_iters=4)
default_hooks = dict(logger=dict(type=LoggerHook, interval=1),
                     checkpoint=dict(type=CheckpointHook, by_epoch=False, interval=4))
log_processor = dict(by_epoch=False)
randomness = dict(seed=0)
# Its sample answers before training use the tokenizer's pool in this process before the workers fork.
custom_hooks = [dict(type=EvaluateChatHook, tokenizer=tokenizer, evaluation_inputs=['hi', 'who are you'],
                     every_n_iters=100, max_new_tokens=4)]
'''


def run_worker(mode: str, model_dir: Path, data: Path, parallelism: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TOKENIZERS_PARALLELISM=parallelism, OMP_NUM_THREADS="1")
    try:
        return subprocess.run([sys.executable, str(HERE / "fork_worker.py"), mode, str(model_dir), str(data)],
                              env=env, capture_output=True, text=True, timeout=HANG_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{mode} with TOKENIZERS_PARALLELISM={parallelism} hung for {HANG_S} s")


@pytest.fixture(scope="module")
def many_rows(tmp_path_factory) -> Path:
    """Enough rows that ``map_num_proc=2`` really starts two processes (one per 5,000 rows at most)."""
    return assets.write_jsonl(tmp_path_factory.mktemp("fork") / "rows.jsonl", assets.tiny_conversations(10_000))


@pytest.mark.slow
@pytest.mark.parametrize("parallelism", SETTINGS)
def test_streaming_dataloader_with_two_workers_finishes(parallelism, tiny_tokenizer_dir, tiny_sft_jsonl):
    result = run_worker("stream", tiny_tokenizer_dir, tiny_sft_jsonl, parallelism)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-1] == "ok 64"  # every row's sample came back through the two workers
    assert "dataloader worker 1): 0 rows" not in result.stdout  # both workers tokenized
    said = "TOKENIZERS_PARALLELISM=true: worker processes tokenize on one thread each"
    assert result.stdout.count(said) == (parallelism == "true")  # said once, and only when overriding


@pytest.mark.slow
@pytest.mark.parametrize("parallelism", SETTINGS)
# datasets' map turns the pool off itself while it runs with num_proc (datasets 4.x): this guards it.
def test_map_num_proc_2_finishes(parallelism, tiny_tokenizer_dir, many_rows):
    result = run_worker("map", tiny_tokenizer_dir, many_rows, parallelism)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-1] == "ok 10000"


@pytest.mark.slow
@pytest.mark.parametrize("parallelism", SETTINGS)
def test_training_on_a_stream_with_two_workers_finishes(parallelism, tmp_path, tiny_qwen2_dir, tiny_sft_jsonl):
    config = tmp_path / "cfg.py"
    config.write_text(STREAM_CONFIG.format(model_dir=str(tiny_qwen2_dir), data=str(tiny_sft_jsonl)))
    try:
        result = run_train(config, tmp_path / "work", timeout=HANG_S, TOKENIZERS_PARALLELISM=parallelism)
    except subprocess.TimeoutExpired:
        pytest.fail(f"sfttool train on a stream with 2 workers, TOKENIZERS_PARALLELISM={parallelism}, "
                    f"hung for {HANG_S} s")
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "work" / "iter_4.pth").exists()


def test_a_forked_child_tokenizes_on_one_thread_and_the_parent_keeps_its_setting(monkeypatch):
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what the tokenizers library will read here, then leave at once
        os.write(write, os.environ.get("TOKENIZERS_PARALLELISM", "").encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    assert os.read(read, 64) == b"false"
    assert os.environ["TOKENIZERS_PARALLELISM"] == "true"
