"""torch's CPU thread count, chosen from the CPUs this process may use.

torch starts with one thread per CPU of the machine it sees, but a process may be allowed fewer:
a CPU affinity (``taskset``, a batch scheduler's cpuset) or a cgroup CPU quota (a container's
``--cpus``). More threads than usable CPUs, or several processes of one job each with every CPU,
make OpenMP threads wait on each other: steps ran 40x slower on a shared machine until
``OMP_NUM_THREADS=1``. So a run uses

    threads = max(1, usable CPUs // processes of this job on this machine)

where usable CPUs is the smaller of the affinity's size and the quota (rounded up), and the
processes are ``LOCAL_WORLD_SIZE`` (torchrun's; ``sfttool train --nproc-per-node`` hands each
worker its share as ``OMP_NUM_THREADS``, see ``sfttool.engine.launch``). DeepSpeed on a machine
without a GPU gets one thread (``compat.limit_cpu_threads``). A count the user chose wins:
``OMP_NUM_THREADS`` in the environment, or ``torch.set_num_threads`` called before the run (a count
torch would not pick by itself). The summary line says the count.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

from sfttool import compat

CGROUP_ROOT = Path("/sys/fs/cgroup")

_chosen: int | None = None  # the count sfttool set last in this process


def cgroup_cpu_limit(root: str | os.PathLike = CGROUP_ROOT) -> float | None:
    """CPUs the cgroup's quota allows (a fraction is possible), or None without a quota. cgroup v2:
    ``cpu.max`` (``"200000 100000"``: 2 CPUs; ``"max 100000"``: none); v1: ``cpu/cpu.cfs_quota_us``
    over ``cpu/cpu.cfs_period_us`` (-1: none)."""
    root = Path(root)
    v2 = root / "cpu.max"
    if v2.is_file():
        quota, _, period = v2.read_text().strip().partition(" ")
        return None if quota == "max" else _ratio(quota, period)
    for folder in ("cpu", "cpu,cpuacct"):
        quota, period = root / folder / "cpu.cfs_quota_us", root / folder / "cpu.cfs_period_us"
        if quota.is_file() and period.is_file():
            return _ratio(quota.read_text(), period.read_text())
    return None


def _ratio(quota: str, period: str) -> float | None:
    try:
        quota_us, period_us = int(quota), int(period or 100000)
    except ValueError:
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def affinity_cpus() -> int:
    """The CPUs this process may run on (its affinity; the machine's where there is none)."""
    if hasattr(os, "sched_getaffinity"):
        return max(len(os.sched_getaffinity(0)), 1)
    return os.cpu_count() or 1


def usable_cpus(cgroup_root: str | os.PathLike = CGROUP_ROOT) -> int:
    """The CPUs this process may use: its affinity's size, capped by the cgroup quota (rounded up)."""
    cpus = affinity_cpus()
    limit = cgroup_cpu_limit(cgroup_root)
    return min(cpus, max(math.ceil(limit), 1)) if limit is not None else cpus


def threads_per_process(usable: int, processes: int) -> int:
    """The usable CPUs shared among this machine's processes of the job, at least one each.

    >>> threads_per_process(16, 4), threads_per_process(2, 4)
    (4, 1)
    """
    return max(1, usable // max(processes, 1))


def explicit_threads() -> int | None:
    """``OMP_NUM_THREADS`` as a count, or None when it is unset (or not a positive integer)."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def torch_threads_set_by_user() -> bool:
    """torch runs a count it would not pick by itself (the machine's CPUs or this process's) and that
    sfttool did not set: someone called ``torch.set_num_threads``."""
    import torch

    current = torch.get_num_threads()
    defaults = {os.cpu_count(), affinity_cpus()}
    return current != _chosen and current not in defaults


def choose_cpu_threads(deepspeed: bool = False, cgroup_root: str | os.PathLike = CGROUP_ROOT) -> int:
    """Set torch's thread count for this run (module docstring) and return it."""
    import torch

    global _chosen
    explicit = explicit_threads()
    if explicit is None and torch_threads_set_by_user():
        return torch.get_num_threads()
    if explicit is None and deepspeed:
        compat.limit_cpu_threads()  # one thread on a machine without a GPU
        explicit = explicit_threads()
    processes = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
    threads = explicit or threads_per_process(usable_cpus(cgroup_root=cgroup_root), processes)
    if torch.get_num_threads() != threads:  # torch read OMP_NUM_THREADS when it started; it may have changed since
        torch.set_num_threads(threads)
    _chosen = threads
    return threads
