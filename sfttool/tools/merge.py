"""Merge a LoRA/QLoRA adapter into its base model and save a plain HF folder.

    >>> merge_adapter('Qwen/Qwen2.5-0.5B-Instruct', 'work_dirs/run/hf_adapter', 'merged')  # doctest: +SKIP
    PosixPath('merged')       # config.json, model.safetensors, tokenizer files

The base is loaded unquantised (also for QLoRA adapters: merging into 4-bit
weights would round the update away), so the merged model is what the adapter
computes on top of full-precision weights. SAVE_DIR is written beside itself
and moved into place when complete (``model.hf_folder.output_folder``, as
``pth_to_hf`` and the end of training write theirs), and a training output given where a model belongs (a
checkpoint, a work dir, the adapter as BASE) is refused in one line that
names the fix (``training_output_problem``, also used by ``chat``).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Iterator

from sfttool import compat
from sfttool.errors import SfttoolError
from sfttool.model.build import resize_embeddings
from sfttool.model.hf_folder import SAVED_CONFIG_NAME, output_folder, save_model
from sfttool.model.reward import adapter_model_class
from sfttool.model.vision import language_model_class
from sfttool.utils.checkpoint_file import find_latest_checkpoint, run_config

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class MergeError(SfttoolError):
    """The adapter or base model cannot be merged; the message says why."""


def device_map_for(device: str) -> dict | str | None:
    """``'cpu'`` -> None (plain load), ``'cuda'`` -> everything on GPU 0, ``'auto'`` -> accelerate's placement."""
    if device == "cpu":
        return None
    if device == "cuda":
        return {"": 0}
    if device == "auto":
        return "auto"
    raise MergeError(f"--device must be cpu, cuda or auto, got {device!r}")


def has_tokenizer(folder: str | os.PathLike) -> bool:
    folder = Path(folder)
    return folder.is_dir() and any((folder / name).is_file() for name in TOKENIZER_FILES)


# ---------------------------------------------------------------------------
# Training outputs given where an HF model folder belongs (shared with chat).

