"""Finding and loading configs: names and paths, read_base inheritance,
--cfg-options, and errors that name the file."""
from __future__ import annotations

import textwrap

import pytest

from sfttool.config import ConfigError, builtin_config_dir, find_config, load_config, validate_config
from sfttool.config.loader import parse_cfg_options


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture
def family(tmp_path):
    """A base and a child in pure-Python style, the way built-in configs are laid out."""
    _write(tmp_path / "cfgs" / "_base_" / "common.py", """
        from datetime import timedelta
        lr = 1e-4
        schedule = dict(type=timedelta, seconds=10)
        hooks = dict(timer=dict(type=timedelta, minutes=1), log=dict(interval=10))
        """)
    return _write(tmp_path / "cfgs" / "child.py", """
        from mmengine.config import read_base
        with read_base():
            from ._base_.common import *
        lr = 2e-4                      # replaces the base value
        hooks = dict(**hooks, ckpt=dict(interval=500))
        model = dict(name='m', lr=lr)
        """)


def test_a_path_with_a_folder_never_falls_back_to_a_builtin(tmp_path):
    name = "qwen2_5_7b_instruct_qlora_alpaca_e3.py"
    with pytest.raises(ConfigError, match=r"my_edits/qwen2_5_7b_instruct_qlora_alpaca_e3.py: no such config file$"):
        find_config(str(tmp_path / "my_edits" / name))
    with pytest.raises(ConfigError, match=r"^\./qwen2_5_7b_instruct_qlora_alpaca_e3.py: no such config file$"):
        find_config(f"./{name}")


def test_find_config_by_name_by_name_with_suffix_and_by_path(tmp_path):
    name = "qwen2_5_7b_instruct_qlora_alpaca_e3"
    expected = builtin_config_dir() / f"{name}.py"
    assert find_config(name) == expected
    assert find_config(f"{name}.py") == expected
    local = _write(tmp_path / "mine.py", "x = 1\n")
    assert find_config(str(local)) == local.resolve()


def test_a_local_file_wins_over_a_builtin_of_the_same_name(tmp_path, monkeypatch):
    name = "qwen2_5_7b_instruct_qlora_alpaca_e3.py"
    _write(tmp_path / name, "x = 1\n")
    monkeypatch.chdir(tmp_path)
    assert find_config(name) == (tmp_path / name).resolve()


def test_unknown_name_lists_close_matches():
    with pytest.raises(ConfigError) as info:
        find_config("qwen2_5_7b_instruct_qlora_alpca_e3")
    message = str(info.value)
    assert message.startswith("qwen2_5_7b_instruct_qlora_alpca_e3: no such config")
    assert "Close matches: qwen2_5_7b_instruct_qlora_alpaca_e3" in message


def test_a_substring_of_names_lists_them_as_matches():
    with pytest.raises(ConfigError, match="Close matches: .*gemma2_9b_it"):
        find_config("gemma2")


def test_non_python_file_is_refused(tmp_path):
    bad = _write(tmp_path / "cfg.yaml", "a: 1\n")
    with pytest.raises(ConfigError, match=r"cfg\.yaml: a config must be a Python file"):
        find_config(str(bad))


def test_inheritance_from_another_working_directory(family, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path.parent)
    cfg = load_config(str(family))
    assert cfg.lr == 2e-4 and cfg.model.lr == 2e-4
    assert set(cfg.hooks) == {"timer", "log", "ckpt"}
    assert cfg.schedule.seconds == 10


def test_cfg_options_override_nested_keys_lists_and_literals(family):
    cfg = load_config(str(family), ["model.lr=0.5", "hooks.log.interval=1", "model.extra=[1,2]",
                                    "model.name=other", "model.flag=True"])
    assert cfg.model.lr == 0.5 and cfg.hooks.log.interval == 1
    assert cfg.model.extra == [1, 2] and cfg.model.name == "other" and cfg.model.flag is True
    assert cfg.lr == 2e-4  # only the named key changes


def test_parse_cfg_options_rejects_an_item_without_equals():
    assert parse_cfg_options(["a.b=1", "c=x"]) == {"a.b": 1, "c": "x"}
    for item in ("lr", "=5", "a..b=1"):
        with pytest.raises(ConfigError, match=f"--cfg-options '{item}': expected KEY=VALUE"):
            parse_cfg_options([item])
    with pytest.raises(ConfigError, match=r"--cfg-options 'a=\[1,2': cannot parse the value"):
        parse_cfg_options(["a=[1,2"])


