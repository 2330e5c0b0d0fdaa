"""QLoRA (bitsandbytes 4-bit on CPU) trained by the runner, with a generation
hook before training and mid-run: evaluation must not stop LoRA from learning
(bnb repacks 4-bit weights for inference after an eval-mode forward)."""
from __future__ import annotations

import pytest
from safetensors.torch import load_file

from engine_helpers import logged, mean

EVAL_HOOK = """[dict(type=EvaluateChatHook, tokenizer=tokenizer, every_n_iters=8, max_new_tokens=4,
                evaluation_inputs=['hello world?'], prompt_template=prompt_template)]"""


@pytest.mark.slow
def test_qlora_learns_through_generation_hooks(tmp_path, tiny_config):
    pytest.importorskip("bitsandbytes")
    from sfttool.engine.train import train

    cfg = tiny_config(qlora=True, lr=5e-3, max_epochs=1, accumulative_counts=1, dropout=0.0,
                      save_steps=100, custom_hooks=EVAL_HOOK)
    work_dir = train(str(cfg), work_dir=str(tmp_path / "work"))
    # generations happened before training and mid-run, yet the adapter trained and the loss fell
    assert {p.name for p in (work_dir / "eval_outputs").glob("*.jsonl")} >= {"iter_0.jsonl", "iter_8.jsonl",
                                                                                "iter_16.jsonl"}
    losses = logged(work_dir)
    assert mean(losses[-8:]) < mean(losses[:8]) - 0.1
    adapter = load_file(work_dir / "hf_adapter" / "adapter_model.safetensors")
    assert all(v.abs().sum() > 0 for k, v in adapter.items() if "lora_B" in k)
