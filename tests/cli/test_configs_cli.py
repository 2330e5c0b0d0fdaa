"""`sfttool list-cfg`, `sfttool copy-cfg`, `--help` everywhere, and config
errors reaching the command line as one line with exit code 1."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from sfttool.cli.main import cli
from sfttool.config import builtin_config_dir, list_configs

QLORA = "qwen2_5_7b_instruct_qlora_alpaca_e3"   # imports _base_/peft.py and _base_/runtime.py
FULL = "qwen2_5_0_5b_instruct_full_alpaca_e3"   # imports _base_/runtime.py only


def _run(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def _listed(output):
    """(config names, preset names) from list-cfg's output: a config line starts with its name, after
    a header line; a preset line is its name."""
    configs, presets = output.split("DEEPSPEED PRESETS")
    lines = lambda block: [line for line in block.splitlines() if line and not line.startswith("=")]  # noqa: E731
    config_lines = lines(configs)
    assert not config_lines or config_lines[0].startswith("NAME  ")
    return [line.split()[0] for line in config_lines[1:]], lines(presets)


def test_list_cfg_filters_case_insensitively():
    result = _run("list-cfg", "-p", "QWEN")
    assert result.exit_code == 0
    configs, presets = _listed(result.output)
    assert configs == [n for n in list_configs() if "qwen" in n] and len(configs) >= 10
    assert presets == []


def test_list_cfg_without_pattern_lists_configs_and_deepspeed_presets():
    configs, presets = _listed(_run("list-cfg").output)
    assert configs == list_configs()
    assert {"zero2", "zero3"} <= set(presets)


def test_list_cfg_says_when_nothing_matches():
    assert "(nothing matches 'no-such-model')" in _run("list-cfg", "-p", "no-such-model").output


def test_list_cfg_shows_method_model_size_data_and_memory_in_columns():
    lines = _run("list-cfg", "-p", "_7b_instruct_qlora_").output.splitlines()
    header, rows = lines[1], lines[2:-1]
    assert header.split("  ")[0] == "NAME" and [t.strip() for t in header.split("  ") if t.strip()] == [
        "NAME", "METHOD", "MODEL", "DATA", "MEMORY (ESTIMATE)"]
    assert [row.split()[0] for row in rows] == [n for n in list_configs() if "_7b_instruct_qlora_" in n]
    row = next(r for r in rows if r.startswith(QLORA + " "))
    assert [cell.strip() for cell in row.split("  ") if cell.strip()] == [
        QLORA, "QLoRA SFT", "7.6B", "Alpaca, 52k instructions (hub)", "one 16 GB GPU"]
    # Each column starts where its title does, on every line.
    starts = [header.index(title) for title in ("METHOD", "MODEL", "DATA", "MEMORY")]
    for line in rows:
        assert all(line[start - 2:start] == "  " and line[start] != " " for start in starts), line


def test_list_cfg_names_a_config_without_the_line(tmp_path, monkeypatch):
    from sfttool.cli import configs

    (tmp_path / "mine_e1.py").write_text('"""A config of my own."""\nx = 1\n')
    (tmp_path / "other_e1.py").write_text('"""Two fields only.\n\nAt a glance: LoRA SFT | 1B\n"""\n')
    monkeypatch.setattr(configs, "builtin_config_dir", lambda: tmp_path)
    assert configs.config_table(["mine_e1", "other_e1"])[1:] == [
        "mine_e1   (its docstring has no 'At a glance:' line)",
        "other_e1  (its docstring has no 'At a glance:' line)"]


@pytest.mark.parametrize("name, bases", [(QLORA, ["peft.py", "runtime.py"]), (FULL, ["runtime.py"])])
def test_copy_cfg_output_loads_from_another_directory(tmp_path, monkeypatch, name, bases):
    from mmengine.config import Config

    out = tmp_path / "mine"
    result = _run("copy-cfg", name, str(out))
    assert result.exit_code == 0, result.output
    copy = out / f"{name}_copy.py"
    assert copy.read_text() == (builtin_config_dir() / f"{name}.py").read_text()
    assert sorted(p.name for p in (out / "_base_").iterdir()) == bases
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = Config.fromfile(str(copy))
    assert cfg.pretrained_model_name_or_path.startswith("Qwen/")
    assert cfg.default_hooks.logger.interval == 10          # from the copied _base_/runtime.py
    assert cfg.default_hooks.checkpoint.interval == cfg.save_steps


def test_copy_cfg_runs_from_a_fresh_interpreter_elsewhere(tmp_path):
    """The acceptance check as a user would run it: plain mmengine, another cwd."""
    _run("copy-cfg", QLORA, str(tmp_path / "mine"))
    code = ("from mmengine.config import Config; "
            f"cfg = Config.fromfile({str(tmp_path / 'mine' / (QLORA + '_copy.py'))!r}); "
            "print(cfg.model.lora.r, cfg.model.llm.quantization_config.bnb_4bit_quant_type)")
    out = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.stdout.split()[-2:] == ["64", "nf4"]


def test_copy_cfg_keeps_edited_files_unless_forced(tmp_path):
    out = tmp_path / "mine"
    assert _run("copy-cfg", QLORA, str(out)).exit_code == 0
    assert _run("copy-cfg", QLORA, str(out)).exit_code == 0   # identical files: fine
    copy = out / f"{QLORA}_copy.py"
    copy.write_text(copy.read_text() + "\nlr = 1e-5\n")
    result = _run("copy-cfg", QLORA, str(out))
    assert result.exit_code == 1
    assert f"{copy} already exists and differs" in result.output and "--force" in result.output
    assert copy.read_text().endswith("lr = 1e-5\n")
    assert _run("copy-cfg", QLORA, str(out), "--force").exit_code == 0
    assert not copy.read_text().endswith("lr = 1e-5\n")


def test_copy_cfg_unknown_name_lists_close_matches(tmp_path):
    result = _run("copy-cfg", "qwen2_5_7b_instruct_qlora_alpaka_e3", str(tmp_path))
    assert result.exit_code == 1
    assert result.output.startswith("Error: qwen2_5_7b_instruct_qlora_alpaka_e3: no such config")
    assert "Close matches: qwen2_5_7b_instruct_qlora_alpaca_e3" in result.output
    assert "Traceback" not in result.output and list(tmp_path.iterdir()) == []


def test_copy_cfg_refuses_a_local_file(tmp_path):
    local = tmp_path / "mine.py"
    local.write_text("x = 1\n")
    result = _run("copy-cfg", str(local), str(tmp_path / "out"))
    assert result.exit_code == 1 and "not a built-in config" in result.output


def test_every_command_has_help():
    for name in cli.commands:
        result = _run(name, "--help")
        assert result.exit_code == 0 and "Usage: " in result.output, name


def test_train_on_a_config_with_a_syntax_error_is_one_line_exit_1(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("model = dict(\n    lr=1e-4,\n\noptim_wrapper = 1\n")
    result = CliRunner().invoke(cli, ["train", str(bad)])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit)
    assert "Traceback" not in result.output
    assert result.output.strip().splitlines()[-1].startswith(f"Error: {bad}:1: syntax error")


def test_train_on_a_config_missing_keys_names_the_file_and_every_key(tmp_path):
    partial = tmp_path / "partial.py"
    partial.write_text("train_cfg = dict(max_epochs=1)\n")
    result = CliRunner().invoke(cli, ["train", str(partial)])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit)
    assert "Traceback" not in result.output
    for key in ("model", "train_dataloader", "optim_wrapper"):
        assert f"{partial}: missing `{key}`" in result.output


def test_train_on_an_unknown_builtin_name_suggests_close_matches():
    result = CliRunner().invoke(cli, ["train", "llama3_1_8b_instruct_qlora_alpaca_e2"])
    assert result.exit_code == 1
    assert "Close matches: llama3_1_8b_instruct_qlora_alpaca_e3" in result.output


def test_copy_cfg_copies_the_builtin_even_if_a_local_file_has_its_name(tmp_path, monkeypatch):
    (tmp_path / f"{FULL}.py").write_text("x = 1\n")
    monkeypatch.chdir(tmp_path)
    result = _run("copy-cfg", FULL, "out")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "out" / f"{FULL}_copy.py").read_text() == (builtin_config_dir() / f"{FULL}.py").read_text()