def test_syntax_error_names_the_file_and_line(tmp_path):
    bad = _write(tmp_path / "bad.py", "model = dict(\nlr = 1\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(bad))
    assert str(bad) in str(info.value) and "syntax error" in str(info.value)


def test_syntax_error_in_a_base_names_the_base(family):
    base = family.parent / "_base_" / "common.py"
    base.write_text("lr = (\n")
    with pytest.raises(ConfigError, match=r"_base_/common\.py:\d+: syntax error"):
        load_config(str(family))


def test_undefined_name_names_the_file(tmp_path):
    bad = _write(tmp_path / "undefined.py", "model = dict(lr=learning_rate)\n")
    with pytest.raises(ConfigError, match=r"undefined\.py: the config failed to load: NameError"):
        load_config(str(bad))


def test_missing_base_file_names_the_config(tmp_path):
    bad = _write(tmp_path / "orphan.py", """
        from mmengine.config import read_base
        with read_base():
            from ._base_.nowhere import *
        """)
    with pytest.raises(ConfigError, match=r"orphan\.py: the config failed to load: .*nowhere\.py not found"):
        load_config(str(bad))


def test_missing_required_keys_are_all_reported_with_the_file(tmp_path):
    path = _write(tmp_path / "partial.py", "train_cfg = dict(max_epochs=1)\n")
    errors = validate_config(load_config(str(path)), str(path))
    assert [e.split("`")[1] for e in errors] == ["model", "train_dataloader", "optim_wrapper"]
    assert all(e.startswith(f"{path}: missing") for e in errors)


def test_absolute_base_import_of_the_builtin_bases(tmp_path, monkeypatch):
    """`from sfttool.configs._base_...` works in an editable checkout too (the
    non-editable case is covered in test_builtin_configs)."""
    _write(tmp_path / "mine.py", """
        from mmengine.config import read_base
        with read_base():
            from sfttool.configs._base_.peft import *
            from sfttool.configs._base_.runtime import *
        model = dict(lora=lora_config)
        """)
    monkeypatch.chdir(tmp_path)
    cfg = load_config("mine.py", ["model.lora.r=4"])
    assert cfg.model.lora.r == 4 and cfg.lora_config.r == 64
    assert cfg.log_processor == dict(by_epoch=False)


def test_absolute_import_of_a_missing_base_is_a_clear_error(tmp_path):
    mine = _write(tmp_path / "mine.py", """
        from mmengine.config import read_base
        with read_base():
            from sfttool.configs._base_.no_such_base import *
        """)
    with pytest.raises(ConfigError, match=r"mine\.py: the config failed to load: .*no_such_base\.py not found"):
        load_config(str(mine))


def load_error(path, text: str) -> str:
    """The ConfigError's message for a config file holding ``text``."""
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    return str(info.value)


def test_misspelt_import_is_reported_at_load_with_file_and_line(tmp_path):
    # mmengine defers a config's imports; the loader resolves them so the typo
    # surfaces here, not as a traceback from inside a build.
    path = tmp_path / "typo.py"
    message = load_error(path, "from transformers import AutoModelForCausalLMX\n"
                               "model = dict(type=AutoModelForCausalLMX)\n")
    assert str(path) in message and "AutoModelForCausalLMX" in message and "line 1" in message


@pytest.mark.parametrize("old, typo, option", [
    ("prompt_template = PROMPT_TEMPLATE.qwen_chat", "prompt_template = PROMPT_TEMPLATE.qwen_chatt",
     "prompt_template=qwen_chatt"),
    ("dataset_map_fn = alpaca_map_fn ", "dataset_map_fn = alpaca_map_fnn ", "dataset_map_fn=alpaca_map_fnn"),
])
def test_a_misspelt_template_or_map_fn_in_the_file_gets_the_message_an_override_gets(tmp_path, old, typo,
                                                                                       option):
    """`PROMPT_TEMPLATE.qwen_chatt` written in the file said `Failed to import
    sfttool.utils.PROMPT_TEMPLATE.qwen_chatt`; given with --cfg-options it lists the valid names with the close
    match first. Both say the latter now."""
    from sfttool.dataset.resolve import resolve_map_fn, template_of
    source = (builtin_config_dir() / "qwen2_5_0_5b_instruct_lora_alpaca_e3.py").read_text()
    if "map_fn" in option:
        typo_import = "import alpaca_map_fnn, template_map_fn_factory"
        source = source.replace("import alpaca_map_fn, template_map_fn_factory", typo_import)
    path = tmp_path / "copy.py"
    path.write_text(source.replace("from ._base_", "from sfttool.configs._base_").replace(old, typo))
    line = next(i for i, text in enumerate(path.read_text().splitlines(), 1) if typo.split(" = ")[1].strip() in text)
    with pytest.raises(ConfigError) as in_file:
        load_config(path)
    overridden = load_config("qwen2_5_0_5b_instruct_lora_alpaca_e3", [option]).train_dataloader.dataset
    with pytest.raises(ValueError) as by_option:  # what train and check-custom-dataset say for the override
        resolve_map_fn(overridden.dataset_map_fn) if "map_fn" in option else template_of(overridden.template_map_fn)
    assert str(in_file.value) == f"{path}, line {line}: {by_option.value}"
    assert "valid names: " + ("alpaca_map_fn, " if "map_fn" in option else "qwen_chat, ") in str(in_file.value)


def test_a_misspelt_collate_fn_or_system_template_lists_the_names_there_are(tmp_path):
    path = tmp_path / "c.py"
    assert load_error(path, "from sfttool.dataset.collate_fns import default_colate_fn\n"
                            "train_dataloader = dict(collate_fn=dict(type=default_colate_fn))\n") == (
        f"{path}, line 1: sfttool.dataset.collate_fns has no 'default_colate_fn'; valid names: default_collate_fn, "
        "kto_collate_fn, prompt_collate_fn, cumulative_lengths, preference_collate_fn")
    message = load_error(path, "from sfttool.utils import SYSTEM_TEMPLATE\nsystem = 1\n\n"
                               "SYSTEM = SYSTEM_TEMPLATE.alpacca\n")
    assert message.startswith(f"{path}, line 4: sfttool.utils.SYSTEM_TEMPLATE has no 'alpacca'; valid names: alpaca, ")


def test_misspelt_arguments_of_what_the_runner_builds_are_reported_before_training():
    """mmengine builds these when training starts (the checkpoint hook passes unknown names on to the
    first save): validation names each misspelt argument with its closest match, all at once."""
    options = ["default_hooks.checkpoint.intrval=2", "train_dataloader.batch_sise=2",
               "train_dataloader.sampler.shufle=False", "optim_wrapper.optimizer.weight_decy=0.1",
               "train_cfg.max_itrs=2"]
    name = "qwen2_5_0_5b_instruct_lora_alpaca_e3"
    assert validate_config(load_config(name), "c.py") == []
    errors = validate_config(load_config(name, options), "c.py")
    assert sorted(errors) == sorted([
        "c.py: default_hooks.checkpoint.intrval: CheckpointHook takes no argument `intrval` (did you mean interval?)",
        "c.py: train_dataloader.batch_sise: DataLoader takes no argument `batch_sise` (did you mean batch_size or "
        "batch_sampler?)",
        "c.py: train_dataloader.sampler.shufle: DefaultSampler takes no argument `shufle` (did you mean shuffle?)",
        "c.py: optim_wrapper.optimizer.weight_decy: AdamW takes no argument `weight_decy` (did you mean "
        "weight_decay?)",
        "c.py: train_cfg.max_itrs: TrainLoop takes no argument `max_itrs` (did you mean max_iters?)"])
    # Names the checkpoint hook hands to Runner.save_checkpoint are accepted.
    assert validate_config(load_config(name, ["default_hooks.checkpoint.save_optimizer=False"]), "c.py") == []


def test_a_checkpoint_hook_subclass_takes_its_own_and_checkpoint_hooks_arguments():
    from mmengine.hooks import CheckpointHook

    from sfttool.config.validate import check_arguments

    class UploadingCheckpointHook(CheckpointHook):
        def __init__(self, upload_to=None, **kwargs):
            super().__init__(**kwargs)

    good = dict(type=UploadingCheckpointHook, upload_to="s3://x", interval=512, max_keep_ckpts=2, save_optimizer=True)
    assert check_arguments({"default_hooks": {"checkpoint": good}}, "c.py") == []
    bad = dict(good, intrval=3)
    assert check_arguments({"default_hooks": {"checkpoint": bad}}, "c.py") == [
        "c.py: default_hooks.checkpoint.intrval: UploadingCheckpointHook takes no argument `intrval` (did you mean "
        "interval?)"]


def test_keys_read_by_the_runner_or_the_tools_may_be_overridden():
    """experiment_name is read by the train entry; tokenizer by convert (training uses its copies, so the
    override is allowed with a warning naming them)."""
    name = "demo_smollm2_135m_lora_self_identity_e3"
    assert load_config(name, ["experiment_name='mine'"]).experiment_name == "mine"
    cfg = load_config(name, ["tokenizer.padding_side='left'"])
    assert cfg.tokenizer.padding_side == "left"


def test_the_config_text_is_formatted_once_per_text():
    """mmengine formats the whole config with yapf on every `pretty_text` (the log, each dump, each
    checkpoint): the same text is formatted once, and the result is what yapf writes."""
    from mmengine.config import Config

    from sfttool import compat

    compat.apply_all()
    compat._yapf_format.cache_clear()
    cfg = Config(dict(a=1, b=[1, 2], c=dict(type="x", d="y")))
    assert cfg.pretty_text == "a = 1\nb = [\n    1,\n    2,\n]\nc = dict(d='y', type='x')\n"
    assert cfg.pretty_text == "a = 1\nb = [\n    1,\n    2,\n]\nc = dict(d='y', type='x')\n"
    assert compat._yapf_format.cache_info()[:2] == (1, 1)  # (hits, misses)
    cfg.b = [3]
    assert cfg.pretty_text == "a = 1\nb = [\n    3,\n]\nc = dict(d='y', type='x')\n"  # a changed config: formatted anew
    assert compat._yapf_format.cache_info()[:2] == (1, 2)
