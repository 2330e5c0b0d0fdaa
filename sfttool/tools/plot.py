"""Loss curves from a run's own scalars: train loss (raw and smoothed), validation loss, learning rate,
(online RL) the mean reward and (preference runs) the held-out accuracy against optimizer steps.

mmengine's ``LocalVisBackend`` appends one JSON line per log to
``WORK_DIR/<timestamp>/vis_data/scalars.json``: train lines carry ``loss`` (the logged optimizer step's
loss, see ``sfttool.engine.runner``), ``lr`` and ``step`` (the iteration that ended the step),
validation lines ``val/loss`` (and, for preference runs, ``val/rewards/accuracies`` or a reward model's
``val/accuracy``) and ``step``. Iteration ``i`` belongs to optimizer step
``ceil(i / accumulative_counts)``. A resumed run starts a new timestamp folder, so a work dir's folders
are read in order and a later line for a step replaces an earlier one. A line still being written (a
running run) is skipped::

    plot_runs(['work_dirs/a', 'work_dirs/b'], 'compare.png')   # one legend entry per run

The smoothed line is a trailing mean: each point is the mean of the last ``window`` logged losses up
to it (fewer at the start), so it never sits above all of them; the legend gives the window.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from sfttool.errors import SfttoolError

SCALARS = "scalars.json"
MAX_WINDOW = 25  # the longest smoothing window, in logged points


class PlotError(SfttoolError, ValueError):
    """A work dir without scalars to plot."""


@dataclass
class RunCurves:
    """One run's curves, x in optimizer steps."""
    name: str
    train: dict[int, float] = field(default_factory=dict)  # step -> loss
    lr: dict[int, float] = field(default_factory=dict)
    val: dict[int, float] = field(default_factory=dict)
    reward: dict[int, float] = field(default_factory=dict)  # online RL: the step's mean reward
    val_accuracy: dict[int, float] = field(default_factory=dict)  # preference runs: held-out pairs ranked right


def scalar_files(path: str | Path) -> list[Path]:
    """The scalars files of a work dir (one per run folder, oldest first), a run folder or a file."""
    path = Path(path)
    if path.is_file():
        return [path]
    files = sorted(path.glob(f"*/vis_data/{SCALARS}")) or sorted(path.glob(f"vis_data/{SCALARS}"))
    if not files:
        raise PlotError(f"{path}: no */vis_data/{SCALARS} (the scalars mmengine logs during training); give the "
                        "work dir of a run started with `sfttool train`")
    return files


def accumulation(scalars_file: Path) -> int:
    """Iterations per optimizer step, from the config the run dumped beside its scalars (1 if unknown)."""
    config = scalars_file.parent / "config.py"
    found = re.findall(r"accumulative_counts\s*=\s*(\d+)", config.read_text()) if config.exists() else []
    return int(found[-1]) if found else 1  # the last: optim_wrapper's, after PART 1's setting


def read_run(path: str | Path, name: str | None = None) -> RunCurves:
    """A run's curves from its scalars files (see the module docstring)."""
    files = scalar_files(path)
    run = RunCurves(name or Path(path).resolve().name)
    for file in files:
        per_step = accumulation(file)
        for record in _records(file):
            step = record.get("step")
            if not isinstance(step, (int, float)):
                continue
            x = math.ceil(step / per_step)  # the optimizer step the iteration belongs to
            for key, curve in (("loss", run.train), ("lr", run.lr), ("val/loss", run.val),
                               ("reward", run.reward), ("val/rewards/accuracies", run.val_accuracy),
                               ("val/accuracy", run.val_accuracy)):
                value = record.get(key)
                if isinstance(value, (int, float)) and math.isfinite(value):
                    curve[x] = float(value)
    return run


def _records(file: Path):
    for line in file.read_text().splitlines():
        try:
            yield json.loads(line)
        except json.JSONDecodeError:  # a line being written by a running run
            continue


