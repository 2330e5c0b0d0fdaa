"""Checkpoints that survive a kill, and the state a bit-exact resume needs.

- ``AtomicCheckpointHook``: mmengine's ``CheckpointHook`` with a safe order:
  write ``iter_N.pth.tmp`` -> rename to ``iter_N.pth`` -> update
  ``last_checkpoint`` (also by rename) -> only then delete checkpoints beyond
  ``max_keep_ckpts``. mmengine deletes the oldest *before* writing, so a kill
  during the save could leave no loadable checkpoint.
- ``RNGStateHook`` / ``restore_rng_state``: mmengine only re-seeds on resume;
  we record the exact Python/numpy/torch RNG states in the message hub (which
  every checkpoint holds, DeepSpeed's too) and restore them, so dropout draws
  continue unchanged.
- ``find_latest_checkpoint``: the newest *complete* checkpoint in a work dir.
"""
from __future__ import annotations

import logging
import os
import random
import re
import shutil
from pathlib import Path

from mmengine.dist import all_gather_object, barrier, is_main_process
from mmengine.hooks import CheckpointHook, Hook

from sfttool.utils.atomic import before_rename, reported_save
from sfttool.registry import BUILDER

_CKPT_RE = re.compile(r"^iter_(\d+)\.pth$")


def find_latest_checkpoint(work_dir: str | os.PathLike) -> Path | None:
    """``work_dir/iter_N.pth`` with the largest N (file or DeepSpeed folder);
    unfinished ``.tmp`` saves are ignored."""
    best = None
    for path in Path(work_dir).glob("iter_*.pth"):
        match = _CKPT_RE.match(path.name)
        if match and (best is None or int(match.group(1)) > best[0]):
            best = (int(match.group(1)), path)
    return best[1] if best else None


def _replace(src: str, dst: str) -> None:
    if os.path.isdir(dst):
        shutil.rmtree(dst)
    os.replace(src, dst)


def _remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.remove(path)


@BUILDER.register_module()
class AtomicCheckpointHook(CheckpointHook):
    """Drop-in for mmengine's ``CheckpointHook`` (same arguments), by iteration."""

    def _save_checkpoint_with_step(self, runner, step, meta):
        name = self.filename_tmpl.format(step)
        final = os.path.join(self.out_dir, name)
        if is_main_process():
            _remove(final + ".tmp")
        barrier()
        kept, dropped = self._keep_ids(step)
        # The message hub goes into the checkpoint: record the new list first.
        runner.message_hub.update_info("keep_ckpt_ids", kept)
        # A failed write (disk full, permissions) removes the partial save and raises
        # CheckpointSaveError naming the path and OS error; older checkpoints stay.
        with reported_save(final, final + ".tmp"):
            runner.save_checkpoint(self.out_dir, name + ".tmp", self.file_client_args,
                                   save_optimizer=self.save_optimizer,
                                   save_param_scheduler=self.save_param_scheduler,
                                   meta=meta, by_epoch=self.by_epoch, backend_args=self.backend_args, **self.args)
            barrier()  # every rank's shard is written before the rename (DeepSpeed)
            self.last_ckpt = final
            runner.message_hub.update_info("last_ckpt", final)
            if is_main_process():
                before_rename(final + ".tmp", final)  # fsync; the kill -9 test pauses here
                _replace(final + ".tmp", final)
                pointer = os.path.join(runner.work_dir, "last_checkpoint")
                with open(pointer + ".tmp", "w") as f:
                    f.write(final)
                os.replace(pointer + ".tmp", pointer)
        if is_main_process():
            for old in dropped:  # only now that the new checkpoint is complete
                _remove(os.path.join(self.out_dir, self.filename_tmpl.format(old)))
        barrier()

    def _keep_ids(self, step: int) -> tuple[list, list]:
        """(ids to keep, ids to delete) once checkpoint ``step`` exists."""
        if self.max_keep_ckpts <= 0:
            return [], []
        ids = list(self.keep_ckpt_ids)
        if not ids or ids[-1] != step:
            ids.append(step)
        kept, dropped = ids[-self.max_keep_ckpts:], ids[:-self.max_keep_ckpts]
        self.keep_ckpt_ids.clear()
        self.keep_ckpt_ids.extend(kept)
        return kept, dropped


def _rng_state() -> dict:
    import numpy as np
    import torch

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             # numpy's key array as a tensor: weights_only loading accepts it as is
             "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss)}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    import numpy as np
    import torch

    random.setstate(_as_tuple(state["python"]))
    torch.set_rng_state(state["torch"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuple(obj):
    return tuple(_as_tuple(x) for x in obj) if isinstance(obj, (list, tuple)) else obj


@BUILDER.register_module()
class RNGStateHook(Hook):
    """Puts every rank's RNG states into the message hub after every iteration,
    before the checkpoint hook runs, so every checkpoint carries them (the
    message hub is saved by both runners; DeepSpeed's strategy ignores the
    checkpoint hooks). Only rank 0 writes the message hub, so with several
    processes the states are gathered to it: each rank's dropout stream is its
    own. ``TrainLoop`` calls ``restore_rng_state`` when it resumes, after the
    ``before_train`` hooks (which may generate text)."""

    priority = 85  # after the other hooks of an iteration, before CheckpointHook (VERY_LOW = 90)

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None) -> None:
        # One entry per rank, indexed by rank; mmengine returns [state] in a single process.
        runner.message_hub.update_info("rng_state", all_gather_object(_rng_state()))


def restore_rng_state(runner) -> bool:
    """Set the RNG states a resumed checkpoint recorded for this rank; False when it has none."""
    from mmengine.dist import get_rank, get_world_size
    from mmengine.logging import print_log

    states = runner.message_hub.get_info("rng_state")
    if states is None:
        return False
    if isinstance(states, dict):  # one state, as checkpoints of sfttool 0.1.0 hold
        states = [states]
    rank, world = get_rank(), get_world_size()
    if len(states) != world:
        print_log(f"the checkpoint holds the RNG states of {len(states)} process(es) and this run has {world}: "
                  "dropout draws after the resume will differ from an uninterrupted run", logger="current",
                  level=logging.WARNING)
    _set_rng_state(states[rank % len(states)])
    return True
