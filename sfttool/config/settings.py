"""The PART 1 settings sfttool reads from a config's top level itself, besides the keys mmengine's
runner reads: the one list of them.

    seed = 42                      # PART 1 of a config
    sequence_parallel_size = 2

The run's spec (``sfttool.engine.spec``) reads each through ``setting``; ``--cfg-options NAME=VALUE``
may always override one of them, even where nothing else in the config reads the name, since sfttool
does (``sfttool.config.overrides``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Setting:
    name: str
    default: Any
    meaning: str


SETTINGS = {s.name: s for s in (
    Setting("seed", None, "the seed of every draw when randomness.seed is unset"),
    Setting("sequence_parallel_size", 1, "processes that share each row (1: off)"),
    Setting("val_ratio", None, "the share of the rows held out for validation"),
    Setting("val_data_path", None, "validation data of its own (wins over val_ratio)"),
    Setting("report_to", None, "experiment trackers: 'tensorboard', 'wandb', 'mlflow'"),
    Setting("export_best", False, "export the best validation's weights instead of the last"),
    Setting("experiment_name", None, "the run's name (default: the config's file name)"),
    Setting("work_dir", None, "where the run writes (--work-dir wins)"),
    Setting("router_aux_loss_coef", None, "weight of an MoE router's load-balancing loss (None: the model's)"),
)}


def setting(cfg: Any, name: str) -> Any:
    """The config's value of the PART 1 setting ``name``, or its default when the config has none.
    Only the names of ``SETTINGS``: a new one is added there, so ``--cfg-options`` knows it."""
    return cfg.get(name, SETTINGS[name].default)


def has_setting(cfg: Any, name: str) -> bool:
    """Whether the config assigns ``name`` at all (``val_ratio = None`` is an answer, not a gap)."""
    if name not in SETTINGS:
        raise KeyError(name)
    return name in cfg
