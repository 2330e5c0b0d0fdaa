"""Loading is safe: checkpoints unpickle only allow-listed types, remote code is opt-in."""
from __future__ import annotations

import pickle
import re
from pathlib import Path

import pytest
import torch

from sfttool import compat
from sfttool.config import builtin_config_dir

class _RunsShell:
    """Pickles to `os.system(<command>)`: what a hostile checkpoint would hold."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        import os
        return os.system, (self.command,)


@pytest.fixture(scope="module", autouse=True)
def _training_patches():
    compat.apply_training()


def test_allow_list_holds_only_tensor_numpy_and_mmengine_log_types():
    """torch allow-lists its own tensor types; we add mmengine's HistoryBuffer and the numpy
    pieces inside it, nothing that could reach os, builtins or arbitrary attributes."""
    for obj in torch.serialization.get_safe_globals():
        obj = obj[0] if isinstance(obj, tuple) else obj
        module = getattr(obj, "__module__", "") or ""
        assert module.startswith(("torch", "numpy")) or getattr(obj, "__name__", "") == "HistoryBuffer", \
            f"unexpected type on the weights_only allow-list: {module}.{getattr(obj, '__name__', obj)}"


def test_hostile_checkpoint_is_refused_and_never_runs(tmp_path):
    from mmengine.runner.checkpoint import _load_checkpoint

    proof = tmp_path / "pwned"
    path = tmp_path / "iter_1.pth"
    torch.save({"state_dict": {"w": torch.ones(1)}, "meta": _RunsShell(f"touch {proof}")}, path)
    with pytest.raises(pickle.UnpicklingError, match="posix.system|Unsupported global"):
        torch.load(path, map_location="cpu")             # the default our resume path relies on
    with pytest.raises(pickle.UnpicklingError):
        _load_checkpoint(str(path), map_location="cpu")  # mmengine's loader, as --resume calls it
    assert not proof.exists()


def test_history_buffer_saves_without_getattr(tmp_path):
    from mmengine.logging import MessageHub

    hub = MessageHub.get_instance("safe_loading")
    hub.update_scalar("train/loss", 1.5)
    path = tmp_path / "hub.pth"
    torch.save({"message_hub": hub.state_dict()}, path)
    loaded = torch.load(path, map_location="cpu", weights_only=True)
    assert loaded["message_hub"]["log_scalars"]["train/loss"].current() == 1.5


def test_builtin_configs_explain_every_trust_remote_code_true():
    """Only families whose modelling code is not in transformers turn it on, and say so."""
    for file in sorted(Path(builtin_config_dir()).rglob("*.py")):
        text = file.read_text()
        if re.search(r"trust_remote_code\s*=\s*True", text):
            assert re.search(r"#.*trust_remote_code", text), \
                f"{file}: trust_remote_code=True needs a comment saying why (modelling code not in transformers)"
