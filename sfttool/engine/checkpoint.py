"""Checkpoints that survive a kill, and the state a bit-exact resume needs.

- ``AtomicCheckpointHook``: mmengine's ``CheckpointHook`` with a safe order:
  write ``iter_N.pth.tmp`` -> rename to ``iter_N.pth`` -> update
  ``last_checkpoint`` (also by rename) -> only then delete checkpoints beyond
  ``max_keep_ckpts``. mmengine deletes the oldest *before* writing, so a kill
  during the save could leave no loadable checkpoint. With ``save_best='val/loss'`` the best
  checkpoint (``best_val_loss_iter_N.pth``, outside the ``max_keep_ckpts`` rotation) is named by
  ``work_dir/best_checkpoint`` (``find_best_checkpoint``).
- ``RNGStateHook`` / ``restore_rng_state``: mmengine only re-seeds on resume;
  we record the exact Python/numpy/torch RNG states in the message hub (which
  every checkpoint holds, DeepSpeed's too) and restore them, so dropout draws
  continue unchanged; each rank's data position goes with them (``saved_data_position``), so a resume
  starts at the exact batch even when a pass gave another number of batches than ``len(dataloader)``.
- ``sfttool.utils.checkpoint_file``: the checkpoint ``--resume`` continues from (the
  one ``last_checkpoint`` names, else the newest *complete* one) and the best one.
- ``check_checkpoint_fits``: a checkpoint of another model or LoRA shape fails
  with a one-line error before training, not inside the optimizer.
- ``ignore_frozen_weights_on_load``: a LoRA checkpoint holds the adapter only,
  so loading it does not report every frozen base weight as missing.
"""
from __future__ import annotations

import logging
import os
import random
import re
from pathlib import Path

from mmengine.dist import all_gather_object, barrier, is_main_process
from mmengine.hooks import CheckpointHook, Hook

from sfttool.config import ConfigError
from sfttool.registry import BUILDER
from sfttool.utils.atomic import atomic_write_text, discard, publish, reported_save
from sfttool.utils.checkpoint_file import BEST_POINTER, CheckpointReadError, load_checkpoint, run_config


@BUILDER.register_module()
class AtomicCheckpointHook(CheckpointHook):
    """Drop-in for mmengine's ``CheckpointHook`` (same arguments), by iteration."""

    def _save_checkpoint_with_step(self, runner, step, meta):
        name = self.filename_tmpl.format(step)
        final = os.path.join(self.out_dir, name)
        if is_main_process():
            discard(final + ".tmp")
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
                publish(final + ".tmp", final)  # fsync, rename; the kill -9 test pauses before the rename
                atomic_write_text(os.path.join(runner.work_dir, "last_checkpoint"), final)
        if is_main_process():
            for old in dropped:  # only now that the new checkpoint is complete
                discard(os.path.join(self.out_dir, self.filename_tmpl.format(old)))
        barrier()

    def after_val_epoch(self, runner, metrics) -> None:
        """mmengine saves the best checkpoint here (``save_best``, kept apart from the ``max_keep_ckpts``
        rotation) and re-saves this iteration's checkpoint when the best improved, so the checkpoint
        holds the new best. A validation changes more than that (the early-stopping count): a checkpoint
        of this very iteration, written before the validation, is re-saved whenever one ran."""
        best_before = runner.message_hub.get_info("best_ckpt")
        super().after_val_epoch(runner, metrics)
        best = runner.message_hub.get_info("best_ckpt")
        if best != best_before and best is not None and is_main_process():
            atomic_write_text(os.path.join(runner.work_dir, BEST_POINTER), best)
        this_iteration = os.path.join(self.out_dir, self.filename_tmpl.format(runner.iter))
        if best == best_before and self.last_ckpt == this_iteration and runner.iter > 0:
            self._save_checkpoint_with_step(runner, runner.iter, dict(epoch=runner.epoch, iter=runner.iter))

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


