"""Experiment trackers: PART 1's ``report_to`` as mmengine visualizer backends.

    report_to = ['tensorboard']            # or 'wandb', 'mlflow'; [] or ['none'] for none
    report_to = 'auto'                     # TensorBoard when its package is installed, else none

The built-in configs say ``'auto'``: they run on the base install, which has no tracker package, and
the run's summary says whether TensorBoard is on (``auto_tracking_note``). A tracker named outright
must be installed: ``check_trackers`` stops the run with one line naming the extra otherwise.

Every scalar the runner logs goes to each backend through mmengine's ``LoggerHook``: train loss,
learning rate, grad norm, tokens/s and MFU (``ThroughputHook``), ``val/loss`` and ``val/ppl`` (a
preference run's ``val/loss`` and ``val/rewards/*``). The resolved config is recorded once, and the
sample generations as text (``add_text``). mmengine's
``LocalVisBackend`` is always kept: ``vis_data/scalars.json`` is what ``sfttool plot`` reads.

mmengine's wandb and MLflow backends record the config with ``Config.to_dict()``, which holds the
classes and functions of a Python config and fails there; ``TrackingVisualizer`` hands them a copy
with those written as dotted names. A config's own ``visualizer = dict(type=Visualizer, ...)``
gets the same treatment, with ``report_to``'s backends added to its list.
"""
from __future__ import annotations

import html
import importlib.util
import os
from pathlib import Path
from typing import Any

from mmengine.dist import master_only
from mmengine.visualization import (LocalVisBackend, MLflowVisBackend, TensorboardVisBackend, Visualizer,
                                    WandbVisBackend)

from sfttool.errors import SfttoolError
from sfttool.registry import BUILDER, type_name


class TrackingError(SfttoolError, ValueError):
    """A ``report_to`` name that is unknown or whose package is not installed."""


# What 'auto' turns on, each only when its package is installed: TensorBoard needs no account,
# no network and no server to write its files.
AUTO = "auto"
AUTO_TRACKERS = ("tensorboard",)


def tracker_names(report_to: Any) -> list[str]:
    """``report_to`` as a checked list of tracker names ('none' and [] give []; 'auto' gives
    the installed ones of ``AUTO_TRACKERS``)."""
    if report_to is None or report_to == "none":
        return []
    names = [report_to] if isinstance(report_to, str) else list(report_to)
    for name in names:
        if name not in ("none", AUTO) and name not in TRACKERS:
            raise TrackingError(f"report_to: unknown tracker {name!r}; choose from {', '.join(TRACKERS)}, "
                                f"{AUTO!r} or 'none'")
    chosen = []
    for name in names:
        expanded = [n for n in AUTO_TRACKERS if _installed(TRACKERS[n][1])] if name == AUTO else [name]
        chosen += [n for n in expanded if n != "none" and n not in chosen]
    return chosen


def check_trackers(cfg: Any) -> None:
    """Before anything is built: every tracker ``report_to`` names has its package installed."""
    for name in tracker_names(cfg.get("report_to")):
        _, package, extra = TRACKERS[name]
        if not _installed(package):
            raise TrackingError(f"report_to: {name!r} needs the {package} package, which is not installed: "
                                f"pip install 'sfttool[{extra}]' (or remove {name!r} from report_to)")


def auto_tracking_note(cfg: Any) -> str:
    """The summary's sentence on what ``report_to='auto'`` turned on here; '' for any other ``report_to``.

    " report_to='auto': tensorboard is off, as its package is not installed (pip install 'sfttool[tensorboard]'
    turns it on)."
    """
    report_to = cfg.get("report_to")
    if not (report_to == AUTO or (isinstance(report_to, (list, tuple)) and AUTO in report_to)):
        return ""
    on = [n for n in AUTO_TRACKERS if _installed(TRACKERS[n][1])]
    off = [n for n in AUTO_TRACKERS if n not in on]
    parts = [f"{n} is on (installed)" for n in on] + [
        f"{n} is off, as its package is not installed (pip install 'sfttool[{TRACKERS[n][2]}]' turns it on)"
        for n in off]
    return f" report_to='auto': {'; '.join(parts)}."


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def visualizer_cfg(cfg: Any, trackers: tuple[str, ...]) -> Any:
    """The Runner's ``visualizer``: the config's own (mmengine's ``Visualizer`` becomes
    ``TrackingVisualizer``) or a new one, with ``LocalVisBackend`` and a backend per tracker
    (``report_to``'s names, ``RunSpec.trackers``)."""
    own = cfg.get("visualizer")
    if own is not None and not isinstance(own, dict):
        return own  # a built visualizer: used as it is
    visualizer = dict(own or {})
    if type_name(visualizer.get("type", Visualizer)) == "Visualizer":
        visualizer["type"] = TrackingVisualizer
    backends = [dict(b, type=MLflowBackend) if isinstance(b, dict) and type_name(b.get("type")) == "MLflowVisBackend"
                else b for b in visualizer.get("vis_backends") or []]  # MLflow 3 refuses mmengine's default store
    present = {type_name(b.get("type")) for b in backends if isinstance(b, dict)}
    for backend in [LocalVisBackend] + [TRACKERS[n][0] for n in trackers]:
        if backend.__name__ not in present:
            backends.append(dict(type=backend))
            present.add(backend.__name__)
    visualizer["vis_backends"] = backends
    return visualizer


