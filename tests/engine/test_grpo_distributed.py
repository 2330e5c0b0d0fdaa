"""GRPO in two CPU processes (gloo): 2 processes with half the prompts each train like 1 process with all
of them (rewards scaled by the batch std over both); under DeepSpeed ZeRO-2 and ZeRO-3 the run finishes, and
under ZeRO-3 a run resumed from a checkpoint inside a generation round ends as the uninterrupted run, bit for
bit (ZeRO-2's checkpoints resume as SFT's do, tests/engine/test_resume.py; the round comes back from the
message hub under either). The resumed run starts from the uninterrupted run's checkpoint, which is what a
run stopped there saves: one launch fewer; the single-process SIGTERM test, tests/engine/test_grpo_train.py,
stops a run for real.)"""
from __future__ import annotations

import pytest
import torch

from engine_helpers import logged, two_ranks
from grpo_helpers import adapter, addition_rows, write_grpo_config
from test_distributed import run_sfttool

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def prompts_jsonl(tmp_path_factory):
    from sfttool import assets
    return assets.write_jsonl(tmp_path_factory.mktemp("grpo_data") / "add.jsonl", addition_rows(16))


def test_two_processes_train_like_one_with_the_whole_round(tmp_path, tiny_qwen2_dir, prompts_jsonl):
    """1 process: rounds of 2 prompts x 4 completions, micro-batches of 4, 2 per optimizer step. 2 processes:
    1 prompt x 4 completions each, one micro-batch per step. The same prompts per round (the sampler's order
    split between the ranks), the same completions (each sampled from its own seed), the same advantages
    (scale_rewards='batch': the std over both processes' rewards), the same updates."""
    from sfttool.engine.train import train

    common = dict(num_generations=4, batch_size=4, beta=0.04, loss_type="dapo", scale_rewards="batch",
                  scheduler="None", max_epochs=0.5)
    one = write_grpo_config(tmp_path / "one.py", tiny_qwen2_dir, prompts_jsonl, generation_batch_size=8,
                            accumulative_counts=2, **common)
    two = write_grpo_config(tmp_path / "two.py", tiny_qwen2_dir, prompts_jsonl, generation_batch_size=4,
                            accumulative_counts=1, **common)
    result = run_sfttool([str(two), "--work-dir", str(tmp_path / "two"), *two_ranks()])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    single = train(str(one), work_dir=str(tmp_path / "one"))
    assert logged(tmp_path / "two", "reward") == pytest.approx(logged(single, "reward"), abs=1e-9)
    assert logged(tmp_path / "two", "kl") == pytest.approx(logged(single, "kl"), rel=1e-3, abs=1e-8)
    a, b = adapter(tmp_path / "two"), adapter(single)
    assert a.keys() == b.keys() and len(a) > 0
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=k)


@pytest.mark.parametrize("deepspeed", ["zero2", "zero3"])
def test_deepspeed_finishes_and_zero3_resumes_inside_a_round_bit_identically(tmp_path, tiny_qwen2_dir, prompts_jsonl,
                                                                            deepspeed):
    """Per process and round: 1 prompt x 4 completions, micro-batches of 2, 2 per optimizer step, mu = 2:
    a round is 4 iterations, 2 optimizer steps. The checkpoint after iteration 6 falls inside the second
    round; each process's round comes back from it (the message hub holds both), and its dropout stream."""
    config = write_grpo_config(tmp_path / "cfg.py", tiny_qwen2_dir, prompts_jsonl, generation_batch_size=4,
                               batch_size=2, accumulative_counts=2, num_iterations=2, dropout=0.1, beta=0.04,
                               save_steps=6, keep=3, max_epochs=0.5)
    full = tmp_path / "full"
    result = run_sfttool([str(config), "--work-dir", str(full), *two_ranks(deepspeed)])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    a = adapter(full)
    assert len(a) > 0 and max(v.abs().max().item() for k, v in a.items() if "lora_B" in k) > 0  # it trained
    assert len(logged(full, "reward")) == 8
    if deepspeed != "zero3":
        return
    resumed = tmp_path / "resumed"
    result = run_sfttool([str(config), "--work-dir", str(resumed), *two_ranks(deepspeed), "--resume",
                          str(full / "iter_6.pth")])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Resuming at iteration 6" in result.stdout + result.stderr
    b = adapter(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert logged(resumed, "reward") == logged(full, "reward")[3:]  # steps 4 to 8
