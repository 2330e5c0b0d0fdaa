"""The processes of a run: the process group (created, torn down), the rank
variables a one-process DeepSpeed run needs, and building the dataset on rank 0
first so the others read its cache instead of tokenising the same data.
"""
from __future__ import annotations

import contextlib
import datetime
import os
from typing import Any, Iterator

from sfttool import compat
from sfttool.registry import build

# Rank 0 may tokenise a large dataset while the others wait: give that wait hours, not NCCL's minutes.
PREPROCESS_TIMEOUT_S = float(os.environ.get("SFTTOOL_PREPROCESS_TIMEOUT", 6 * 3600))


def world_size_from_env() -> int:
    """The processes of this run: torchrun sets ``WORLD_SIZE`` in each; 1 without it."""
    return int(os.environ.get("WORLD_SIZE") or 1)


def init_distributed(cfg: Any, deepspeed: bool) -> str:
    """Create the process group when there is more than one process (or for
    DeepSpeed, which always needs one); return mmengine's launcher name."""
    import torch
    import torch.distributed as dist

    world = world_size_from_env()
    if world == 1 and not deepspeed:
        return "none"
    if not dist.is_initialized():
        backend = compat.cpu_dist_backend(((cfg.get("env_cfg") or {}).get("dist_cfg") or {}).get("backend"))
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        if world == 1:
            # An in-memory store: a group of one needs no rendezvous port, and a
            # port picked free can be taken by another process before it is bound.
            dist.init_process_group(backend=backend if torch.cuda.is_available() else "gloo",
                                    store=dist.HashStore(), rank=0, world_size=1)
        elif torch.cuda.is_available():
            dist.init_process_group(backend=backend)
        else:
            compat.init_cpu_process_group()
    return "pytorch" if world > 1 else "none"


@contextlib.contextmanager
def one_process_rank_env(deepspeed: bool) -> Iterator[None]:
    """DeepSpeed reads RANK/LOCAL_RANK/WORLD_SIZE even in a single process: for
    a DeepSpeed run, set those a launcher did not, and put them all back when
    the run ends. Left in ``os.environ``, they would make a later ``sfttool
    train --nproc-per-node 2`` started from this process think it is already a
    worker, and run alone."""
    defaults = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    before = {key: os.environ.get(key) for key in defaults}
    if deepspeed:
        for key, value in defaults.items():
            os.environ.setdefault(key, value)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def close_process_group(launcher: str) -> None:
    """Leave together and tear down the group of a multi-process run.

    Its processes were started by torchrun for this one run and exit right
    after it; left to interpreter shutdown, gloo's worker threads can be
    destroyed while still joinable, and a rank that finished cleanly dies with
    SIGABRT ("terminate called without an active exception"), failing the run.
    A one-process group (DeepSpeed) is kept: the process may train again
    (tests, notebooks) and DeepSpeed caches groups made from it."""
    import torch.distributed as dist

    if launcher == "pytorch" and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def build_dataset_rank0_first(dataset_cfg: Any) -> Any:
    """Rank 0 builds (and caches) the dataset while the others wait on a
    barrier with a long timeout; then they build it too, from the cache when
    the pipeline has one (the build is deterministic either way)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return build(dataset_cfg, "train_dataloader.dataset")
    patient = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=PREPROCESS_TIMEOUT_S))
    if dist.get_rank() == 0:
        dataset = build(dataset_cfg, "train_dataloader.dataset")
        dist.barrier(group=patient)
    else:
        dist.barrier(group=patient)
        dataset = build(dataset_cfg, "train_dataloader.dataset")
    return dataset