def smoothing_window(points: int) -> int:
    """Logged points per smoothed point: a fifth of the curve, 1 (no smoothing) to ``MAX_WINDOW``."""
    return max(1, min(MAX_WINDOW, points // 5))


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean: each value's mean with the ``window - 1`` before it (fewer at the start).

    >>> smooth([4.0, 2.0, 3.0, 1.0], window=2)
    [4.0, 3.0, 2.5, 2.0]
    """
    return [sum(values[max(0, i + 1 - window):i + 1]) / min(i + 1, window) for i in range(len(values))]


def _plot_rewards(ax, runs: list[RunCurves]) -> None:
    """Online RL's mean reward per optimizer step (thin) and its trailing mean (thick)."""
    for i, run in enumerate(runs):
        steps = sorted(run.reward)
        values = [run.reward[s] for s in steps]
        ax.plot(steps, values, color=f"C{i}", alpha=0.3, linewidth=0.8)
        ax.plot(steps, smooth(values, smoothing_window(len(values))), color=f"C{i}", linewidth=2, label=run.name)
    ax.set_ylabel("mean reward")


def _plot_val_accuracy(ax, runs: list[RunCurves]) -> None:
    """A preference run's held-out accuracy at each validation."""
    for i, run in enumerate(runs):
        steps = sorted(run.val_accuracy)
        ax.plot(steps, [run.val_accuracy[s] for s in steps], color=f"C{i}", linestyle="--", marker="o",
                label=run.name)
    ax.set_ylabel("held-out accuracy")


def plot_runs(paths: list[str | Path], output: str | Path, names: list[str] | None = None):
    """Draw the runs' curves into ``output`` (PNG); returns the matplotlib figure."""
    import matplotlib
    matplotlib.use("Agg")  # no display needed: write a file
    import matplotlib.pyplot as plt

    runs = [read_run(p, names[i] if names else None) for i, p in enumerate(paths)]
    # axes between the loss (top) and the learning rate (bottom), where a run has their values
    middle = [draw for draw, present in ((_plot_rewards, any(run.reward for run in runs)),
                                         (_plot_val_accuracy, any(run.val_accuracy for run in runs))) if present]
    fig, axes = plt.subplots(2 + len(middle), 1, figsize=(9, 7 + 3 * len(middle)), sharex=True,
                             height_ratios=(3, *[2] * len(middle), 1))
    loss_ax, lr_ax = axes[0], axes[-1]
    for draw, ax in zip(middle, axes[1:-1]):
        draw(ax, runs)
    smoothed = False
    for i, run in enumerate(runs):
        color = f"C{i}"
        steps, losses = sorted(run.train), [run.train[s] for s in sorted(run.train)]
        window = smoothing_window(len(losses))
        if window > 1:
            smoothed = True
            loss_ax.plot(steps, losses, color=color, alpha=0.3, linewidth=0.8)
            loss_ax.plot(steps, smooth(losses, window), color=color, linewidth=2,
                         label=f"{run.name} (mean of the last {window} logged steps)")
        else:  # too few points to smooth
            loss_ax.plot(steps, losses, color=color, linewidth=2, label=run.name)
        if run.val:
            val_steps = sorted(run.val)
            loss_ax.plot(val_steps, [run.val[s] for s in val_steps], color=color, linestyle="--", marker="o")
        lr_ax.plot(sorted(run.lr), [run.lr[s] for s in sorted(run.lr)], color=color)
    train = "thin: train, thick: its trailing mean" if smoothed else "train"
    loss_ax.set_title(f"loss per optimizer step ({train}, dashed with dots: validation)")
    loss_ax.set_ylabel("loss")
    loss_ax.legend()
    lr_ax.set_ylabel("learning rate")
    lr_ax.set_xlabel("optimizer step")
    fig.tight_layout()
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=100)
    plt.close(fig)
    return fig
