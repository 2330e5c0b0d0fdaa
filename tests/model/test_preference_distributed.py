"""DPO with two CPU processes (gloo): under DeepSpeed ZeRO-2 and ZeRO-3 (LoRA, and full fine-tuning with
its frozen reference partitioned too) the run finishes, and a run stopped after a checkpoint and resumed
ends with bit-identical weights; two ranks train like one rank with the global batch (the pair count spans
ranks); single-process full fine-tuning (the reference left out of checkpoints) resumes bit-exactly."""
from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ENGINE_TESTS = Path(__file__).resolve().parents[1] / "engine"
if str(ENGINE_TESTS) not in sys.path:
    sys.path.insert(0, str(ENGINE_TESTS))

from engine_helpers import LORA, RUNTIME  # noqa: E402
from test_distributed import run_sfttool  # noqa: E402

from sfttool import assets  # noqa: E402

pytestmark = pytest.mark.timeout(900)  # tests here launch several processes

DPO_CONFIG = '''
from datasets import load_dataset
from mmengine.dataset import DefaultSampler
from mmengine.hooks import CheckpointHook, IterTimerHook, LoggerHook, ParamSchedulerHook, DistSamplerSeedHook
from mmengine.optim import AmpOptimWrapper, ConstantLR
from peft import LoraConfig
from torch.optim import AdamW
from transformers import AutoModelForCausalLM, AutoTokenizer

from sfttool.dataset import build_preference_dataset
from sfttool.dataset.collate_fns import preference_collate_fn
from sfttool.engine.runner import TrainLoop
from sfttool.model import DPO

model_dir = {model_dir!r}
seed = 7
tokenizer = dict(type=AutoTokenizer.from_pretrained, pretrained_model_name_or_path=model_dir)
model = dict(
    type=DPO, beta=0.1, use_activation_checkpointing=False,
    llm=dict(type=AutoModelForCausalLM.from_pretrained, pretrained_model_name_or_path=model_dir, dtype='float32'),
    lora={lora})
train_dataloader = dict(
    batch_size={batch_size}, num_workers=0,
    dataset=dict(type=build_preference_dataset,
                 dataset=dict(type=load_dataset, path='json', data_files={data_file!r}),
                 tokenizer=tokenizer, max_length=64, pack_to_max_length=False, num_proc=1, seed=seed),
    sampler=dict(type=DefaultSampler, shuffle=True, seed=seed),
    collate_fn=dict(type=preference_collate_fn))
optim_wrapper = dict(type=AmpOptimWrapper, dtype='bfloat16', loss_scale='dynamic',
                     optimizer=dict(type=AdamW, lr=1e-3, betas=(0.9, 0.999), weight_decay=0),
                     clip_grad=dict(max_norm=1, error_if_nonfinite=False), accumulative_counts=2)
param_scheduler = [dict(type=ConstantLR, factor=1.0, by_epoch=False, begin=0)]
train_cfg = dict(type=TrainLoop, max_epochs=1)
''' + RUNTIME


@pytest.fixture
def pairs_jsonl(tmp_path):
    rng = random.Random(0)
    words = "the cat sat on a mat and then it ran far".split()
    rows = []
    for i in range(16):  # 16 rows, one pair each: 8 iterations per rank, 4 optimizer steps
        question = " ".join(rng.choice(words) for _ in range(4)) + "?"
        rows.append({"prompt": [{"role": "user", "content": question}],
                     "chosen": [{"role": "assistant", "content": f"yes {i}."}],
                     "rejected": [{"role": "assistant",
                                   "content": "no " + " ".join(rng.choice(words) for _ in range(3))}]})
    return assets.write_jsonl(tmp_path / "pairs.jsonl", rows)


def write(path, model_dir, data_file, custom_hooks="[]", batch_size=1, dropout=0.1, lora=True):
    path.write_text(DPO_CONFIG.format(model_dir=str(model_dir), data_file=str(data_file), custom_hooks=custom_hooks,
                                      batch_size=batch_size, lora=LORA.format(dropout=dropout) if lora else "None",
                                      save_steps=4, keep=2))
    return path


def _output(result, work_dir) -> str:
    """What a run printed and what it logged: the console shows a progress bar, the log file every
    iteration's scalars."""
    return result.stdout + result.stderr + "".join(p.read_text() for p in sorted(work_dir.rglob("*.log")))


