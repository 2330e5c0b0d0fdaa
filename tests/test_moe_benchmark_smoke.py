"""`benchmarks/moe_step.py` runs end to end at a minimal size and writes the JSON fields docs/benchmarks.md
quotes. Not a timed test: figures are only checked to be present and sane."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_moe_step_benchmark(tmp_path):
    out = tmp_path / "moe_step.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "moe_step.py"), "--methods", "lora", "--experts",
                           "eager", "--length", "128", "--steps", "1", "--warmup", "1", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["benchmark"] == "moe_step"
    by_model = {r["model"]: r for r in report["results"]}
    dense, moe = by_model["dense"], by_model["moe"]
    assert moe["experts"] == "eager" and moe["params"] > dense["params"]
    assert abs(moe["active_params"] - dense["active_params"]) / dense["active_params"] < 0.01  # router only
    for r in (dense, moe):
        assert r["step_s"] > 0 and r["tokens_per_s"] > 0 and r["peak_mem_mib"] > 0 and r["memory_kind"] == "peak_rss"
        assert 0 < r["trainable_params"] < r["params"]
    assert moe["last_aux_loss"] > 0 and dense["last_aux_loss"] is None
