"""Engine test fixtures. This folder goes on ``sys.path`` so configs can name
test hooks by dotted path (``engine_helpers.StopAfterIter``)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from engine_helpers import write_config  # noqa: E402


@pytest.fixture
def tiny_config(tmp_path, tiny_qwen2_dir, tiny_sft_jsonl):
    """``tiny_config(**overrides) -> Path`` of a config file in this test's temp dir."""
    def make(name: str = "tiny_lora.py", **overrides) -> Path:
        return write_config(tmp_path / name, tiny_qwen2_dir, tiny_sft_jsonl, **overrides)
    return make
