"""`sfttool.registry.build`: every way a config can name a type, nesting, and
errors that say which key failed."""
from __future__ import annotations

import collections
import datetime
import textwrap

import pytest

from sfttool.registry import BUILDER, MAP_FUNC, ConfigBuildError, build, build_if_config, resolve_type


class Box:
    """Records what it was built with, to check nesting order."""

    def __init__(self, content=None, size=1):
        self.content, self.size = content, size


def make_pair(left, right=0):
    return (left, right)


@pytest.fixture(scope="module", autouse=True)
def registered():
    BUILDER.register_module(name="TestRegistryBox", module=Box, force=True)
    MAP_FUNC.register_module(name="test_registry_pair_fn", module=make_pair, force=True)
    yield
    BUILDER.module_dict.pop("TestRegistryBox", None)
    MAP_FUNC.module_dict.pop("test_registry_pair_fn", None)


def test_type_may_be_a_class_a_function_a_registered_name_or_a_dotted_path():
    assert build(dict(type=Box, size=3)).size == 3
    assert build(dict(type=make_pair, left=1, right=2)) == (1, 2)
    assert build(dict(type="TestRegistryBox", size=4)).size == 4
    assert build(dict(type="test_registry_pair_fn", left=5)) == (5, 0)
    assert build(dict(type="datetime.timedelta", minutes=2)) == datetime.timedelta(minutes=2)
    # 'module.Class.method': a classmethod named by its dotted path.
    assert build(dict(type="collections.OrderedDict.fromkeys", iterable="ab")) == \
        collections.OrderedDict(a=None, b=None)


def test_nested_typed_dicts_are_built_depth_first():
    cfg = dict(type=Box, content=dict(type=Box, content=dict(type="datetime.timedelta", seconds=1)))
    outer = build(cfg)
    assert isinstance(outer.content, Box) and outer.content.content == datetime.timedelta(seconds=1)


def test_plain_dicts_and_lists_are_walked_and_their_typed_children_built():
    cfg = dict(hooks=[dict(type=Box, size=1), dict(type=Box, size=2)], plain=dict(a=1),
               pair=(dict(type=make_pair, left=1), 7))
    built = build(cfg)
    assert [h.size for h in built["hooks"]] == [1, 2]
    assert built["plain"] == {"a": 1} and built["pair"] == ((1, 0), 7)


def test_default_args_fill_only_missing_top_level_arguments():
    assert build(dict(type=Box), size=9).size == 9
    assert build(dict(type=Box, size=2), size=9).size == 2


def test_build_does_not_mutate_the_config():
    cfg = dict(type=Box, content=dict(type=Box))
    build(cfg)
    assert cfg == dict(type=Box, content=dict(type=Box))


def test_build_if_config_builds_configs_and_passes_objects_through():
    box = Box()
    assert build_if_config(box) is box
    assert build_if_config({"a": 1}) == {"a": 1}
    assert isinstance(build_if_config(dict(type=Box)), Box)


def test_unknown_name_error_names_the_key_path_and_close_matches():
    with pytest.raises(ConfigBuildError) as info:
        build(dict(model=dict(type=Box, content=dict(type="TestRegistryBx"))), "cfg")
    message = str(info.value)
    assert message.startswith("cfg.model.content.type: unknown type 'TestRegistryBx'")
    assert "did you mean TestRegistryBox" in message


def test_unimportable_dotted_path_names_the_key():
    with pytest.raises(ConfigBuildError, match=r"^model\.llm\.content\.type: cannot import 'transformers\.NoSuchModel'"):
        build(dict(type=Box, content=dict(type="transformers.NoSuchModel")), "model.llm")


def test_wrong_argument_names_the_key_and_the_callable():
    with pytest.raises(ConfigBuildError) as info:
        build(dict(hooks=[dict(type=Box), dict(type=Box, colour="red")]), "cfg")
    message = str(info.value)
    assert message.startswith("cfg.hooks[1]: building Box failed:")
    assert "colour" in message


def test_type_that_is_not_callable_or_a_name_is_refused():
    with pytest.raises(ConfigBuildError, match=r"^x\.type: `type` must be a class, a function or a name"):
        resolve_type(3, "x.type")


def test_cfg_options_reach_built_objects(tmp_path):
    from sfttool.config import load_config

    path = tmp_path / "cfg.py"
    path.write_text(textwrap.dedent("""
        from datetime import timedelta
        from collections import OrderedDict
        wait = dict(type=timedelta, seconds=5)
        table = dict(type=OrderedDict, inner=dict(type=timedelta, minutes=1))
        """))
    cfg = load_config(str(path), ["wait.seconds=30", "table.inner.minutes=3", "table.extra=[1,2]"])
    assert build(cfg.wait, "wait") == datetime.timedelta(seconds=30)
    table = build(cfg.table, "table")
    assert table == collections.OrderedDict(inner=datetime.timedelta(minutes=3), extra=[1, 2])


def test_cfg_options_reach_a_built_in_config_object():
    from peft import LoraConfig

    from sfttool.config import load_config

    cfg = load_config("phi3_mini_4k_instruct_lora_alpaca_e3", ["model.lora.r=4", "model.lora.lora_dropout=0.0"])
    lora = build(cfg.model.lora, "model.lora")
    assert isinstance(lora, LoraConfig) and (lora.r, lora.lora_dropout) == (4, 0.0)


def test_an_unreadable_model_path_is_a_build_error_naming_the_key(tmp_path):
    from transformers import AutoTokenizer

    from sfttool.registry import ConfigBuildError, build

    missing = str(tmp_path / "no_such_model")
    cfg = dict(type=dict, tokenizer=dict(type=AutoTokenizer.from_pretrained, pretrained_model_name_or_path=missing))
    with pytest.raises(ConfigBuildError) as info:
        build(cfg, "train_dataloader.dataset")
    message = str(info.value)
    assert message.startswith("train_dataloader.dataset.tokenizer: building")
    assert missing in message and "local copy" in message
