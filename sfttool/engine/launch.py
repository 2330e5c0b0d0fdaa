"""Start ``torchrun`` for multi-process training: the one place sfttool spawns
processes. XTuner's environment variables keep their meaning:

    NPROC_PER_NODE=2 sfttool train cfg.py            # == sfttool train cfg.py --nproc-per-node 2
    NNODES=2 NODE_RANK=0 ADDR=10.0.0.1 PORT=29500 NPROC_PER_NODE=8 sfttool train cfg.py

Each worker runs ``sfttool train`` again with ``LOCAL_RANK`` set, which makes
it train in-process. The exit code is torchrun's: non-zero when any rank failed.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Callable

from sfttool.engine.cpu_threads import threads_per_process, usable_cpus

# Set in the processes the launcher starts: it checked the run for them (``engine.checks``), so they do
# not report the same findings once each.
CHECKED_BY_LAUNCHER = "SFTTOOL_CHECKED_BY_LAUNCHER"


@dataclass
class LaunchPlan:
    nproc_per_node: int
    nnodes: int = 1
    node_rank: int = 0
    addr: str = "127.0.0.1"
    port: int | None = None

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


def _env_int(name: str, default: int, errors: list) -> int | None:
    """``$name`` as an integer (``default`` when unset or empty); None, with an error, when it is not one."""
    value = os.environ.get(name)
    if value in (None, ""):
        return default
    try:
        return int(value)
    except ValueError:
        errors.append(f"environment variable {name}={value!r}: expected an integer")
        return None


def _check(name: str, value: int | None, ok: Callable[[int], bool], wanted: str, errors: list) -> int | None:
    """``value`` when it is None (already reported) or ``ok(value)``; else None, with an error."""
    if value is not None and not ok(value):
        errors.append(f"environment variable {name}={os.environ[name]!r}: expected {wanted}")
        return None
    return value


def plan_from_env(nproc_per_node: int | None = None) -> LaunchPlan:
    """The launch the flags and environment ask for (``--nproc-per-node`` wins over the env).
    Every bad value is reported at once, in one ValueError that names the variable."""
    errors: list[str] = []
    if nproc_per_node is not None:
        nproc = nproc_per_node
        if nproc < 1:
            errors.append(f"--nproc-per-node must be at least 1, got {nproc}")
    else:
        nproc = _env_int("NPROC_PER_NODE", 1, errors)
        nproc = _check("NPROC_PER_NODE", nproc, lambda n: n >= 1, "at least 1 (processes on this machine)", errors)
    nnodes = _env_int("NNODES", 1, errors)
    nnodes = _check("NNODES", nnodes, lambda n: n >= 1, "at least 1 (machines in the job)", errors)
    node_rank = _env_int("NODE_RANK", 0, errors)
    if nnodes is not None:  # a rank outside 0 .. NNODES-1 waits forever for the others
        node_rank = _check("NODE_RANK", node_rank, lambda r: 0 <= r < nnodes,
                           f"this machine's index among NNODES={nnodes}, from 0 to {nnodes - 1}", errors)
    port = _env_int("PORT", None, errors)
    port = _check("PORT", port, lambda p: 1 <= p <= 65535, "a TCP port from 1 to 65535", errors)
    addr = os.environ.get("ADDR") or None
    # A worker's launcher (torchrun, maybe the user's own) already has the address.
    if nnodes is not None and nnodes > 1 and addr is None and not inside_launcher():
        errors.append(f"environment variable ADDR is unset but NNODES={nnodes}: set ADDR to the address of "
                      f"the NODE_RANK=0 machine, the same on every machine")
    if errors:
        raise ValueError("; ".join(errors))
    return LaunchPlan(nproc_per_node=nproc, nnodes=nnodes, node_rank=node_rank, addr=addr or "127.0.0.1", port=port)


def inside_launcher() -> bool:
    """True in a worker that torchrun (or another launcher) started."""
    return "LOCAL_RANK" in os.environ


def needs_launch(plan: LaunchPlan) -> bool:
    return plan.world_size > 1 and not inside_launcher()


def free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(plan: LaunchPlan, train_args: list[str]) -> list[str]:
    port = plan.port if plan.port is not None else (free_port() if plan.nnodes == 1 else 29500)
    return [sys.executable, "-m", "torch.distributed.run",
            f"--nproc-per-node={plan.nproc_per_node}", f"--nnodes={plan.nnodes}",
            f"--node-rank={plan.node_rank}", f"--master-addr={plan.addr}", f"--master-port={port}",
            "-m", "sfttool.cli.main", "train", *train_args]


def worker_env(processes: int = 1, deepspeed: bool = False) -> dict:
    """The workers' environment. They share the CPUs this process may use: unless the user set
    ``OMP_NUM_THREADS``, each gets its share of them as ``OMP_NUM_THREADS`` (one under DeepSpeed
    without a GPU; see ``sfttool.engine.cpu_threads``), where torchrun would give each one thread.
    Without CUDA, DeepSpeed uses its CPU accelerator. The launcher checked the run before starting
    them (``CHECKED_BY_LAUNCHER``)."""
    import torch

    env = dict(os.environ, **{CHECKED_BY_LAUNCHER: "1"})
    cuda = torch.cuda.is_available()
    if not cuda:
        env.setdefault("DS_ACCELERATOR", "cpu")
    if not env.get("OMP_NUM_THREADS"):
        threads = 1 if deepspeed and not cuda else threads_per_process(usable_cpus(), processes)
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def launch(plan: LaunchPlan, train_args: list[str]) -> int:
    """Run torchrun; return its exit code (128 + signal when this process got SIGTERM/SIGINT)."""
    # Here, not at the top: `sfttool train` reads the launch plan before it imports mmengine (seconds).
    from sfttool.engine.hooks.preemption_hook import run_forwarding_sigterm

    # SIGTERM here reaches the workers (via torchrun), which checkpoint and stop.
    return run_forwarding_sigterm(torchrun_command(plan, train_args),
                                  worker_env(plan.nproc_per_node, deepspeed="--deepspeed" in train_args))
