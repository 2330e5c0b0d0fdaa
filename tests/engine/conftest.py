"""Engine test fixtures. This folder goes on ``sys.path`` so configs can name
test hooks by dotted path (``engine_helpers.StopAfterIter``)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from engine_helpers import lockstep_config, two_ranks, write_config  # noqa: E402


@pytest.fixture
def tiny_config(tmp_path, tiny_qwen2_dir, tiny_sft_jsonl):
    """``tiny_config(**overrides) -> Path`` of a config file in this test's temp dir."""
    def make(name: str = "tiny_lora.py", **overrides) -> Path:
        return write_config(tmp_path / name, tiny_qwen2_dir, tiny_sft_jsonl, **overrides)
    return make


@pytest.fixture(scope="session")
def two_rank_run(tmp_path_factory, tiny_qwen2_dir, tiny_sft_jsonl):
    """``two_rank_run(deepspeed=None) -> (config, work_dir, result)``: the two-process run of
    ``lockstep_config`` (DDP, or DeepSpeed ``deepspeed``), launched once per session; the lockstep
    tests read it and the resume tests take it as their uninterrupted run."""
    from test_distributed import run_sfttool

    runs = {}

    def run(deepspeed: str | None = None):
        if deepspeed not in runs:
            tmp = tmp_path_factory.mktemp(f"two_rank_{deepspeed or 'ddp'}")
            config = lockstep_config(tmp / "ddp.py", tiny_qwen2_dir, tiny_sft_jsonl)
            runs[deepspeed] = (config, tmp / "work",
                               run_sfttool([str(config), "--work-dir", str(tmp / "work"), *two_ranks(deepspeed)]))
        return runs[deepspeed]
    return run
