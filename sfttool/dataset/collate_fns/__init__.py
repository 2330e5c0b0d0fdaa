"""Batch collation (XTuner's module path: ``sfttool.dataset.collate_fns``)."""
from sfttool.registry import BUILDER

from .default_collate_fn import cumulative_lengths, default_collate_fn
from .kto_collate_fn import kto_collate_fn
from .preference_collate_fn import preference_collate_fn
from .prompt_collate_fn import prompt_collate_fn

BUILDER.register_module(name="default_collate_fn", module=default_collate_fn, force=True)
BUILDER.register_module(name="kto_collate_fn", module=kto_collate_fn, force=True)
BUILDER.register_module(name="preference_collate_fn", module=preference_collate_fn, force=True)
BUILDER.register_module(name="prompt_collate_fn", module=prompt_collate_fn, force=True)

__all__ = ["cumulative_lengths", "default_collate_fn", "kto_collate_fn", "preference_collate_fn", "prompt_collate_fn"]
