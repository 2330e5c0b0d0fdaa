"""Work-dir pre-flight, atomic outputs, trust_remote_code policy, rank failure report."""
from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sfttool.engine import safety
from sfttool.engine.safety import WorkDirError, apply_trust_remote_code, check_work_dir_writable
from sfttool.utils.atomic import CheckpointSaveError, atomic_output, is_partial_output


def test_work_dir_is_created_and_probed(tmp_path):
    work = tmp_path / "a" / "b"
    assert check_work_dir_writable(work) == work and work.is_dir()
    assert list(work.iterdir()) == []   # the probe file is gone


def test_work_dir_under_a_file_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(WorkDirError, match=rf"work dir {blocker}/run is not writable: \[Errno 20\] Not a "
                                           r"directory; choose another folder with --work-dir"):
        check_work_dir_writable(blocker / "run")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through permission bits")
def test_read_only_work_dir_is_a_clear_error(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(WorkDirError, match=r"is not writable: \[Errno 13\] Permission denied"):
            check_work_dir_writable(ro)
    finally:
        ro.chmod(0o755)


def test_work_dir_without_the_space_for_a_checkpoint(tmp_path):
    with pytest.raises(WorkDirError, match=r"MiB free but one checkpoint needs about"):
        check_work_dir_writable(tmp_path, need_bytes=1 << 60)


def test_checkpoint_bytes_estimate_counts_state_and_adam_moments():
    import torch

    model = torch.nn.Linear(3, 2)          # 8 fp32 parameters
    model.bias.requires_grad_(False)        # 6 trainable
    assert safety.checkpoint_bytes_estimate(model) == 8 * 4 + 6 * 4 * 2


def test_atomic_output_file_and_folder(tmp_path):
    target = tmp_path / "iter_1.pth"
    with atomic_output(target) as tmp:
        assert is_partial_output(tmp) and tmp.parent == tmp_path
        tmp.write_bytes(b"new")
    assert target.read_bytes() == b"new" and os.listdir(tmp_path) == ["iter_1.pth"]

    folder = tmp_path / "iter_2.pth"       # DeepSpeed checkpoints are folders
    for content in (b"one", b"two"):       # the second save replaces a non-empty folder
        with atomic_output(folder) as tmp:
            tmp.mkdir()
            (tmp / "shard").write_bytes(content)
    assert (folder / "shard").read_bytes() == b"two"
    assert sorted(os.listdir(tmp_path)) == ["iter_1.pth", "iter_2.pth"]


def test_failed_save_names_path_and_os_error_and_keeps_the_previous(tmp_path, monkeypatch):
    previous = tmp_path / "iter_1.pth"
    previous.write_bytes(b"good")

    def disk_full(src, dst):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst))

    monkeypatch.setattr(safety.os, "replace", disk_full)
    target = tmp_path / "iter_2.pth"
    with pytest.raises(CheckpointSaveError) as info:
        with atomic_output(target) as tmp:
            tmp.write_bytes(b"partial")
    message = str(info.value)
    assert f"could not save checkpoint {target}: [Errno 28] No space left on device" in message
    assert f"earlier checkpoints in {tmp_path} are intact" in message
    assert os.listdir(tmp_path) == ["iter_1.pth"] and previous.read_bytes() == b"good"


def test_error_while_writing_removes_the_partial_output(tmp_path):
    with pytest.raises(CheckpointSaveError, match=r"\[Errno 28\]"):
        with atomic_output(tmp_path / "x.pth") as tmp:
            tmp.write_bytes(b"half")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    with pytest.raises(ZeroDivisionError):   # non-OS errors pass through unchanged
        with atomic_output(tmp_path / "y.pth") as tmp:
            tmp.write_bytes(b"half")
            1 / 0
    assert os.listdir(tmp_path) == []


def test_kill_9_between_write_and_rename_leaves_only_a_partial_name(tmp_path):
    """The fault-injection pause, driven the way the end-to-end test drives it."""
    marker = tmp_path / "paused"
    (tmp_path / "iter_1.pth").write_bytes(b"good")
    script = ("import sys; import pause_before_rename; pause_before_rename.arm()\n"
              "from sfttool.utils.atomic import atomic_output\n"
              "with atomic_output(sys.argv[1]) as tmp: tmp.write_bytes(b'new')\n")
    env = dict(os.environ, SFTTOOL_FAULT_PAUSE_BEFORE_RENAME=str(marker), SFTTOOL_FAULT_PAUSE_MATCH="iter_2",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "iter_2.pth")], env=env)
    deadline = time.monotonic() + 60
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists(), "the save never reached the pause"
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    names = sorted(os.listdir(tmp_path))
    assert "iter_2.pth" not in names and (tmp_path / "iter_1.pth").read_bytes() == b"good"
    assert [n for n in names if is_partial_output(n)] == [Path(marker.read_text()).name]


def test_trust_remote_code_is_off_unless_asked():
    cfg = {"model": {"type": "SupervisedFinetune",
                     "llm": {"type": "transformers.AutoModelForCausalLM.from_pretrained",
                             "pretrained_model_name_or_path": "m"}},
           "tokenizer": {"type": "AutoTokenizer.from_pretrained", "pretrained_model_name_or_path": "m",
                         "trust_remote_code": True},
           "datasets": [{"type": "load_dataset", "path": "json"}]}
    assert apply_trust_remote_code(cfg) == ["tokenizer"]       # the config's own choice is kept
    assert cfg["model"]["llm"]["trust_remote_code"] is False
    assert "trust_remote_code" not in cfg["model"] and "trust_remote_code" not in cfg["datasets"][0]
    assert apply_trust_remote_code(cfg, True) == ["model.llm", "tokenizer"]
    assert cfg["model"]["llm"]["trust_remote_code"] is True
    assert "will run on this machine" in safety.remote_code_warning(["model.llm"])


def test_failing_rank_names_itself(capfd, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError):
        with safety.report_rank_failure():
            raise ValueError("bad row 7")
    assert "[sfttool] rank 1 of 2 failed: ValueError: bad row 7" in capfd.readouterr().err
    with pytest.raises(SystemExit):             # a preempted rank is not a failure
        with safety.report_rank_failure():
            raise SystemExit(143)
    assert "failed" not in capfd.readouterr().err