# The message hub's info key of every rank's data position: ``(iteration, epoch, batches into the epoch)``
# after the iteration's batch (``runner.TrainLoop``).
DATA_POSITION_INFO = "data_position"


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
        # One entry per rank, indexed by rank; mmengine returns [state] in a single process. Each rank's data
        # position (``TrainLoop.data_position``) travels in the same gather: a stream's or a lazily encoded
        # dataset's passes may differ in length between ranks.
        position = getattr(runner.train_loop, "data_position", None)
        gathered = all_gather_object((_rng_state(), position))
        runner.message_hub.update_info("rng_state", [state for state, _ in gathered])
        runner.message_hub.update_info(DATA_POSITION_INFO, [where for _, where in gathered])


def saved_data_position(runner, iteration: int) -> tuple[int, int] | None:
    """``(epoch, batches into it)`` this rank's data stood at when the resumed checkpoint was taken at
    ``iteration``; None when it holds none for that iteration (a checkpoint of an older sfttool, another
    number of processes)."""
    from mmengine.dist import get_rank, get_world_size

    positions = runner.message_hub.get_info(DATA_POSITION_INFO)
    if not positions or len(positions) != get_world_size() or positions[get_rank()] is None:
        return None
    at, epoch, batches = positions[get_rank()]
    return (epoch, batches) if at == iteration else None


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


# ---------------------------------------------------------------------------
# Resuming: does the checkpoint fit the model built from this run's config?

def check_checkpoint_fits(path: str | os.PathLike, model) -> None:
    """Raise ``ConfigError`` unless the weights in checkpoint ``path`` (a file) have
    exactly the keys and shapes of ``model.state_dict()`` (LoRA: the adapter).

    mmengine loads the model non-strictly, so without this a checkpoint of
    another model or LoRA rank is skipped in silence and the optimizer state then
    fails with a size mismatch, or the optimizer's parameter groups do not match."""
    path = Path(path)
    try:
        checkpoint = load_checkpoint(path)
    except CheckpointReadError as exc:
        raise ConfigError(f"--resume {exc}") from None
    state = checkpoint.get("state_dict", checkpoint) if isinstance(checkpoint, dict) else None
    if not isinstance(state, dict):
        raise ConfigError(f"--resume {path} holds no state dict (not a checkpoint of sfttool train); "
                          "pass an iter_<N>.pth of the run to continue")
    # mmengine strips a DDP wrapper's ``module.`` when it loads; compare the same names
    saved = {re.sub(r"^module\.", "", k): list(v.shape) for k, v in state.items() if hasattr(v, "shape")}
    own = {k: list(v.shape) for k, v in model.state_dict().items()}
    missing = [k for k in own if k not in saved]
    unexpected = [k for k in saved if k not in own]
    resized = [k for k in own if k in saved and saved[k] != own[k]]
    problems = []  # each: how many, and the first with its shape
    if missing:
        problems.append(f"tensors missing from the checkpoint: {len(missing)}, first {missing[0]} {own[missing[0]]}")
    if unexpected:
        problems.append(f"tensors the model does not have: {len(unexpected)}, first {unexpected[0]} "
                        f"{saved[unexpected[0]]}")
    if resized:
        k = resized[0]
        problems.append(f"tensors of another shape: {len(resized)}, first {k} {saved[k]} in the checkpoint, "
                        f"{own[k]} in the model")
    if problems:
        config = run_config(path.parent, checkpoint.get("meta")) or f"{path.parent}/<config name>.py"
        raise ConfigError(f"--resume {path} does not fit this model ({'; '.join(problems)}); resume with the "
                          f"config (and --cfg-options) the checkpoint was trained with: {config}")


def ignore_frozen_weights_on_load(model) -> None:
    """Keep frozen weights that ``model.state_dict()`` leaves out by design (LoRA's
    base model) off the missing keys when a checkpoint is loaded into ``model``.

    mmengine's loader compares a checkpoint with every parameter of every
    submodule, not with the model's own ``state_dict``, and prints "The model and
    loaded state dict do not match exactly" listing the whole frozen base model on
    every LoRA resume, which reads like a failure. It reports what the load post
    hooks leave, so this hook removes exactly those keys; unexpected keys and
    missing trainable ones are still reported (and ``check_checkpoint_fits``
    stops the run on them first)."""
    import torch

    def drop_frozen(module, incompatible) -> None:
        every = torch.nn.Module.state_dict(module, keep_vars=True)  # without the model's own filter
        left_out = set(every) - set(module.state_dict(keep_vars=True))
        incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if k not in left_out]

    model.register_load_state_dict_post_hook(drop_frozen)
