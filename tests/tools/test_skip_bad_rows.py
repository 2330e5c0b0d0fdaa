"""Tool-calling rows under a chat template without tool support: `sfttool train` and
`sfttool check-custom-dataset` refuse them with the same line (file, row, what the template leaves
out, the fix), and with --skip-bad-rows both drop them, counted."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from sfttool.cli.main import cli
from sfttool.dataset.map_fns import openai_map_fn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from engine_helpers import write_config  # noqa: E402

PLAIN = {"messages": [{"role": "user", "content": "one two?"}, {"role": "assistant", "content": "three."}]}
CALL_ONLY = {"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}], "messages": [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
    {"role": "tool", "content": "12 C"}, {"role": "assistant", "content": "12 C in Oslo."}]}


@pytest.fixture
def tool_rows_cfg(tmp_path, tiny_qwen2_dir):
    """The tiny model's ChatML template (no tool support, as SmolLM2's) and standard rows, row 3 calling a tool."""
    data = tmp_path / "data.jsonl"
    rows = [PLAIN] * 3 + [CALL_ONLY] + [PLAIN] * 3
    data.write_text("".join(json.dumps(openai_map_fn(row)) + "\n" for row in rows), encoding="utf-8")
    return write_config(tmp_path / "cfg.py", tiny_qwen2_dir, data, template="hf_chat_template", max_epochs=1), data


def run(*args):
    result = CliRunner().invoke(cli, [*map(str, args)])
    return result.exit_code, result.output


def test_both_commands_refuse_the_row_with_one_same_line(tmp_path, tool_rows_cfg):
    cfg, data = tool_rows_cfg
    line = (f"{data}, row 3: the tokenizer's chat template does not render tool calls, so an answer of this row "
            "would be trained as '<|im_end|>'; use a chat format that renders them (PROMPT_TEMPLATE.qwen2_5, "
            "qwen3, llama3_1) or hf_chat_template with a tokenizer whose chat template renders them, or "
            "--skip-bad-rows to drop such rows (counted)")
    code, out = run("check-custom-dataset", cfg, "--no-color")
    assert code == 1 and f"ERROR: {line}\n" in out, out
    code, out = run("train", cfg, "--work-dir", tmp_path / "work", "--dry-run")
    assert code == 1 and out.endswith(f"Error: {line}\n"), out


def test_check_custom_dataset_drops_them_counted_with_the_flag(tool_rows_cfg):
    cfg, _ = tool_rows_cfg
    code, out = run("check-custom-dataset", cfg, "--no-color", "--skip-bad-rows")
    assert code == 0, out
    assert "rows in: 7   rows out: " in out
    assert "dropped 1 rows: the template does not render its tool calls (--skip-bad-rows) (row 3)" in out


@pytest.mark.slow
def test_train_drops_them_counted_with_the_flag(tmp_path, tool_rows_cfg):
    cfg, _ = tool_rows_cfg
    work = tmp_path / "work"
    code, out = run("train", cfg, "--work-dir", work, "--dry-run", "--skip-bad-rows")
    assert code == 0, out
    assert "Dataset: dropped 1 rows: the template does not render its tool calls (--skip-bad-rows) (row 3)" in out
    assert out.rstrip().endswith("Dry run finished: the config, data and one training step work")
