"""The suite's grouping reaches pytest-xdist (tests/conftest.py): a file with a module-scoped fixture runs
on one worker, so the fixture (a training run, a tiny model) is built once. pytest-xdist carries the group
in the node id; where a pytest release stops that (pytest 9.2 with pytest-xdist 3.8), the tests still pass
but every shared run is built once per worker, and the suite takes minutes longer: this test says so."""
from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="module")
def built_once():
    return object()


def test_a_file_with_a_module_fixture_runs_as_one_group(request, built_once):
    if os.environ.get("PYTEST_XDIST_WORKER") is None or not request.config.getoption("loadgroup", False):
        pytest.skip("the suite's grouping applies under pytest-xdist's --dist loadgroup (scripts/test.sh)")
    assert request.node.nodeid.endswith("@tests/test_xdist_groups.py"), (
        f"{request.node.nodeid}: pytest-xdist did not group this file's tests (see pyproject.toml's test extra)")
