"""The README's offline quick start, run as written: its commands in order, from a folder that holds the
repository's examples/, with the demo's exported SmolLM2 folder (~/.cache/sfttool/smollm2-135m-instruct,
under a temporary HOME) holding the tiny Llama instead."""
from __future__ import annotations

import os
import re
import shlex
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from sfttool.cli.main import cli

ROOT = Path(__file__).resolve().parents[1]
RUN = "demo_smollm2_135m_lora_self_identity_e3_copy"


def offline_quick_start() -> list[str]:
    """The command lines of the README's second Quick start block (offline, on a CPU)."""
    readme = (ROOT / "README.md").read_text()
    start = readme.index("## Quick start")
    section = readme[start:readme.index("\n## ", start + 1)]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    assert len(blocks) == 2, "the Quick start shows a GPU + hub block, then the offline block"
    return [line.strip() for line in blocks[1].replace("\\\n", " ").splitlines() if line.strip()]


def test_the_offline_quick_start_needs_no_hub_and_no_gpu():
    lines = offline_quick_start()
    assert [shlex.split(line)[1] for line in lines] == [
        "list-cfg", "copy-cfg", "check-custom-dataset", "train", "plot", "convert", "chat"]
    text = " ".join(lines)
    assert "--deepspeed" not in text and "Qwen/" not in text
    assert "data_path=examples/custom_dataset/messages.jsonl dataset_map_fn=openai_map_fn" in text


@pytest.mark.slow
def test_the_offline_quick_start_runs_as_written(tmp_path, monkeypatch, tiny_llama_dir):
    home = tmp_path / "home"
    shutil.copytree(tiny_llama_dir, home / ".cache" / "sfttool" / "smollm2-135m-instruct")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("SFTTOOL_CACHE", raising=False)
    repo = tmp_path / "repo"
    shutil.copytree(ROOT / "examples", repo / "examples")
    monkeypatch.chdir(repo)
    outputs = []
    for line in offline_quick_start():
        args = [os.path.expanduser(arg) for arg in shlex.split(line, comments=True)]  # what the shell does to ~/
        result = CliRunner().invoke(cli, args[1:])
        assert result.exit_code == 0, f"`{line}`:\n{result.output[-3000:]}"
        outputs.append(result.output)
    assert "demo_smollm2_135m_lora_self_identity_e3" in outputs[0]
    assert "OK: 0 errors" in outputs[2]
    work = repo / "work_dirs" / RUN
    assert (work / "loss.png").is_file() and (work / "hf_adapter" / "adapter_model.safetensors").is_file()
    assert (repo / "brightline-135m" / "config.json").is_file()