def plain_config(config: Any):
    """A copy of ``config`` with only JSON-like values: classes and functions as dotted names."""
    from mmengine.config import Config

    def plain(value: Any) -> Any:
        if isinstance(value, dict):
            return {str(k): plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        if value is None or isinstance(value, (str, int, float, bool)):
            return value
        name = getattr(value, "__qualname__", None)
        return f"{getattr(value, '__module__', '')}.{name}" if name else repr(value)

    return Config(plain(config.to_dict() if hasattr(config, "to_dict") else dict(config)))


@BUILDER.register_module()
class MLflowBackend(MLflowVisBackend):
    """mmengine's MLflow backend. Without a tracking URI (the argument, else ``MLFLOW_TRACKING_URI``) it
    writes a SQLite store and the artifacts into ``vis_data``: mmengine's default, a file store, is
    refused by MLflow 3 (``MLFLOW_ALLOW_FILE_STORE``), and a SQLite store's default artifact folder is
    ``./mlruns`` wherever training was started."""

    def __init__(self, save_dir: str, exp_name: str | None = "sfttool", **kwargs) -> None:
        super().__init__(save_dir, exp_name=exp_name, **kwargs)

    def _init_env(self):
        if self._tracking_uri is None:
            self._tracking_uri = os.environ.get("MLFLOW_TRACKING_URI")
        if self._tracking_uri is None:
            folder = Path(self._save_dir).resolve()
            self._tracking_uri = f"sqlite:///{folder / 'mlflow.db'}"
            self._artifact_location = self._artifact_location or (folder / "mlflow_artifacts").as_uri()
        super()._init_env()

    def close(self) -> None:
        """mmengine uploads every ``*.json, *.log, *.py, *.yaml`` under the config's ``work_dir`` (which
        a run given ``--work-dir`` lacks; the artifacts folder is inside it): upload the run's log and
        scalars (``add_config`` logged the config)."""
        if not hasattr(self, "_mlflow"):
            return
        run_dir = Path(self._save_dir).parent
        for file in [*sorted(run_dir.glob("*.log")), Path(self._save_dir) / "scalars.json"]:
            if file.is_file():
                self._mlflow.log_artifact(str(file))
        self._mlflow.end_run()


# report_to name -> (backend, the package it imports, the sfttool extra that installs it)
TRACKERS = {
    "tensorboard": (TensorboardVisBackend, "tensorboard", "tensorboard"),
    "wandb": (WandbVisBackend, "wandb", "wandb"),
    "mlflow": (MLflowBackend, "mlflow", "mlflow"),
}


@BUILDER.register_module()
class TrackingVisualizer(Visualizer):
    """mmengine's ``Visualizer`` that records a Python config in every backend, and text."""

    @master_only
    def add_config(self, config: Any, **kwargs) -> None:
        plain = None
        for backend in self._vis_backends.values():
            if isinstance(backend, LocalVisBackend):
                backend.add_config(config, **kwargs)  # dumps the config file as it is
            else:
                plain = plain if plain is not None else plain_config(config)
                backend.add_config(plain, **kwargs)

    @master_only
    def add_text(self, tag: str, text: str, step: int = 0) -> None:
        for backend in self._vis_backends.values():
            if isinstance(backend, TensorboardVisBackend):
                backend.experiment.add_text(tag, text, step)
            elif isinstance(backend, WandbVisBackend):
                import wandb
                backend.experiment.log({tag: wandb.Html(f"<pre>{html.escape(text)}</pre>")})
            elif isinstance(backend, MLflowVisBackend):
                backend.experiment.log_text(text, f"{tag}/step_{step}.txt")


def add_text(visualizer: Any, tag: str, text: str, step: int) -> None:
    """Text to every tracker, when the runner's visualizer can record it."""
    if isinstance(visualizer, TrackingVisualizer):
        visualizer.add_text(tag, text, step)
