"""``VarlenAttnArgsToMessageHubHook``, kept so XTuner configs migrate by a rename.

XTuner passes packed rows' cumulative lengths to its patched attention
through mmengine's message hub. sfttool needs no such side channel: every
batch carries ``position_ids`` that restart at each sample, and transformers
isolates the samples from them on every attention backend. The hook is
therefore a no-op.
"""
from __future__ import annotations

from mmengine.hooks import Hook

from sfttool.registry import BUILDER


@BUILDER.register_module()
class VarlenAttnArgsToMessageHubHook(Hook):
    """Accepted for compatibility; does nothing (see the module docstring)."""
