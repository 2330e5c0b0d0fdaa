"""The launch plan from ``--nproc-per-node`` and XTuner's environment variables:
every bad value is one ValueError naming the variable and what it should be."""
from __future__ import annotations

import pytest

from sfttool.engine.launch import plan_from_env

VARIABLES = ("NPROC_PER_NODE", "NNODES", "NODE_RANK", "ADDR", "PORT", "LOCAL_RANK")


@pytest.fixture
def env(monkeypatch):
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)

    def set_env(**values):
        for name, value in values.items():
            monkeypatch.setenv(name, value)
    return set_env


def test_defaults_are_one_local_process(env):
    plan = plan_from_env()
    assert (plan.nproc_per_node, plan.nnodes, plan.node_rank, plan.addr, plan.port) == (1, 1, 0, "127.0.0.1", None)


def test_a_valid_two_machine_plan(env):
    env(NPROC_PER_NODE="8", NNODES="2", NODE_RANK="1", ADDR="10.0.0.1", PORT="65535")
    plan = plan_from_env()
    assert (plan.world_size, plan.node_rank, plan.addr, plan.port) == (16, 1, "10.0.0.1", 65535)


@pytest.mark.parametrize("values, message", [
    (dict(NPROC_PER_NODE="0"),
     "environment variable NPROC_PER_NODE='0': expected at least 1 (processes on this machine)"),
    (dict(NPROC_PER_NODE="two"), "environment variable NPROC_PER_NODE='two': expected an integer"),
    (dict(NNODES="0"), "environment variable NNODES='0': expected at least 1 (machines in the job)"),
    (dict(NODE_RANK="1"),
     "environment variable NODE_RANK='1': expected this machine's index among NNODES=1, from 0 to 0"),
    (dict(NODE_RANK="-1", NNODES="2", ADDR="10.0.0.1"),
     "environment variable NODE_RANK='-1': expected this machine's index among NNODES=2, from 0 to 1"),
    (dict(NODE_RANK="2", NNODES="2", ADDR="10.0.0.1"),
     "environment variable NODE_RANK='2': expected this machine's index among NNODES=2, from 0 to 1"),
    (dict(PORT="abc"), "environment variable PORT='abc': expected an integer"),
    (dict(PORT="99999"), "environment variable PORT='99999': expected a TCP port from 1 to 65535"),
    (dict(PORT="0"), "environment variable PORT='0': expected a TCP port from 1 to 65535"),
    (dict(NNODES="2", NODE_RANK="1"),
     "environment variable ADDR is unset but NNODES=2: set ADDR to the address of the NODE_RANK=0 machine, "
     "the same on every machine"),
])
def test_a_bad_variable_is_named_with_the_fix(env, values, message):
    env(**values)
    with pytest.raises(ValueError) as err:
        plan_from_env()
    assert str(err.value) == message


def test_the_flag_is_named_when_the_value_came_from_it(env):
    env(NPROC_PER_NODE="4")
    with pytest.raises(ValueError) as err:
        plan_from_env(nproc_per_node=0)
    assert str(err.value) == "--nproc-per-node must be at least 1, got 0"
    env(NPROC_PER_NODE="abc")  # the flag wins, so the environment is not read
    assert plan_from_env(nproc_per_node=2).nproc_per_node == 2


def test_every_bad_variable_is_reported_at_once(env):
    env(NPROC_PER_NODE="0", NNODES="x", PORT="70000")
    with pytest.raises(ValueError) as err:
        plan_from_env()
    assert str(err.value) == ("environment variable NPROC_PER_NODE='0': expected at least 1 (processes on this "
                              "machine); environment variable NNODES='x': expected an integer; "
                              "environment variable PORT='70000': expected a TCP port from 1 to 65535")


def test_a_worker_needs_no_addr(env):
    """Inside torchrun (or the user's own launcher) the plan only decides not to launch again."""
    env(NNODES="2", NODE_RANK="1", LOCAL_RANK="0")
    assert plan_from_env().nnodes == 2
