"""DPO runs with precomputed reference log-probs through ``sfttool train``: a full fine-tune (its
frozen reference freed after the pre-pass) resumes bit-exactly and trains like the run with the
reference forward in every step; two processes under DeepSpeed ZeRO-3 share the pre-pass, finish and
resume bit-exactly."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_preference_distributed import (_output, pairs_jsonl, resume_from_the_middle, run_sfttool,  # noqa: E402,F401
                                         write)

pytestmark = pytest.mark.timeout(900)  # tests here launch several processes

PRECOMPUTE = {"model.precompute_ref_log_probs": True}


def weights(path) -> dict:
    return load_file(path / "hf_model" / "model.safetensors")


@pytest.mark.slow
def test_a_full_finetune_with_precomputed_reference_resumes_bit_exactly(tmp_path, tiny_qwen2_dir, pairs_jsonl):
    from engine_helpers import Interrupted

    from sfttool.engine.train import train
    cfg = write(tmp_path / "full_ft.py", tiny_qwen2_dir, pairs_jsonl, lora=False)
    full = train(str(cfg), work_dir=str(tmp_path / "full"), cfg_options=PRECOMPUTE)
    log = next((tmp_path / "full").rglob("*.log")).read_text()
    assert "Reference log-probs: 16 pairs in 16 rows in" in log
    stop = dict(PRECOMPUTE, custom_hooks=[dict(type="engine_helpers.StopAfterIter", n=8)])
    with pytest.raises(Interrupted):
        train(str(cfg), work_dir=str(tmp_path / "resumed"), cfg_options=stop)
    resumed = train(str(cfg), work_dir=str(tmp_path / "resumed"), resume="auto", cfg_options=PRECOMPUTE)
    a, b = weights(full), weights(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # The same run with the reference forward in every step: the same training, up to float rounding.
    on_the_fly = weights(train(str(cfg), work_dir=str(tmp_path / "on_the_fly")))
    base = load_file(tiny_qwen2_dir / "model.safetensors")
    assert any(not torch.equal(a[k], base[k]) for k in a if k in base)  # it trained
    for k in a:
        torch.testing.assert_close(a[k], on_the_fly[k], rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_two_process_zero3_full_finetune_with_precomputed_reference_resumes_bit_exactly(
        tmp_path, tiny_qwen2_dir, pairs_jsonl):
    launch = ["--nproc-per-node", "2", "--deepspeed", "zero3", "--cfg-options", "model.precompute_ref_log_probs=True"]
    go = write(tmp_path / "go.py", tiny_qwen2_dir, pairs_jsonl, lora=False)
    full = run_sfttool([str(go), "--work-dir", str(tmp_path / "full"), *launch], timeout=900)
    assert full.returncode == 0, full.stdout[-3000:] + full.stderr[-3000:]
    assert "Reference log-probs: 16 pairs in 16 rows in" in _output(full, tmp_path / "full")
    resume_from_the_middle(go, tmp_path / "full", tmp_path / "resumed", launch)
    a, b = weights(tmp_path / "full"), weights(tmp_path / "resumed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not any(k.startswith("ref_llm") for k in a)
