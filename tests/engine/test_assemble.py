"""How the runner's hooks are built from the config (``engine.assemble``)."""
from __future__ import annotations

import pytest

from sfttool.engine.assemble import _build_hook
from sfttool.engine.hooks import ThroughputHook
from sfttool.registry import ConfigBuildError


def test_a_name_only_mmengine_knows_is_left_to_mmengine_and_an_unknown_one_is_named():
    assert _build_hook(dict(type="LoggerHook", interval=5), "default_hooks.logger") == dict(type="LoggerHook",
                                                                                            interval=5)
    assert isinstance(_build_hook(dict(type="ThroughputHook"), "custom_hooks[0]"), ThroughputHook)
    with pytest.raises(ConfigBuildError, match=r"^custom_hooks\[1\]\.type: unknown type 'ThroughputHok': not "
                                               r"registered .*did you mean ThroughputHook\?$"):
        _build_hook(dict(type="ThroughputHok"), "custom_hooks[1]")


def test_a_priority_is_the_runners_not_the_hooks_argument():
    hook = _build_hook(dict(type=ThroughputHook, priority="LOW"), "custom_hooks[0]")
    assert isinstance(hook, ThroughputHook) and hook.priority == 70
