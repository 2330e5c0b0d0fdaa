"""The rows a checked dataset node reads, loaded as ``train`` loads them: every local JSON file
checked line by line first, then the rows. A node whose rows are a part of other data (a
``validation_split`` holding rows out) is checked over all of that data, since training reads
the held-out rows too, and row numbers stay those of the loaded data."""
from __future__ import annotations

from typing import Any, Callable

from sfttool.dataset.load import check_json_file
from sfttool.dataset.resolve import json_source_files, resolve_dataset, resolve_map_fn, rows_config
from sfttool.tools.findings import Echo, Findings, guard


def load_every_row(dataset_cfg: Any, split: str, findings: Findings, echo: Echo) -> Any:
    """Every row the node's data holds (``resolve.rows_config``), or None after an error (recorded)."""
    errors_before = findings.count()
    every_cfg = rows_config(dataset_cfg)
    field = every_cfg.get("field") if isinstance(every_cfg, dict) else None
    for file in json_source_files(dataset_cfg):
        echo(f"Checking every line of {file}")
        guard(findings, check_json_file, file, False, field)  # rows are validated one by one afterwards
    if findings.count() > errors_before:
        return None
    echo("Building the dataset ...")
    return guard(findings, resolve_dataset, every_cfg, split, validate=False)


def load_trained_part(dataset_cfg: Any, every: Any, split: str, findings: Findings, echo: Echo) -> Any:
    """The rows the node trains on: ``every`` itself, or the part a ``validation_split`` keeps (built
    once the rows are known to be good: the split checks its file again, stopping at a first error)."""
    if rows_config(dataset_cfg) is dataset_cfg:
        return every
    part = guard(findings, resolve_dataset, dataset_cfg, split, validate=False)
    if part is not None and len(part) != len(every):
        echo(f"{len(every) - len(part)} of the {len(every)} rows are held out for validation: every row was "
             f"validated, the statistics below are of the {len(part)} rows trained on")
    return part


def checked_rows(args: dict, source: str | None, check_rows: Callable, findings: Findings, max_errors: int,
                 echo: Echo) -> Any:
    """The rows a node trains on, once every row its data holds passed ``check_rows(rows, map_fn, source,
    findings, max_errors)`` (which records each bad row); None after an error."""
    errors_before = findings.count()
    every = load_every_row(args["dataset"], args["split"], findings, echo)
    if every is None:
        return None
    echo(f"Validating all {len(every)} rows ...")
    check_rows(every, resolve_map_fn(args["dataset_map_fn"]), source, findings, max_errors)
    if findings.count() > errors_before:
        return None
    return load_trained_part(args["dataset"], every, args["split"], findings, echo)
