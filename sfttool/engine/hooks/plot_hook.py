"""``work_dir/loss.png`` at the end of training: the plot `sfttool plot WORK_DIR` draws."""
from __future__ import annotations

import logging
from pathlib import Path

from mmengine.dist import is_main_process
from mmengine.hooks import Hook

from sfttool.registry import BUILDER

PLOT_FILE = "loss.png"


@BUILDER.register_module()
class LossPlotHook(Hook):
    """Draws train loss (raw and smoothed), validation loss and learning rate from the run's logged
    scalars into ``work_dir/loss.png`` once training ends (rank 0). A failure to draw is a warning:
    the run's weights matter more than its picture."""

    priority = "LOWEST"  # after every hook that logs in after_train

    def after_train(self, runner) -> None:
        from sfttool.tools.plot import plot_runs

        if not is_main_process():
            return
        output = Path(runner.work_dir) / PLOT_FILE
        try:
            plot_runs([runner.work_dir], output, names=[runner.experiment_name])
        except (ValueError, OSError) as exc:  # PlotError is a ValueError
            runner.logger.log(logging.WARNING, f"No loss plot: {exc}")
            return
        runner.logger.info(f"Saved the loss plot to {output}")
