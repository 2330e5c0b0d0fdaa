"""Every ``>>>`` example in sfttool's docstrings runs and prints what it shows. Illustrations that need a
model, a run or files are marked ``# doctest: +SKIP``."""
from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import sfttool

MODULES = sorted(info.name for info in pkgutil.walk_packages(sfttool.__path__, "sfttool."))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run_as_shown(name, capsys):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, capsys.readouterr().out


def test_every_module_is_found():
    assert {"sfttool.dataset.encode", "sfttool.cli.main", "sfttool.dataset.map_fns.alpaca_map_fn"} <= set(MODULES)
