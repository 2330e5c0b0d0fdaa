"""What ``check-custom-dataset`` found: errors and warnings, echoed as they are found and counted
for the summary line. Shared by the SFT check (``check_dataset``) and the preference, KTO and prompt checks.

    >>> findings = Findings(print)
    >>> collect_row_errors(rows, check, findings, max_errors=10)     # doctest: +SKIP
    ERROR: data.jsonl, row 4, field 'conversation[0].output': expected a string, got missing; ...
    >>> finish(findings, print)                                       # doctest: +SKIP
    FAILED: 1 errors, 0 warnings
"""
from __future__ import annotations

from typing import Any, Callable

from sfttool.dataset.errors import ROW_COLUMN, DatasetError
from sfttool.dataset.stages import SafeMapFn

Echo = Callable[[str], None]


class Findings:
    """Errors and warnings collected while checking. ``errors`` holds the listed messages;
    ``unlisted`` counts the row errors found beyond ``--max-errors`` (counted, not listed)."""

    def __init__(self, echo: Echo):
        self.echo, self.errors, self.warnings, self.unlisted = echo, [], [], 0

    def error(self, message: str) -> None:
        self.errors.append(message)
        self.echo(f"ERROR: {message}")

    def warn(self, message: str) -> None:
        self.warnings.append(message)
        self.echo(f"WARNING: {message}")

    def count(self) -> int:
        """Every error found, listed or not."""
        return len(self.errors) + self.unlisted


def collect_row_errors(rows, check: Callable[[dict, int], Any], findings: Findings, max_errors: int) -> None:
    """``check(row, number)`` on every row, ``number`` being the row's index in the loaded data
    (``ROW_COLUMN`` where the rows carry it: a held-out split or a subset keeps the file's numbers).
    The first ``max_errors`` DatasetErrors are listed, the rest counted."""
    found = 0
    for index, row in enumerate(rows):
        try:
            check(row, row.get(ROW_COLUMN, index))
        except DatasetError as exc:
            found += 1
            if found <= max_errors:
                findings.error(str(exc))
    if found > max_errors:
        findings.unlisted += found - max_errors
        findings.echo(f"... and {found - max_errors} more rows with errors (--max-errors {max_errors}: "
                      "raise it to list them)")


def collect_mapped_row_errors(rows, map_fn: Callable | None, source: str | None, check: Callable[[dict, int], Any],
                              findings: Findings, max_errors: int) -> None:
    """``collect_row_errors`` of ``check(row, number)`` on each row as ``map_fn`` returns it (a map fn that
    fails is that row's error, named as in training: ``SafeMapFn``), or without a map fn as loaded, less
    ``ROW_COLUMN``. The row checks of the preference, KTO and prompt configs."""
    safe = SafeMapFn(map_fn, source) if map_fn is not None else None

    def mapped_check(row: dict, index: int) -> Any:
        return check(safe(row, index) if safe else {k: v for k, v in row.items() if k != ROW_COLUMN}, index)

    collect_row_errors(rows, mapped_check, findings, max_errors)


def guard(findings: Findings, fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """``fn(...)``, or None with its DatasetError recorded as an error."""
    try:
        return fn(*args, **kwargs)
    except DatasetError as exc:
        findings.error(str(exc))
        return None


def finish(findings: Findings, echo: Echo) -> int:
    """The summary line; the exit code (0: no errors, 1: errors). Every row with an error is counted,
    and the line says how many were listed when not all were."""
    total = findings.count()
    listed = f" ({len(findings.errors)} listed)" if findings.unlisted else ""
    echo(f"\n{'FAILED' if total else 'OK'}: {total} errors{listed}, {len(findings.warnings)} warnings")
    return 1 if total else 0
