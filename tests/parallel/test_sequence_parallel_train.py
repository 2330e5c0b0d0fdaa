"""``sfttool train`` with ``sequence_parallel_size = 2`` on 2 CPU processes trains exactly as one process
on the whole rows: the sampler gives both ranks the same rows, the loss normaliser counts each row once."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ENGINE_TESTS = Path(__file__).resolve().parents[1] / "engine"
sys.path.insert(0, str(ENGINE_TESTS))
from engine_helpers import logged, write_config  # noqa: E402
from test_distributed import run_sfttool  # noqa: E402

pytestmark = pytest.mark.timeout(900)  # tests here launch several processes

SEQUENCE_PARALLEL = ("from sfttool.parallel.sequence import SequenceParallelSampler\n"
                     "sequence_parallel_size = {sp}\n")


def sequence_parallel_config(path: Path, sp: int, **kwargs) -> Path:
    """The engine tests' tiny config with PART 1's ``sequence_parallel_size`` and XTuner's sampler line."""
    write_config(path, **kwargs)
    text = path.read_text().replace("seed = 7\n", "seed = 7\n" + SEQUENCE_PARALLEL.format(sp=sp))
    text = text.replace("sampler=dict(type=DefaultSampler, shuffle=True, seed=seed)",
                        "sampler=dict(type=SequenceParallelSampler, shuffle=True, seed=seed)")
    path.write_text(text)
    return path


# 40 packed rows of up to 128 tokens; a quarter epoch = 10 iterations = 5 optimizer steps
COMMON = dict(max_epochs=0.25, lr=5e-3, dropout=0.0, save_steps=100)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, tiny_qwen2_dir, tiny_sft_jsonl) -> Path:
    from sfttool.engine.train import train

    tmp = tmp_path_factory.mktemp("one_process")
    whole = write_config(tmp / "one.py", model_dir=tiny_qwen2_dir, data_file=tiny_sft_jsonl, **COMMON)
    return train(str(whole), work_dir=str(tmp / "work"))


@pytest.mark.slow
# DDP, and DeepSpeed ZeRO-2 (its gradients are reduced over the data-parallel group as DDP's are; ZeRO-3
# runs across two simulated nodes in tests/engine/test_distributed.py).
@pytest.mark.parametrize("deepspeed", [None, "zero2"])
def test_two_ranks_sharing_each_row_train_like_one_rank(tmp_path, tiny_qwen2_dir, tiny_sft_jsonl, one_process,
                                                        deepspeed):
    from safetensors.torch import load_file

    split = sequence_parallel_config(tmp_path / "sp.py", sp=2, model_dir=tiny_qwen2_dir, data_file=tiny_sft_jsonl,
                                     **COMMON)
    args = [str(split), "--work-dir", str(tmp_path / "sp"), "--nproc-per-node", "2"]
    result = run_sfttool(args + (["--deepspeed", deepspeed] if deepspeed else []))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # each iteration reads one row on both ranks (the same row), so the run has the one process's length;
    # the logged loss of each optimizer step is the whole rows' on both
    assert len(logged(tmp_path / "sp")) == len(logged(one_process)) == 5
    torch.testing.assert_close(logged(tmp_path / "sp"), logged(one_process), rtol=1e-5, atol=0)
    a = load_file(tmp_path / "sp" / "hf_adapter" / "adapter_model.safetensors")
    b = load_file(one_process / "hf_adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and len(a) > 0
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6)
