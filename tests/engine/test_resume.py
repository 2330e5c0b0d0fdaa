"""Resume exactness: interrupted after iteration k + `--resume` == uninterrupted, bit for bit."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from engine_helpers import Interrupted


@pytest.mark.slow
def test_resume_is_bit_identical(tmp_path, tiny_config):
    from sfttool.engine.train import train

    # Dropout on (RNG matters), accumulation 2 (resume at a step boundary), 1.3 epochs
    # (the resume lands mid-epoch and training crosses an epoch boundary afterwards).
    cfg = tiny_config(max_epochs=1.3, dropout=0.1, accumulative_counts=2, save_steps=4, keep=1)
    full = train(str(cfg), work_dir=str(tmp_path / "full"))
    stop = {"custom_hooks": [dict(type="engine_helpers.StopAfterIter", n=28)]}
    with pytest.raises(Interrupted):
        train(str(cfg), work_dir=str(tmp_path / "resumed"), cfg_options=stop)
    assert sorted(p.name for p in (tmp_path / "resumed").glob("iter_*")) == ["iter_28.pth"]
    resumed = train(str(cfg), work_dir=str(tmp_path / "resumed"), resume="auto")

    a = load_file(full / "hf_adapter" / "adapter_model.safetensors")
    b = load_file(resumed / "hf_adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_latest_checkpoint_ignores_unfinished(tmp_path):
    from sfttool.engine.checkpoint import find_latest_checkpoint

    assert find_latest_checkpoint(tmp_path) is None
    (tmp_path / "iter_8.pth").write_bytes(b"x")
    (tmp_path / "iter_12.pth").mkdir()  # DeepSpeed checkpoints are folders
    (tmp_path / "iter_16.pth.tmp").write_bytes(b"partial")  # killed mid-save
    assert find_latest_checkpoint(tmp_path).name == "iter_12.pth"


def test_resume_without_checkpoint_is_a_clear_error(tmp_path):
    from sfttool.config import ConfigError
    from sfttool.engine.train import resolve_resume

    with pytest.raises(ConfigError, match="no checkpoint"):
        resolve_resume("auto", tmp_path)
    with pytest.raises(ConfigError, match="no such checkpoint"):
        resolve_resume(str(tmp_path / "iter_3.pth"), tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("launch", [["--deepspeed", "zero2"], ["--nproc-per-node", "2"],
                                    ["--nproc-per-node", "2", "--deepspeed", "zero2"]], ids=["zero2", "ddp2", "zero2x2"])
def test_subprocess_resume_is_bit_identical(tmp_path, tiny_qwen2_dir, tiny_sft_jsonl, launch):
    """The same under DeepSpeed ZeRO-2 (its strategy skips mmengine's checkpoint
    hooks; the RNG states travel in the message hub), and with two processes,
    DDP and ZeRO-2 (each rank's data position and dropout stream must come back;
    rank 0 alone writes the message hub, so the states are gathered to it)."""
    from engine_helpers import write_config
    from test_distributed import run_sfttool

    stop_at = 6 if "--nproc-per-node" in launch else 12  # two ranks: half the iterations each
    go = write_config(tmp_path / "go.py", tiny_qwen2_dir, tiny_sft_jsonl, max_epochs=0.5, save_steps=stop_at)
    stop = write_config(tmp_path / "stop.py", tiny_qwen2_dir, tiny_sft_jsonl, max_epochs=0.5, save_steps=stop_at,
                        custom_hooks=f"[dict(type='engine_helpers.StopAfterIter', n={stop_at})]")
    full = run_sfttool([str(go), "--work-dir", str(tmp_path / "full"), *launch])
    assert full.returncode == 0, full.stderr[-3000:]
    assert run_sfttool([str(stop), "--work-dir", str(tmp_path / "resumed"), *launch]).returncode == 1
    result = run_sfttool([str(go), "--work-dir", str(tmp_path / "resumed"), *launch, "--resume"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"Resuming at iteration {stop_at}" in result.stdout + result.stderr

    a = load_file(tmp_path / "full" / "hf_adapter" / "adapter_model.safetensors")
    b = load_file(tmp_path / "resumed" / "hf_adapter" / "adapter_model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_rng_states_of_more_ranks_than_this_run_restore_rank_0s_with_a_warning():
    import logging
    import random
    from types import SimpleNamespace

    from mmengine.logging import MessageHub, MMLogger

    from sfttool.engine.checkpoint import _rng_state, restore_rng_state

    random.seed(1)
    rank0 = _rng_state()
    random.seed(2)
    rank1 = _rng_state()
    expected = random.Random(1).random()
    hub = MessageHub.get_instance("rng_restore_test")
    hub.update_info("rng_state", [rank0, rank1])
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = MMLogger.get_current_instance()
    logger.addHandler(handler)
    try:
        assert restore_rng_state(SimpleNamespace(message_hub=hub))
    finally:
        logger.removeHandler(handler)
    assert random.random() == expected
    assert any("RNG states of 2 process(es) and this run has 1" in r.getMessage() for r in records)
