"""The dependencies' start-up noise is filtered in every command, from the CLI's group, at its source
(``sfttool.compat.quiet_library_noise``); what it says that matters is kept."""
from __future__ import annotations

import logging
import os
import subprocess
import sys

from sfttool import compat

NOISE = ("Setting accelerator to CPU", "LOAD REPORT", "Failed to load CPU gemm_4bit_forward",
         "Skipping publisher trust check", "is_gradient_checkpointing", "Loading weights", "Writing model shards",
         "Traceback")


def sfttool(*args: str, cwd) -> str:
    """The real `sfttool` entry point in a fresh process: every library imported (and heard) anew."""
    env = dict(os.environ, COLUMNS="200")
    done = subprocess.run([sys.executable, "-c", "from sfttool.cli.main import cli; cli()", *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def test_convert_merge_and_check_custom_dataset_say_only_their_own_lines(tmp_path, tiny_qwen2_dir, tiny_sft_jsonl):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir),
                           LoraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    model.save_pretrained(tmp_path / "adapter")
    AutoTokenizer.from_pretrained(tiny_qwen2_dir).save_pretrained(tmp_path / "adapter")
    out = sfttool("convert", "merge", str(tiny_qwen2_dir), str(tmp_path / "adapter"), str(tmp_path / "merged"),
                  cwd=tmp_path)
    assert out == f"Saved to {tmp_path / 'merged'}\n"
    out = sfttool("check-custom-dataset", "qwen2_5_0_5b_instruct_lora_alpaca_e3", "--cfg-options",
                  f"pretrained_model_name_or_path={tiny_qwen2_dir}", f"data_path={tiny_sft_jsonl}",
                  "dataset_map_fn=None", cwd=tmp_path)
    assert "OK: 0 errors, 0 warnings" in out and not [noise for noise in NOISE if noise in out]
    assert "okenizing (template mode)" in out  # the pipeline's own stages still show their progress


def test_a_load_report_is_one_line_with_the_same_facts(tiny_qwen2_dir, caplog):
    from transformers import AutoModelForSequenceClassification
    compat.quiet_library_noise()
    with caplog.at_level(logging.WARNING, logger="transformers.modeling_utils"):
        AutoModelForSequenceClassification.from_pretrained(tiny_qwen2_dir, num_labels=1)
    assert [r.getMessage() for r in caplog.records if r.name == "transformers.modeling_utils"] == [
        f"loaded Qwen2ForSequenceClassification from: {tiny_qwen2_dir}: weights 1 unused (lm_head.weight); "
        "1 newly initialised (score.weight)"]


def test_mmengine_noise_leaves_the_terminal_and_stays_in_the_log_file(tmp_path, capsys):
    from mmengine.logging import MMLogger
    with compat.quiet_console(verbose=False):
        logger = MMLogger.get_instance("noise_test", log_file=str(tmp_path / "run.log"))
    message = ("Dataset StreamingPackedDataset has no metainfo. ``dataset_meta`` in visualizer will be None.")
    logger.warning(message)
    logger.warning("a warning of our own")
    for handler in logger.handlers:
        handler.flush()
    terminal = capsys.readouterr()
    assert "a warning of our own" in terminal.out + terminal.err
    assert "has no metainfo" not in terminal.out + terminal.err
    assert message in (tmp_path / "run.log").read_text()
