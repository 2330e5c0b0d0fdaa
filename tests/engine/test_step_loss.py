"""The loss a run logs for an optimizer step is the loss one batch holding the step's rows reports:
transformers' own loss on the samples of all of the step's micro-batches (on every process), unpacked,
in one padded batch. The run trains with lr 1e-30, so the model of every step is the one the reference
loads; its micro-batches are packed rows with unequal trained-token counts."""
from __future__ import annotations

import pytest
import torch

from engine_helpers import logged, samples_of, transformers_loss, write_config

pytestmark = pytest.mark.timeout(900)  # the two-process run launches several processes

RECORD = "[dict(type='engine_helpers.RecordBatches')]"


def step_config(tmp_path, model_dir, data_file):
    """A quarter epoch of the 40 packed rows, 2 iterations per optimizer step, every step logged."""
    return write_config(tmp_path / "steps.py", model_dir, data_file, accumulative_counts=2, max_epochs=0.25,
                        lr=1e-30, dropout=0.0, save_steps=100, custom_hooks=RECORD)


def reference_losses(model_dir, ranks: list[list[dict]], per_step: int) -> tuple[list[float], list[list[int]]]:
    """Per optimizer step: the reference loss of its micro-batches on every rank, and their
    trained-token counts."""
    losses, counts = [], []
    for start in range(0, len(ranks[0]), per_step):
        step = [batch for rank in ranks for batch in rank[start:start + per_step]]
        samples = [sample for batch in step for sample in samples_of(batch)]
        losses.append(transformers_loss(model_dir, samples))
        counts.append([int((batch["labels"][:, 1:] != -100).sum()) for batch in step])
    return losses, counts


@pytest.mark.slow
def test_the_logged_step_loss_is_one_batchs_loss(tmp_path, tiny_qwen2_dir, tiny_sft_jsonl):
    from sfttool.engine.train import train

    work = train(str(step_config(tmp_path, tiny_qwen2_dir, tiny_sft_jsonl)), work_dir=str(tmp_path / "one"))
    batches = torch.load(work / "batches_rank0.pt")
    want, counts = reference_losses(tiny_qwen2_dir, [batches], per_step=2)
    assert len(batches) == 10 and len(want) == 5
    assert all(len(set(c)) == 2 for c in counts)  # every step: two micro-batches of unequal token counts
    assert logged(work) == pytest.approx(want, rel=1e-5)


@pytest.mark.slow
def test_the_logged_step_loss_is_one_batchs_loss_with_two_processes(tmp_path, tiny_qwen2_dir, tiny_sft_jsonl):
    """5 iterations per process: steps of 2, 2 and 1 micro-batches on each of the two."""
    from test_distributed import run_sfttool

    config = step_config(tmp_path, tiny_qwen2_dir, tiny_sft_jsonl)
    result = run_sfttool([str(config), "--work-dir", str(tmp_path / "two"), "--nproc-per-node", "2"], timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [torch.load(tmp_path / "two" / f"batches_rank{r}.pt") for r in (0, 1)]
    want, counts = reference_losses(tiny_qwen2_dir, ranks, per_step=2)
    assert [len(r) for r in ranks] == [5, 5] and [len(c) for c in counts] == [4, 4, 2]
    assert all(len(set(c)) > 1 for c in counts)
    assert logged(tmp_path / "two") == pytest.approx(want, rel=1e-5)
