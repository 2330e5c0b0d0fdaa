"""The package list in pyproject.toml is explicit (configs/ is mapped into the
package), so check that it names every package folder in the tree."""
from __future__ import annotations

import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def _package_folders() -> set[str]:
    found = set()
    for init in (ROOT / "sfttool").rglob("__init__.py"):
        rel = init.parent.relative_to(ROOT)
        found.add(".".join(rel.parts))
    for init in (ROOT / "configs").rglob("__init__.py"):
        rel = init.parent.relative_to(ROOT / "configs")
        found.add(".".join(("sfttool", "configs") + rel.parts))
    return {p for p in found if "__pycache__" not in p}


def test_pyproject_lists_every_package():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    assert _package_folders() == listed


def test_console_script_points_at_cli():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"sfttool": "sfttool.cli.main:cli"}
