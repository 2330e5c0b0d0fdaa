"""`sfttool plot WORK_DIR... [-o FILE.png]`."""
from __future__ import annotations

from pathlib import Path

import click

from sfttool.cli.errors import user_errors


@click.command()
@click.argument("work_dirs", nargs=-1, required=True, type=click.Path(exists=True))
@click.option("-o", "--output", type=click.Path(dir_okay=False),
              help="The PNG to write. Default: WORK_DIR/loss.png for one run, ./loss_comparison.png for several.")
@user_errors
def plot(work_dirs, output) -> None:
    """Plot train loss (raw and smoothed), validation loss and learning rate against optimizer steps
    from each run's logged scalars; finished or still running. Several WORK_DIRS are drawn together,
    one legend entry each."""
    from sfttool.tools.plot import plot_runs

    if output is None:
        output = Path(work_dirs[0]) / "loss.png" if len(work_dirs) == 1 else Path("loss_comparison.png")
    plot_runs(list(work_dirs), output)
    click.echo(f"Saved the plot to {output}")
