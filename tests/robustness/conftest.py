"""Fixtures of the robustness tests (the helpers live in robustness_runs.py)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

# Test modules here import the helpers by name, and the training subprocesses load the
# fault-injection hooks by dotted path (pytest runs with --import-mode=importlib).
sys.path.insert(0, str(Path(__file__).parent))

from robustness_runs import write_config  # noqa: E402


@pytest.fixture
def robust_config(tmp_path, tiny_qwen2_dir, tiny_sft_jsonl):
    def make(name="cfg.py", **kw) -> Path:
        return write_config(tmp_path / name, tiny_qwen2_dir, tiny_sft_jsonl, **kw)
    return make
