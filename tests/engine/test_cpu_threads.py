"""torch's CPU thread count comes from the CPUs this process may use (affinity, cgroup quota), shared
among the job's processes on the machine; a count the user chose wins. Checked on quota files written
here and on a restricted affinity, not by timing."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from sfttool.engine import cpu_threads
from sfttool.engine.cpu_threads import cgroup_cpu_limit, choose_cpu_threads, threads_per_process, usable_cpus


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def torch_default(monkeypatch):
    """A process nobody chose threads for: no OMP_NUM_THREADS, torch at its start-up count (the machine's
    CPUs), nothing chosen by sfttool yet. torch's count is put back afterwards."""
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(cpu_threads, "_chosen", None)
    torch.set_num_threads(os.cpu_count())
    yield
    torch.set_num_threads(before)


def test_cgroup_quota_files(tmp_path):
    write(tmp_path / "v2" / "cpu.max", "150000 100000\n")
    write(tmp_path / "v2_none" / "cpu.max", "max 100000\n")
    write(tmp_path / "v1" / "cpu" / "cpu.cfs_quota_us", "50000\n")
    write(tmp_path / "v1" / "cpu" / "cpu.cfs_period_us", "100000\n")
    write(tmp_path / "v1_none" / "cpu,cpuacct" / "cpu.cfs_quota_us", "-1\n")
    write(tmp_path / "v1_none" / "cpu,cpuacct" / "cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_limit(tmp_path / "v2") == 1.5
    assert cgroup_cpu_limit(tmp_path / "v1") == 0.5
    assert cgroup_cpu_limit(tmp_path / "v2_none") is None
    assert cgroup_cpu_limit(tmp_path / "v1_none") is None
    assert cgroup_cpu_limit(tmp_path / "nothing") is None
    cpus = len(os.sched_getaffinity(0))
    assert usable_cpus(tmp_path / "v2") == min(cpus, 2)  # 1.5 CPUs: two threads can use them
    assert usable_cpus(tmp_path / "v1") == 1
    assert usable_cpus(tmp_path / "v2_none") == cpus


def test_the_quota_sets_torchs_threads(tmp_path, torch_default):
    write(tmp_path / "cpu.max", "100000 100000\n")  # one CPU, say a container's --cpus=1
    assert choose_cpu_threads(cgroup_root=tmp_path) == torch.get_num_threads() == 1


def test_processes_on_the_machine_share_the_usable_cpus(tmp_path, torch_default, monkeypatch):
    write(tmp_path / "cpu.max", "800000 100000\n")
    monkeypatch.setattr(cpu_threads, "affinity_cpus", lambda: 16)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert usable_cpus(tmp_path) == 8 and choose_cpu_threads(cgroup_root=tmp_path) == 2
    assert threads_per_process(3, 4) == 1  # never none


def test_a_count_the_user_chose_wins(tmp_path, torch_default, monkeypatch):
    write(tmp_path / "cpu.max", "100000 100000\n")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert choose_cpu_threads(cgroup_root=tmp_path) == torch.get_num_threads() == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    torch.set_num_threads(os.cpu_count() + 2)  # torch.set_num_threads before the run: no count torch picks
    assert choose_cpu_threads(cgroup_root=tmp_path) == torch.get_num_threads() == os.cpu_count() + 2


def test_a_second_run_in_the_process_chooses_again(tmp_path, torch_default):
    """The count sfttool set for an earlier run is its own, not the user's."""
    write(tmp_path / "one" / "cpu.max", "100000 100000\n")
    write(tmp_path / "two" / "cpu.max", "200000 100000\n")
    assert choose_cpu_threads(cgroup_root=tmp_path / "one") == 1
    assert choose_cpu_threads(cgroup_root=tmp_path / "two") == min(2, len(os.sched_getaffinity(0)))


def test_deepspeed_without_a_gpu_gets_one_thread(tmp_path, torch_default):
    if torch.cuda.is_available():
        pytest.skip("the one-thread rule is for machines without a GPU")
    assert choose_cpu_threads(deepspeed=True, cgroup_root=tmp_path) == torch.get_num_threads() == 1


def test_a_restricted_affinity_limits_the_threads():
    """A process started on every CPU, then allowed one (taskset, a scheduler's cpuset): torch had one
    thread per CPU; the run uses one."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs a machine with two CPUs to restrict the affinity to one")
    code = ("import os, torch; before = torch.get_num_threads(); os.sched_setaffinity(0, {%d}); "
            "from sfttool.engine.cpu_threads import choose_cpu_threads; "
            "print(before, choose_cpu_threads(cgroup_root='/nonexistent'), torch.get_num_threads())" % cpus[0])
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "LOCAL_WORLD_SIZE")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    before, chosen, after = map(int, out.stdout.split())
    assert before > 1 and chosen == after == 1


def test_the_launcher_gives_each_worker_its_share(monkeypatch):
    from sfttool.engine import launch

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(launch, "usable_cpus", lambda: 8)
    assert launch.worker_env(processes=2)["OMP_NUM_THREADS"] == "4"  # torchrun would give each one thread
    if not torch.cuda.is_available():
        assert launch.worker_env(processes=2, deepspeed=True)["OMP_NUM_THREADS"] == "1"
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert launch.worker_env(processes=2)["OMP_NUM_THREADS"] == "3"
