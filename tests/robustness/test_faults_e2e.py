"""Each fault of a real run, injected into `sfttool train` on CPU with a tiny LoRA model.

Runs a fault is injected into from outside (signals, kill -9, process-wide limits,
several ranks) are subprocesses; the others run in this process. Every run trains 8 iterations (accumulation 2, so 4
optimizer steps) and checkpoints every 4 iterations unless a test says
otherwise; `reference` is the uninterrupted run resumed runs must equal.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
import torch

from robustness_runs import (assert_same_weights, final_weights, run_train, train_cmd, train_env, train_in_process,
                             write_config)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # several processes each


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_qwen2_dir, tiny_sft_jsonl) -> dict:
    tmp = tmp_path_factory.mktemp("reference")
    config = write_config(tmp / "cfg.py", tiny_qwen2_dir, tiny_sft_jsonl)
    result = train_in_process(config, tmp / "work")
    assert result.returncode == 0, result.stderr[-3000:]
    return final_weights(tmp / "work", 8)


def _checkpoints(work) -> list[str]:
    return sorted(p.name for p in work.glob("iter_*"))


def test_sigterm_saves_at_the_step_boundary_then_resume_equals_uninterrupted(robust_config, tmp_path, reference):
    config = robust_config(custom_hooks="[dict(type='robustness_helpers.SignalAt', at=5)]")
    work = tmp_path / "work"
    cut = run_train(config, work)
    assert cut.returncode == 143, cut.stderr[-3000:]
    assert f"[sfttool] executing config {config}" in cut.stdout       # configs are code: say which ran
    log = cut.stdout + cut.stderr
    assert "received SIGTERM: saving a checkpoint at the end of the current optimizer step" in cut.stderr
    assert "stopped by SIGTERM after iteration 6 of 8" in log                # iteration 5 was mid-window
    assert f"sfttool train {config} --work-dir {work} --resume" in log
    assert _checkpoints(work) == ["iter_4.pth", "iter_6.pth"]

    resumed = train_in_process(config, work, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Resuming at iteration 6" in resumed.stdout + resumed.stderr
    assert_same_weights(final_weights(work, 8), reference)


def test_kill_9_during_a_checkpoint_save_resumes_from_the_newest_complete_one(robust_config, tmp_path, reference):
    config = robust_config()
    work, marker = tmp_path / "work", tmp_path / "paused"
    proc = subprocess.Popen(train_cmd(config, work, pause_before_rename=True), env=train_env(
        SFTTOOL_FAULT_PAUSE_BEFORE_RENAME=marker, SFTTOOL_FAULT_PAUSE_MATCH="iter_8"),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    _kill_when(marker, proc, "the save of iteration 8")   # between the temporary write and the rename
    assert proc.returncode == -signal.SIGKILL
    assert _checkpoints(work) == ["iter_4.pth", "iter_8.pth.tmp"]      # the half-done save keeps its temp name
    assert final_weights(work, 4)                                        # the previous one loads

    resumed = train_in_process(config, work, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Resuming at iteration 4" in resumed.stdout + resumed.stderr
    assert _checkpoints(work) == ["iter_4.pth", "iter_8.pth"]
    assert_same_weights(final_weights(work, 8), reference)


def test_unwritable_work_dir_fails_before_training(robust_config, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    result = run_train(robust_config(), blocker / "run", "--trust-remote-code", timeout=120)
    assert result.returncode == 1
    assert (f"Error: work dir {blocker}/run is not writable: [Errno 20] Not a directory; choose another "
            f"folder with --work-dir") in result.stderr
    assert "Traceback" not in result.stderr and "Iter(train)" not in result.stdout + result.stderr
    assert "trust_remote_code is on for tokenizer, model.llm" in result.stderr      # the flag, and its warning


def test_failed_save_reports_path_and_os_error_and_keeps_the_previous_checkpoint(robust_config, tmp_path):
    # After iteration 4's checkpoint (~150 KB), no file may grow past 64 KB: iteration 8's save
    # fails in the kernel with EFBIG, as a full disk fails with ENOSPC.
    config = robust_config(custom_hooks="[dict(type='robustness_helpers.FileSizeLimitAfter', after=4, "
                                        "limit_bytes=65536)]")
    work = tmp_path / "work"
    result = run_train(config, work)
    assert result.returncode == 1, result.stderr[-3000:]
    assert (f"Error: could not save checkpoint {work}/iter_8.pth: [Errno 27] File too large. Nothing was "
            f"replaced: earlier checkpoints in {work} are intact") in result.stderr
    assert "Traceback" not in result.stderr
    assert _checkpoints(work) == ["iter_4.pth"]         # no partial file left behind
    assert all(torch.isfinite(v).all() for v in final_weights(work, 4).values())   # and it still loads


def test_a_few_nan_steps_are_skipped_and_counted(robust_config, tmp_path):
    config = robust_config(custom_hooks="[dict(type='robustness_helpers.NaNLossAt', iters=[3])]")
    work = tmp_path / "work"
    result = train_in_process(config, work)
    assert result.returncode == 0, result.stderr[-3000:]
    log = result.stdout + result.stderr
    assert ("non-finite loss at iteration 4: skipped the optimizer step (1 in a row, 1 in total, "
            "limit 5 in a row)") in log
    assert log.count("non-finite loss at iteration") == 1
    weights = final_weights(work, 8)
    assert all(torch.isfinite(v).all() for v in weights.values())


def test_nan_steps_in_a_row_stop_the_run_with_a_clear_message(robust_config, tmp_path):
    config = robust_config(max_iters=12, optim_extra=", max_consecutive_nonfinite=2",
                           custom_hooks="[dict(type='robustness_helpers.NaNLossAt', from_iter=5)]")
    work = tmp_path / "work"
    result = train_in_process(config, work)
    assert result.returncode == 1
    assert ("Error: training stopped at iteration 8: 2 optimizer steps in a row had a non-finite (NaN/inf) "
            "loss.") in result.stderr
    assert "optim_wrapper.max_consecutive_nonfinite (now 2; None turns the check off)" in result.stderr
    assert _checkpoints(work) == ["iter_4.pth"]
    assert all(torch.isfinite(v).all() for v in final_weights(work, 4).values())


def test_under_deepspeed_nonfinite_steps_are_skipped_by_deepspeed_counted_and_stop_the_run(robust_config, tmp_path):
    config = robust_config(max_iters=12, optim_extra=", max_consecutive_nonfinite=2",
                           custom_hooks="[dict(type='robustness_helpers.NaNLossAt', iters=[3], from_iter=9)]")
    result = train_in_process(config, tmp_path / "work", "--deepspeed", "zero2")
    log = result.stdout + result.stderr
    assert result.returncode == 1, log[-3000:]
    assert "non-finite loss at iteration 4: DeepSpeed skipped the step (1 in a row, 1 in total" in log
    assert "non-finite loss at iteration 10: DeepSpeed skipped the step (1 in a row, 2 in total" in log
    assert ("Error: training stopped at iteration 12: 2 optimizer steps in a row had a non-finite (NaN/inf) "
            "loss.") in result.stderr


def test_a_failing_rank_stops_the_others_quickly_and_is_named(robust_config, tmp_path):
    marker = tmp_path / "failed_at"
    config = robust_config(max_iters=400, save_every=1000, custom_hooks=(
        f"[dict(type='robustness_helpers.FailOnRank', rank=1, at=3, marker={str(marker)!r})]"))
    # A rank left waiting would sit in its next collective until the process group's 30-minute timeout:
    # the run's own timeout (400 s) fails the test long before that, without timing the stop itself.
    result = run_train(config, tmp_path / "work", "--nproc-per-node", "2", timeout=400)
    log = result.stdout + result.stderr
    assert result.returncode == 1, log[-6000:]  # the launcher's exit code says the run failed
    assert marker.exists(), log[-3000:]
    assert "[sfttool] rank 1 of 2 failed: RuntimeError: injected failure on rank 1 at iteration 3" in log
    assert "Error: training failed: torchrun exited with code 1" in result.stderr
    assert "Iter(train) [400/400]" not in log


def test_sigterm_to_a_multi_process_run_stops_every_rank_at_the_same_step(robust_config, tmp_path):
    marker = tmp_path / "training"
    config = robust_config(max_iters=12, save_every=100, custom_hooks=(
        f"[dict(type='robustness_helpers.PauseAt', at=5, marker={str(marker)!r})]"))
    work = tmp_path / "work"
    proc = subprocess.Popen(train_cmd(config, work, "--nproc-per-node", "2"), env=train_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 240
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert marker.exists(), proc.communicate()[0][-3000:]
    proc.send_signal(signal.SIGTERM)            # to `sfttool train`, the launcher, as a scheduler would
    log = proc.communicate(timeout=240)[0]
    assert proc.returncode == 143, log[-3000:]
    assert log.count("received SIGTERM") == 2                        # both ranks
    assert log.count("stopped by SIGTERM after iteration 6 of 12") == 1   # said once, by rank 0
    assert "resume with the same command plus --resume" in log
    assert _checkpoints(work) == ["iter_6.pth"]

    resumed = run_train(config, work, "--nproc-per-node", "2", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Resuming at iteration 6" in resumed.stdout + resumed.stderr
    assert _checkpoints(work) == ["iter_12.pth", "iter_6.pth"]


def _kill_when(marker, proc, what: str) -> None:
    deadline = time.monotonic() + 240
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert marker.exists(), f"the run never reached {what}: {proc.communicate()[1][-3000:]}"
    os.killpg(proc.pid, signal.SIGKILL)   # the whole job, worker processes included, as a scheduler does
    proc.communicate(timeout=60)


def test_killed_preprocessing_leaves_no_usable_cache_and_the_next_run_rebuilds(robust_config, tmp_path):
    cache = tmp_path / "cache"
    config = robust_config(extra_imports="from robustness_helpers import pause_map_fn",
                           dataset_extra=f"cache_dir={str(cache)!r}, dataset_map_fn=pause_map_fn")
    work = tmp_path / "work"

    # 1. killed while mapping rows: nothing is cached at all
    in_map = tmp_path / "in_map"
    proc = subprocess.Popen(train_cmd(config, work), env=train_env(ROBUSTNESS_PAUSE_IN_MAP=in_map),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    _kill_when(in_map, proc, "the map stage")
    assert not cache.exists() or [p for p in cache.iterdir() if not p.name.startswith(".")] == []

    # 2. killed after the processed dataset is written but before it is renamed into place
    saved = tmp_path / "saved"
    proc = subprocess.Popen(train_cmd(config, work, pause_before_rename=True),
                            env=train_env(SFTTOOL_FAULT_PAUSE_BEFORE_RENAME=saved),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    _kill_when(saved, proc, "the cache rename")
    entries = sorted(p.name for p in cache.iterdir())
    assert len(entries) == 1 and entries[0].startswith(".") and ".tmp-" in entries[0]   # only the temp folder

    # 3. the next run rebuilds, trains, and leaves a complete entry; the one after reuses it
    rebuilt = train_in_process(config, work)
    assert rebuilt.returncode == 0, rebuilt.stderr[-3000:]
    log = "".join(p.read_text() for p in work.rglob("*.log"))  # the data's INFO lines are in the run's log file
    assert "Dataset: cached at" in log and "reusing the processed dataset" not in log
    complete = [p for p in cache.iterdir() if not p.name.startswith(".")]
    assert len(complete) == 1 and (complete[0] / "sfttool_report.json").exists()
    assert [p for p in cache.iterdir() if p.name.startswith(".")] == []  # the killed run's temp folder is gone

    reused = train_in_process(config, tmp_path / "work2")
    assert reused.returncode == 0, reused.stderr[-3000:]
    assert f"reusing the processed dataset cached at {complete[0]}" in next((tmp_path / "work2").rglob("*.log")).read_text()
