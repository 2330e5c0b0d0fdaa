"""`sfttool plot`: the curves drawn are the logged scalars, against optimizer steps; a resumed run's
folders join, a line being written is skipped, several runs get one legend entry each."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from sfttool.cli.main import cli
from sfttool.tools.plot import PlotError, plot_runs, read_run, smooth, smoothing_window


def write_run(folder, records, accumulative_counts=None, tail=""):
    vis = folder / "vis_data"
    vis.mkdir(parents=True)
    (vis / "scalars.json").write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    if accumulative_counts is not None:
        (vis / "config.py").write_text(f"accumulative_counts = {accumulative_counts}\n"
                                       f"optim_wrapper = dict(\n    accumulative_counts={accumulative_counts},\n)\n")


def train(step, loss, lr=1e-3):
    return {"lr": lr, "loss": loss, "grad_norm": 1.0, "iter": step, "step": step}


@pytest.fixture
def work_dir(tmp_path):
    """Iterations 2..8 with 2 per optimizer step, interrupted after 6 and resumed from 4."""
    work = tmp_path / "run_a"
    write_run(work / "20260101_000000", [train(2, 3.0, 1e-4), train(4, 2.5, 2e-4), {"val/loss": 2.7, "step": 4},
                                         train(6, 9.9, 3e-4)], accumulative_counts=2)
    write_run(work / "20260101_010000", [train(6, 2.2, 3e-4), train(8, 2.0, 4e-4), {"val/loss": 2.4, "step": 8}],
              accumulative_counts=2, tail='{"lr": 5e-4, "lo')  # still being written
    return work


def test_read_run_gives_the_logged_values_per_optimizer_step(work_dir):
    run = read_run(work_dir)
    assert run.train == {1: 3.0, 2: 2.5, 3: 2.2, 4: 2.0}  # the resumed run's iteration 6 replaces the first's
    assert run.lr == {1: 1e-4, 2: 2e-4, 3: 3e-4, 4: 4e-4}
    assert run.val == {2: 2.7, 4: 2.4}


def test_a_short_last_step_is_the_next_step(tmp_path):
    """7 iterations with 2 per step: the last step (one iteration) is step 4, not 3.5."""
    write_run(tmp_path / "run" / "20260101_000000", [train(2, 3.0), train(4, 2.0), train(6, 1.5), train(7, 1.0)],
              accumulative_counts=2)
    assert read_run(tmp_path / "run").train == {1: 3.0, 2: 2.0, 3: 1.5, 4: 1.0}


def test_the_plot_draws_exactly_those_values(tmp_path, work_dir):
    out = tmp_path / "out" / "loss.png"
    fig = plot_runs([work_dir], out)
    loss_ax, lr_ax = fig.axes
    raw, val = loss_ax.lines  # 4 points: too few to smooth
    assert list(raw.get_xdata()) == [1, 2, 3, 4] and list(raw.get_ydata()) == [3.0, 2.5, 2.2, 2.0]
    assert loss_ax.get_title() == "loss per optimizer step (train, dashed with dots: validation)"
    assert list(val.get_xdata()) == [2, 4] and list(val.get_ydata()) == [2.7, 2.4]
    assert list(lr_ax.lines[0].get_ydata()) == [1e-4, 2e-4, 3e-4, 4e-4]
    assert lr_ax.get_xlabel() == "optimizer step"
    _assert_a_real_png(out)


def _assert_a_real_png(path):
    import matplotlib.image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    pixels = matplotlib.image.imread(str(path))
    assert pixels.shape[:2] == (700, 900) and pixels.std() > 0.05  # drawn on, not blank


def test_the_smoothed_line_is_a_trailing_mean_within_its_points(tmp_path):
    """Each smoothed point is the mean of the last `window` logged losses up to it, so it never sits above
    (or below) all of them; the legend gives the window. The exponential average drawn before lagged a
    falling curve from above."""
    import random

    rng = random.Random(0)
    losses = [3.0 * 0.97 ** i + rng.uniform(-0.3, 0.3) for i in range(120)]
    window = smoothing_window(len(losses))
    assert window == 24
    smoothed = smooth(losses, window)
    for i, value in enumerate(smoothed):
        points = losses[max(0, i + 1 - window):i + 1]
        assert value == pytest.approx(sum(points) / len(points), rel=1e-12)
        assert min(points) <= value <= max(points)
    assert smooth([4.0, 2.0, 3.0, 1.0], window=2) == [4.0, 3.0, 2.5, 2.0]
    write_run(tmp_path / "long" / "20260101_000000", [train(i, v) for i, v in enumerate(losses, start=1)])
    fig = plot_runs([tmp_path / "long"], tmp_path / "long.png")
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["long (mean of the last 24 logged steps)"]
    assert list(fig.axes[0].lines[0].get_ydata()) == losses and list(fig.axes[0].lines[1].get_ydata()) == smoothed
    assert fig.axes[0].get_title() == ("loss per optimizer step (thin: train, thick: its trailing mean, dashed with "
                                       "dots: validation)")


def test_several_runs_one_legend_entry_each(tmp_path, work_dir):
    other = tmp_path / "run_b"
    write_run(other / "20260102_000000", [train(1, 4.0), train(2, 3.0)])
    fig = plot_runs([work_dir, other], tmp_path / "cmp.png")
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["run_a", "run_b"]
    assert read_run(other).train == {1: 4.0, 2: 3.0}  # no config dumped: 1 iteration per step


def test_cli_writes_the_png_into_the_work_dir(work_dir):
    result = CliRunner().invoke(cli, ["plot", str(work_dir)])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == f"Saved the plot to {work_dir / 'loss.png'}"
    _assert_a_real_png(work_dir / "loss.png")


def test_cli_without_scalars_is_a_one_line_error(tmp_path):
    result = CliRunner().invoke(cli, ["plot", str(tmp_path)])
    assert result.exit_code == 1
    assert result.output.strip() == (f"Error: {tmp_path}: no */vis_data/scalars.json (the scalars mmengine logs "
                                     "during training); give the work dir of a run started with `sfttool train`")
    with pytest.raises(PlotError):
        read_run(tmp_path)


def test_an_online_rl_run_gets_a_reward_curve(tmp_path):
    """GRPO logs the step's mean reward with the step's last micro-batch: a third axis between loss and lr."""
    work = tmp_path / "grpo"
    write_run(work / "20260103_000000", [dict(train(2, 0.01), reward=0.25), dict(train(4, -0.02), reward=0.5),
                                         dict(train(6, 0.0), reward=0.75)], accumulative_counts=2)
    assert read_run(work).reward == {1: 0.25, 2: 0.5, 3: 0.75}
    fig = plot_runs([work], tmp_path / "rl.png")
    loss_ax, reward_ax, lr_ax = fig.axes
    raw, smoothed = reward_ax.lines
    assert list(raw.get_xdata()) == [1, 2, 3] and list(raw.get_ydata()) == [0.25, 0.5, 0.75]
    assert list(smoothed.get_ydata()) == pytest.approx(smooth([0.25, 0.5, 0.75], smoothing_window(3)))
    assert reward_ax.get_ylabel() == "mean reward" and lr_ax.get_xlabel() == "optimizer step"


@pytest.mark.parametrize("key", ["val/rewards/accuracies", "val/accuracy"])
def test_a_preference_run_gets_its_held_out_accuracy(tmp_path, key):
    """DPO/ORPO validation logs val/rewards/accuracies (a reward model val/accuracy): an axis of its own,
    between loss and lr; val/loss joins the loss axis as for SFT."""
    work = tmp_path / "dpo"
    write_run(work / "20260104_000000", [train(2, 0.69), {"val/loss": 0.68, key: 0.5, "step": 2}, train(4, 0.5),
                                         {"val/loss": 0.6, key: 0.875, "step": 4}], accumulative_counts=1)
    run = read_run(work)
    assert run.val == {2: 0.68, 4: 0.6} and run.val_accuracy == {2: 0.5, 4: 0.875}
    loss_ax, accuracy_ax, lr_ax = plot_runs([work], tmp_path / "dpo.png").axes
    (line,) = accuracy_ax.lines
    assert list(line.get_xdata()) == [2, 4] and list(line.get_ydata()) == [0.5, 0.875]
    assert accuracy_ax.get_ylabel() == "held-out accuracy" and lr_ax.get_xlabel() == "optimizer step"
    assert list(loss_ax.lines[-1].get_ydata()) == [0.68, 0.6]
