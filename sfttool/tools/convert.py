"""Turn a training checkpoint into Hugging Face folders.

    >>> pth_to_hf('my_cfg.py', 'work_dirs/my_cfg/iter_500.pth', 'hf_adapter')  # doctest: +SKIP
    PosixPath('hf_adapter')   # adapter_config.json + adapter_model.safetensors (LoRA/QLoRA),
                              # or config.json + model.safetensors (full); tokenizer; sfttool_config.py

A checkpoint is either an mmengine ``.pth`` file (weights under
``state_dict``, keys as ``SupervisedFinetune.state_dict()`` returns them: only
the adapter for LoRA runs) or a DeepSpeed checkpoint folder (ZeRO-1/2/3),
whose partitioned fp32 weights are gathered with DeepSpeed's own
``zero_to_fp32``. The model is rebuilt from the config, the weights loaded
into it, and saved as the end of training saves it
(``sfttool.model.hf_folder.write_hf_folder``).
"""
from __future__ import annotations

import copy
import os
from pathlib import Path

from sfttool.errors import SfttoolError
from sfttool.model.hf_folder import config_tokenizer, write_hf_folder
from sfttool.registry import build
from sfttool.tools.merge import dumped_config
from sfttool.utils.checkpoint_file import BEST_POINTER, CheckpointReadError, find_best_checkpoint, load_checkpoint


class ConvertError(SfttoolError):
    """A checkpoint cannot be converted; the message names the file and the fix."""


# ---------------------------------------------------------------------------
# Reading checkpoints.

def load_pth_state_dict(path: Path) -> dict:
    """Weights of an mmengine ``.pth``, read as ``--resume`` reads them
    (``sfttool.utils.checkpoint_file.load_checkpoint``: nothing outside the allow-list is unpickled)."""
    try:
        ckpt = load_checkpoint(path)
    except CheckpointReadError as exc:
        raise ConvertError(str(exc)) from None
    state = ckpt.get("state_dict", ckpt) if isinstance(ckpt, dict) else None
    if not isinstance(state, dict) or not state:
        raise ConvertError(f"{path}: no weights found (expected a dict with a 'state_dict' entry)")
    return state


def _deepspeed_tag(folder: Path) -> str | None:
    """DeepSpeed writes ``latest`` naming the tag sub-folder; accept the tag folder itself too."""
    if (folder / "latest").is_file():
        return None
    if any(folder.glob("*model_states.pt")):
        return ""  # the folder is the tag folder
    tags = sorted(p.name for p in folder.iterdir() if p.is_dir() and any(p.glob("*model_states.pt")))
    if len(tags) == 1:
        return tags[0]
    raise ConvertError(f"{folder}: not a DeepSpeed checkpoint folder (no `latest` file and "
                       f"{'several' if tags else 'no'} sub-folders with *model_states.pt: {tags})")


def load_deepspeed_state_dict(folder: Path) -> dict:
    """Full fp32 weights gathered from a DeepSpeed ZeRO checkpoint folder."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    tag = _deepspeed_tag(folder)
    if tag == "":
        folder, tag = folder.parent, folder.name
    return dict(get_fp32_state_dict_from_zero_checkpoint(str(folder), tag=tag))


def load_checkpoint_state_dict(ckpt: str | os.PathLike) -> dict:
    """State dict of a ``.pth`` file or a DeepSpeed folder, ``module.`` prefixes removed."""
    path = Path(ckpt)
    if path.is_dir():
        state = load_deepspeed_state_dict(path)
    elif path.is_file():
        state = load_pth_state_dict(path)
    else:
        raise FileNotFoundError(f"{path}: no such checkpoint file or folder")
    # A DDP-wrapped model saves its weights as `module.<name>`.
    return {k[len("module."):] if k.startswith("module.") else k: v for k, v in state.items()}


# ---------------------------------------------------------------------------
# Building the model and loading weights into it.

def conversion_model_cfg(model_cfg: dict) -> dict:
    """The training model config, changed only where conversion needs it: no
    4-bit/8-bit loading (adapter weights are the same; the base is not saved
    for LoRA, and a full model must be saved unquantised) and no activation
    checkpointing."""
    cfg = copy.deepcopy(dict(model_cfg))
    llm = cfg.get("llm")
    if isinstance(llm, dict) and llm.get("quantization_config") is not None:
        llm = dict(llm)
        llm.pop("quantization_config")
        cfg["llm"] = llm
    cfg["use_activation_checkpointing"] = False
    return cfg


def load_weights(model, state: dict, ckpt: str | os.PathLike) -> None:
    """Load exactly the weights ``model`` saves; every one must be in ``state``."""
    wanted = model.state_dict()
    missing = [k for k in wanted if k not in state]
    if missing:
        hint = (" (a LoRA config but a full fine-tune checkpoint, or the other way round?)"
                if len(missing) == len(wanted) else "")
        raise ConvertError(f"{ckpt}: the checkpoint lacks {len(missing)} of the model's {len(wanted)} weights, "
                           f"e.g. {missing[:3]}; does it come from this config?{hint}")
    resized = [k for k in wanted if _shape(state[k]) != _shape(wanted[k])]
    if resized:
        key, dumped = resized[0], dumped_config(Path(ckpt).parent)
        where = f" ({dumped})" if dumped != "CONFIG" else ""
        raise ConvertError(
            f"{ckpt}: {len(resized)} of the model's {len(wanted)} weights have another shape in the checkpoint, "
            f"e.g. {key}: {_shape(state[key])} in the checkpoint, {_shape(wanted[key])} in the model this "
            f"config builds; convert with the config the run dumped in its work dir{where}, or with this config "
            "and the --cfg-options used for training")
    model.load_state_dict({k: state[k] for k in wanted}, strict=False)


def _shape(value) -> list | str:
    return list(value.shape) if hasattr(value, "shape") else type(value).__name__


def best_checkpoint(work_dir: str | os.PathLike) -> Path:
    """``--best``: the checkpoint ``work_dir/best_checkpoint`` names (the lowest ``val/loss``)."""
    found = find_best_checkpoint(work_dir)
    if found is None:
        raise ConvertError(f"--best: {work_dir} has no {BEST_POINTER} file naming an existing checkpoint (the run "
                           "validated nothing with save_best='val/loss'); pass a checkpoint path instead of --best")
    return found


def pth_to_hf(cfg, ckpt: str | os.PathLike, save_dir: str | os.PathLike, safe_serialization: bool = True,
              max_shard_size: str | int = "2GB") -> Path:
    """Convert ``ckpt`` trained with config ``cfg`` (a loaded config) into ``save_dir``."""
    save_dir = Path(save_dir)
    state = load_checkpoint_state_dict(ckpt)  # read first: a bad path fails before the model loads
    model = build(conversion_model_cfg(cfg.model), "model")
    load_weights(model, state, ckpt)
    return write_hf_folder(model, config_tokenizer(cfg), cfg, save_dir, ConvertError, safe_serialization, max_shard_size)