def adapter_base_name(adapter: str | os.PathLike) -> str | None:
    """The base model an adapter folder names in its adapter_config.json."""
    try:
        return json.loads((Path(adapter) / "adapter_config.json").read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        return None


def _is_checkpoint(path: Path) -> bool:
    """An mmengine .pth file or a DeepSpeed checkpoint folder (``latest`` or ``*model_states.pt``)."""
    if path.is_file():
        return path.suffix in (".pth", ".pt")
    return path.is_dir() and ((path / "latest").is_file() or any(path.glob("*model_states.pt"))
                              or any(path.glob("*/*model_states.pt")))


def _is_work_dir(path: Path) -> bool:
    return path.is_dir() and ((path / "last_checkpoint").is_file() or any(path.glob("iter_*.pth"))
                              or (path / "hf_adapter").is_dir() or (path / "hf_model").is_dir())


def _work_dir_fix(work_dir: Path, role: str) -> str:
    adapter, model = work_dir / "hf_adapter", work_dir / "hf_model"
    if (adapter / "adapter_config.json").is_file():
        if role == "BASE":
            return (f"give the base model it was trained from as BASE ({adapter / 'adapter_config.json'} names "
                    f"it: {adapter_base_name(adapter)}) and {adapter} as ADAPTER")
        return f"pass {adapter}"
    if (model / "config.json").is_file():
        return f"pass {model}"
    ckpt = find_latest_checkpoint(work_dir) or work_dir / "iter_N.pth"  # the one --resume would continue
    return f"convert a checkpoint first: sfttool convert pth_to_hf {dumped_config(work_dir)} {ckpt} OUT"


def dumped_config(work_dir: Path) -> str:
    """The config `sfttool train` dumped in ``work_dir`` (``utils.checkpoint_file.run_config``),
    or the placeholder CONFIG when it cannot tell."""
    found = run_config(work_dir) if _is_work_dir(work_dir) else None
    return str(found) if found else "CONFIG"


def _could_be_hub_name(name: str) -> bool:
    """'Qwen/Qwen2.5-0.5B' or 'gpt2' could be on the model hub; '/models/x' or './x' cannot."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def training_output_problem(path: str | os.PathLike, role: str = "MODEL") -> str | None:
    """Why ``path`` is not an HF model folder, with the fix, when it is a
    checkpoint, a work dir, another file or folder, or a missing local path;
    None for a model or adapter folder, or a name the model hub may hold."""
    local = Path(path)
    if local.is_dir() and ((local / "config.json").is_file() or (local / "adapter_config.json").is_file()):
        return None
    if _is_checkpoint(local):
        return (f"{path}: a training checkpoint, not an HF model folder; convert it first: "
                f"sfttool convert pth_to_hf {dumped_config(local.parent)} {path} OUT")
    if local.is_file():
        return f"{path}: a file, not an HF model folder (a folder with config.json)"
    if not local.exists():
        return None if _could_be_hub_name(str(path)) else f"{path}: no such folder"
    if _is_work_dir(local):
        return f"{path}: a training work dir, not an HF model folder; {_work_dir_fix(local, role)}"
    return f"{path}: not an HF model folder (no config.json)"


@contextlib.contextmanager
def load_errors(path: str | os.PathLike, error: type[Exception]) -> Iterator[None]:
    """transformers' OSError for a model it cannot find runs to several lines
    and, for a local path that does not exist, talks about huggingface.co:
    turn it into one line of ``error`` naming the path and the fix."""
    try:
        yield
    except OSError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if not os.path.exists(path):
            raise error(f"{path}: no such folder, and the model hub did not provide it ({first}); "
                        "without access to the model hub, give a local folder") from None
        raise error(f"{path}: cannot be loaded: {first}") from None


def _check_base(base: str | os.PathLike) -> None:
    if (Path(base) / "adapter_config.json").is_file():
        raise MergeError(f"{base}: BASE is a LoRA adapter folder; give the base model it was trained from "
                         f"(adapter_config.json names it: {adapter_base_name(base)})")
    problem = training_output_problem(base, role="BASE")
    if problem:
        raise MergeError(problem)


def _check_adapter(adapter: Path) -> None:
    if not (adapter / "adapter_config.json").is_file():
        fix = (f"pass {adapter / 'hf_adapter'}" if (adapter / "hf_adapter" / "adapter_config.json").is_file() else
               "convert a training checkpoint first with `sfttool convert pth_to_hf CONFIG CHECKPOINT SAVE_DIR`")
        raise MergeError(f"{adapter}: not a peft adapter folder (no adapter_config.json); {fix}")


# ---------------------------------------------------------------------------
# Merging and saving.

def load_merged(base: str | os.PathLike, adapter: str | os.PathLike, device: str = "cpu", dtype="auto",
                tokenizer=None):
    """Base model with ``adapter`` folded into its weights (a plain transformers model).
    ``tokenizer``: the one saved with the adapter, when the caller has loaded it already."""
    _check_adapter(Path(adapter))
    _check_base(base)
    compat.quiet_bnb_cpu_kernel_warning()  # peft imports bitsandbytes, whose CPU kernel warning is noise here
    from peft import PeftModel  # after the line above: it imports bitsandbytes
    from transformers import AutoModelForCausalLM

    model_class, extra = adapter_model_class(adapter)  # a reward model's adapter needs its classifier
    with load_errors(base, MergeError):
        if model_class is AutoModelForCausalLM:
            model_class = language_model_class(base)  # a vision-language checkpoint keeps its vision tower
        model = model_class.from_pretrained(base, dtype=dtype, device_map=device_map_for(device), **extra)
    fit_embeddings_to_adapter(model, tokenizer or adapter_tokenizer(adapter))
    with _targets_as_saved(adapter):
        model = PeftModel.from_pretrained(model, str(adapter))
    return model.merge_and_unload()


def _targets_as_saved(adapter: str | os.PathLike):
    """An adapter with fused-expert targets (``target_parameters``) was trained on a transformers 5
    model: its targets load as saved (``compat.peft_targets_as_given``); others keep peft's renaming of
    transformers 4 MoE targets."""
    config = json.loads((Path(adapter) / "adapter_config.json").read_text())
    return compat.peft_targets_as_given() if config.get("target_parameters") else contextlib.nullcontext()


def adapter_tokenizer(adapter: str | os.PathLike, **kwargs):
    """The tokenizer saved with an adapter, or None."""
    if not has_tokenizer(adapter):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(adapter), **kwargs)


PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")


def saved_processor(folder: str | os.PathLike, **kwargs):
    """The processor saved in a model or adapter folder (an image-text model's), or None."""
    if not any((Path(folder) / name).is_file() for name in PROCESSOR_FILES):
        return None
    from transformers import AutoProcessor
    compat.processors_without_torchvision()
    return AutoProcessor.from_pretrained(str(folder), **kwargs)


def fit_embeddings_to_adapter(model, tokenizer) -> None:
    """Grow the base model's embeddings to ``tokenizer``, the one saved with the adapter (None: no
    change), as training did when it had added tokens; the adapter then carries the trained rows
    (else peft fails on a size mismatch of embed_tokens/lm_head)."""
    if tokenizer is not None:
        resize_embeddings(model, tokenizer)


def merge_adapter(base: str | os.PathLike, adapter: str | os.PathLike, save_dir: str | os.PathLike,
                  device: str = "cpu", safe_serialization: bool = True,
                  max_shard_size: str | int = "2GB") -> Path:
    """Write the merged model, the tokenizer (the adapter's if it has one, else
    the base's), the processor of an image-text model (likewise) and the training config when the
    adapter folder carries it."""
    from transformers import AutoTokenizer

    adapter, save_dir = Path(adapter), Path(save_dir)
    tokenizer = adapter_tokenizer(adapter)
    merged = load_merged(base, adapter, device=device, tokenizer=tokenizer)
    tokenizer = tokenizer or AutoTokenizer.from_pretrained(base)
    with output_folder(save_dir, MergeError) as tmp:
        save_model(merged, tmp, safe_serialization=safe_serialization, max_shard_size=max_shard_size)
        processor = saved_processor(adapter) or saved_processor(base)
        if processor is not None:  # a vision-language model's: the merged folder loads like the base
            processor.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if (adapter / SAVED_CONFIG_NAME).is_file():
            shutil.copy(adapter / SAVED_CONFIG_NAME, tmp / SAVED_CONFIG_NAME)
    return save_dir
