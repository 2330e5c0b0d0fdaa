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


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value in (None, ""):
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r}: expected an integer") from None


def plan_from_env(nproc_per_node: int | None = None) -> LaunchPlan:
    """The launch the flags and environment ask for (``--nproc-per-node`` wins over the env)."""
    nproc = nproc_per_node if nproc_per_node is not None else _env_int("NPROC_PER_NODE", 1)
    if nproc < 1:
        raise ValueError(f"--nproc-per-node must be at least 1, got {nproc}")
    port = os.environ.get("PORT")
    return LaunchPlan(nproc_per_node=nproc, nnodes=_env_int("NNODES", 1), node_rank=_env_int("NODE_RANK", 0),
                      addr=os.environ.get("ADDR", "127.0.0.1"), port=int(port) if port else None)


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


def worker_env() -> dict:
    """Workers share the CPU cores: without CUDA, one OpenMP thread each unless
    the user chose (DeepSpeed and gloo DDP are ~50x slower oversubscribed)."""
    import torch

    env = dict(os.environ)
    if not torch.cuda.is_available():
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("DS_ACCELERATOR", "cpu")
    return env


def launch(plan: LaunchPlan, train_args: list[str]) -> int:
    """Run torchrun; return its exit code (128 + signal when this process got SIGTERM/SIGINT)."""
    from sfttool.engine.hooks.preemption_hook import run_forwarding_sigterm

    # SIGTERM here reaches the workers (via torchrun), which checkpoint and stop.
    return run_forwarding_sigterm(torchrun_command(plan, train_args), worker_env())