def resume_from_the_middle(config, full, work, launch: list[str]) -> None:
    """Resume ``config`` in a new work dir from the checkpoint the uninterrupted run in ``full`` saved
    after iteration 4 of 8 (what a run stopped there would have saved: the runs are deterministic; a
    real interruption of several processes is tested on SFT, tests/engine/test_resume.py and
    tests/robustness). One launch fewer than stopping a second run."""
    checkpoint = full / "iter_4.pth"
    assert checkpoint.exists(), sorted(p.name for p in full.iterdir())
    result = run_sfttool([str(config), "--work-dir", str(work), *launch, "--resume", str(checkpoint)], timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Resuming at iteration 4" in _output(result, work)


@pytest.mark.slow
@pytest.mark.parametrize("zero,lora", [("zero2", True), ("zero3", True), ("zero3", False)],
                         ids=["zero2-lora", "zero3-lora", "zero3-full"])
def test_two_process_dpo_finishes_and_resumes_bit_exactly(tmp_path, tiny_qwen2_dir, pairs_jsonl, zero, lora):
    """Under ZeRO-3 the run is also resumed from its middle; ZeRO-2's checkpoints resume as SFT's do
    (tests/engine/test_resume.py), with nothing of DPO's own in them."""
    launch = ["--nproc-per-node", "2", "--deepspeed", zero]
    go = write(tmp_path / "go.py", tiny_qwen2_dir, pairs_jsonl, lora=lora)
    full = run_sfttool([str(go), "--work-dir", str(tmp_path / "full"), *launch], timeout=900)
    assert full.returncode == 0, full.stdout[-3000:] + full.stderr[-3000:]
    assert "rewards/margins" in _output(full, tmp_path / "full")
    name = "hf_adapter/adapter_model.safetensors" if lora else "hf_model/model.safetensors"
    a = load_file(tmp_path / "full" / name)
    if zero == "zero3":
        resume_from_the_middle(go, tmp_path / "full", tmp_path / "resumed", launch)
        b = load_file(tmp_path / "resumed" / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    if lora:
        assert max(v.abs().max().item() for k, v in a.items() if "lora_B" in k) > 0  # it trained
    else:
        assert not any(k.startswith("ref_llm") for k in a)  # the frozen reference is not exported


@pytest.mark.slow
def test_two_ranks_equal_one_rank_with_the_global_batch(tmp_path, tiny_qwen2_dir, pairs_jsonl):
    from sfttool.engine.train import train
    two = write(tmp_path / "two.py", tiny_qwen2_dir, pairs_jsonl, batch_size=1, dropout=0.0)
    one = write(tmp_path / "one.py", tiny_qwen2_dir, pairs_jsonl, batch_size=2, dropout=0.0)
    result = run_sfttool([str(two), "--work-dir", str(tmp_path / "two"), "--nproc-per-node", "2"], timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    single = train(str(one), work_dir=str(tmp_path / "one"))
    a = load_file(tmp_path / "two" / "hf_adapter" / "adapter_model.safetensors")
    b = load_file(single / "hf_adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_full_finetune_dpo_resumes_bit_exactly(tmp_path, tiny_qwen2_dir, pairs_jsonl):
    from engine_helpers import Interrupted

    from sfttool.engine.train import train
    cfg = write(tmp_path / "full_ft.py", tiny_qwen2_dir, pairs_jsonl, lora=False)
    full = train(str(cfg), work_dir=str(tmp_path / "full"))
    stop = {"custom_hooks": [dict(type="engine_helpers.StopAfterIter", n=8)]}
    with pytest.raises(Interrupted):
        train(str(cfg), work_dir=str(tmp_path / "resumed"), cfg_options=stop)
    checkpoint = torch.load(tmp_path / "resumed" / "iter_8.pth", map_location="cpu", weights_only=False)
    assert checkpoint["state_dict"] and not any(k.startswith("ref_llm.") for k in checkpoint["state_dict"])
    resumed = train(str(cfg), work_dir=str(tmp_path / "resumed"), resume="auto")
    a = load_file(full / "hf_model" / "model.safetensors")
    b = load_file(resumed / "hf_model" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    base = load_file(tiny_qwen2_dir / "model.safetensors")
    assert any(not torch.equal(a[k], base[k]) for k in a if k in base)  # it trained
