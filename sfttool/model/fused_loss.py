"""Optional fused linear + cross-entropy kernels (GPU, Triton): Liger's and
Cut Cross-Entropy's. ``loss_implementation='chunked'`` (pure PyTorch, see
``chunked_loss``) is the default and the reference they are checked against.

Each computes the same sum as ``chunked_linear_cross_entropy``: per-token CE,
weighted per token for the 'sample' reduction.
"""
from __future__ import annotations

import importlib

import torch

from sfttool.errors import SfttoolError

# loss_implementation -> (module to import, pip extra, pip package)
KERNELS = {
    "liger": ("liger_kernel", "liger", "liger-kernel"),
    "cut_cross_entropy": ("cut_cross_entropy", "cce", "cut-cross-entropy"),
}
IMPLEMENTATIONS = ("chunked", "unchunked", *KERNELS)


class LossKernelMissingError(SfttoolError, ImportError):
    """A fused loss kernel was selected but its package is not installed."""


def require_kernel(name: str) -> None:
    """Import the kernel package ``name`` needs, or say which extra installs it."""
    module, extra, package = KERNELS[name]
    try:
        importlib.import_module(module)
    except ImportError as exc:
        raise LossKernelMissingError(
            f"model.loss_implementation={name!r} needs the {package} package ({exc}): "
            f"pip install 'sfttool[{extra}]', or set model.loss_implementation='chunked'") from None


def fused_linear_cross_entropy(name: str, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                               targets: torch.Tensor, token_weights: torch.Tensor | None) -> torch.Tensor:
    """The weighted CE sum through the kernel ``name`` (see the module docstring)."""
    if name == "liger":
        return _liger(hidden, weight, bias, targets, token_weights)
    return _cut_cross_entropy(hidden, weight, bias, targets, token_weights)


def _liger(hidden, weight, bias, targets, token_weights):
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    # Liger folds the incoming gradient in as a scalar only, so per-token
    # weights ('sample' reduction) cannot be applied after it; SupervisedFinetune refuses that pairing.
    assert token_weights is None, "liger supports the 'token' reduction only"
    out = liger_fused_linear_cross_entropy(hidden, weight, targets, bias=bias, reduction="sum")
    return (out[0] if isinstance(out, tuple) else out).float()


def _cut_cross_entropy(hidden, weight, bias, targets, token_weights):
    from cut_cross_entropy import linear_cross_entropy

    kwargs = {"bias": bias} if bias is not None else {}
    if token_weights is None:
        return linear_cross_entropy(hidden, weight, targets, reduction="sum", **kwargs).float()
    per_token = linear_cross_entropy(hidden, weight, targets, reduction="none", **kwargs)  # [n]
    return (per_token.float() * token_weights).sum()
