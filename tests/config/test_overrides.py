"""--cfg-options NAME=VALUE re-runs the config with that assignment replaced, so everything computed
from a PART 1 setting follows; dotted keys edit the loaded config as in mmengine."""
from __future__ import annotations

import textwrap

import pytest
import torch
from click.testing import CliRunner

from sfttool.cli.main import cli
from sfttool.config import ConfigError, load_config
from sfttool.config.settings import SETTINGS

QLORA = "qwen2_5_7b_instruct_qlora_alpaca_e3"   # imports _base_/peft.py and _base_/runtime.py


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture(scope="module")
def copied(tmp_path_factory):
    """A built-in config copied by `sfttool copy-cfg`, with its `_base_` parts."""
    out = tmp_path_factory.mktemp("copy")
    result = CliRunner().invoke(cli, ["copy-cfg", QLORA, str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return out / f"{QLORA}_copy.py"


def _iteration_bounds(cfg, iterations_per_epoch: int) -> list[tuple[int, int]]:
    """The schedulers' [begin, end) in iterations, as mmengine's runner converts them."""
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=cfg.optim_wrapper.optimizer.lr)
    bounds = []
    for node in cfg.param_scheduler:
        args = {k: v for k, v in node.items() if k not in ("type", "convert_to_iter_based")}
        scheduler = node["type"].build_iter_from_epoch(optimizer, epoch_length=iterations_per_epoch, **args)
        bounds.append((scheduler.begin, scheduler.end))
    return bounds


def _values_of(node, key: str, path: str = "") -> dict[str, object]:
    """Every ``key`` anywhere in the config: ``{'model.llm.pretrained_model_name_or_path': ...}``."""
    found = {}
    if isinstance(node, dict):
        for k in node.keys():
            child = dict.__getitem__(node, k)
            here = f"{path}.{k}" if path else str(k)
            if k == key:
                found[here] = child
            found.update(_values_of(child, key, here))
    elif isinstance(node, (list, tuple)):
        for i, item in enumerate(node):
            found.update(_values_of(item, key, f"{path}.{i}"))
    return found


def test_each_part1_setting_reaches_what_is_built(copied):
    base = load_config(copied)
    assert _iteration_bounds(base, 100) == [(0, 9), (9, 300)]  # 3% of 3 epochs of 100 iterations
    cfg = load_config(copied, ["lr=1e-4", "max_epochs=1", "pretrained_model_name_or_path=/models/mine",
                               "max_length=64", "batch_size=2", "accumulative_counts=4", "seed=7",
                               "evaluation_inputs=['hi','bye']"])
    assert cfg.optim_wrapper.optimizer.lr == 1e-4
    assert _iteration_bounds(cfg, 100) == [(0, 3), (3, 100)]
    assert cfg.train_cfg.max_epochs == 1
    paths = _values_of(cfg._cfg_dict, "pretrained_model_name_or_path")
    assert sorted(paths) == ["custom_hooks.0.tokenizer.pretrained_model_name_or_path",
                             "custom_hooks.1.tokenizer.pretrained_model_name_or_path",
                             "model.llm.pretrained_model_name_or_path",
                             "pretrained_model_name_or_path",
                             "tokenizer.pretrained_model_name_or_path",
                             "train_dataloader.dataset.tokenizer.pretrained_model_name_or_path",
                             "train_dataset.tokenizer.pretrained_model_name_or_path",
                             "val_dataloader.dataset.tokenizer.pretrained_model_name_or_path"]
    assert set(paths.values()) == {"/models/mine"}
    assert cfg.train_dataloader.dataset.max_length == 64 and cfg.val_dataloader.dataset.max_length == 64
    assert cfg.train_dataloader.batch_size == 2 and cfg.optim_wrapper.accumulative_counts == 4
    assert cfg.randomness.seed == 7 and cfg.train_dataloader.sampler.seed == 7
    assert cfg.train_dataloader.dataset.seed == 7
    assert cfg.custom_hooks[1].evaluation_inputs == ["hi", "bye"]


def test_a_name_from_a_read_base_part_is_replaced_where_it_is_assigned(copied):
    """`log_level` is assigned in the copy's _base_/runtime.py only."""
    cfg = load_config(copied, ["log_level='DEBUG'"])
    assert cfg.log_level == "DEBUG"
    assert load_config(copied).log_level == "INFO"


@pytest.fixture
def family(tmp_path):
    """Names set and used in a base, reassigned in the config, and used in both."""
    _write(tmp_path / "cfgs" / "_base_" / "common.py", """
        from datetime import timedelta
        max_epochs = 3
        warmup = dict(type=timedelta, days=max_epochs * 0.1)   # computed in the base
        interval = 10
        hooks = dict(log=dict(interval=interval))
        """)
    return _write(tmp_path / "cfgs" / "child.py", """
        from mmengine.config import read_base
        with read_base():
            from ._base_.common import *
        lr = 2e-4
        interval = 5                   # replaces the base value; the base's hooks keep 10
        model = dict(lr=lr, epochs=max_epochs, interval=interval)
        """)


def test_a_base_name_recomputes_the_base_and_the_config(family):
    cfg = load_config(family, ["max_epochs=10"])
    assert cfg.warmup.days == 1.0 and cfg.model.epochs == 10 and cfg.max_epochs == 10


def test_the_assignment_that_decides_the_value_is_the_one_replaced(family):
    """As in Python, the config's own `interval = 5` wins over the base's, so that is what an
    override replaces; the base's dict was computed from the base's value and keeps it."""
    cfg = load_config(family, ["interval=1", "lr=0.5"])
    assert cfg.model.interval == 1 and cfg.interval == 1 and cfg.model.lr == 0.5
    assert cfg.hooks.log.interval == 10


def test_the_dumped_config_holds_the_overridden_values(copied, tmp_path):
    """The run dumps its config to the work dir; --resume, convert and chat read that file."""
    cfg = load_config(copied, ["lr=3e-5", "max_length=96", "pretrained_model_name_or_path=/models/mine"])
    dumped = tmp_path / "dumped.py"
    cfg.dump(str(dumped))
    again = load_config(dumped)
    assert again.optim_wrapper.optimizer.lr == 3e-5 and again.train_dataloader.dataset.max_length == 96
    assert again.model.llm.pretrained_model_name_or_path == "/models/mine"
    assert again.tokenizer.pretrained_model_name_or_path == "/models/mine"


def test_a_name_read_by_nothing_afterwards_is_refused(copied, tmp_path):
    """A dumped config holds values, not names: overriding `lr` there would change only `lr`."""
    dumped = tmp_path / "dumped.py"
    load_config(copied).dump(str(dumped))
    with pytest.raises(ConfigError, match=r"dumped\.py: --cfg-options lr: the config sets `lr` \(dumped\.py:\d+\) "
                                          r"but nothing in it reads the name afterwards"):
        load_config(dumped, ["lr=1e-4"])
    assert load_config(dumped, ["optim_wrapper.optimizer.lr=1e-4"]).optim_wrapper.optimizer.lr == 1e-4
    assert load_config(dumped, ["seed=3"]).seed == 3  # read by the train entry itself


def test_an_unknown_name_is_one_line_with_close_matches(copied):
    with pytest.raises(ConfigError, match=r"_copy\.py: --cfg-options max_lenght: the config has no setting "
                                          r"`max_lenght` \(did you mean max_length or pack_to_max_length or "
                                          r"max_epochs\?\); a new name would be read by nothing$"):
        load_config(copied, ["max_lenght=32"])
    assert load_config(copied, ["work_dir='w'"]).work_dir == "w"  # read by the runner: may be added


def test_a_dotted_key_into_a_dict_training_only_copies_is_refused_with_the_keys_it_reads(copied):
    cases = {"train_dataset.max_length=8": "train_dataloader.dataset.max_length$",
             "lora_config.r=8": "model.lora.r$",
             "base_hooks.logger.interval=1": "default_hooks.logger.interval$"}
    for option, keys in cases.items():
        with pytest.raises(ConfigError, match=r"copied `\w+` into the dicts it builds, .* instead: " + keys):
            load_config(copied, [option])
    cfg = load_config(copied, ["train_dataloader.dataset.max_length=8", "model.lora.r=8"])
    assert cfg.train_dataloader.dataset.max_length == 8 and cfg.model.lora.r == 8


def test_a_plain_file_without_imports_is_rerun_too(tmp_path):
    path = _write(tmp_path / "c.py", """
        lr = 2e-4
        optim_wrapper = dict(optimizer=dict(type='torch.optim.AdamW', lr=lr))
        """)
    assert load_config(path, ["lr=1e-4"]).optim_wrapper.optimizer.lr == 1e-4


def test_an_old_style_config_keeps_mmengines_merge(tmp_path):
    """`_base_ = [...]` configs: every key edits the merged result, as mmengine does."""
    _write(tmp_path / "base.py", "lr = 1\nopt = dict(lr=lr)\n")
    path = _write(tmp_path / "old.py", "_base_ = ['./base.py']\nepochs = 2\n")
    cfg = load_config(path, ["lr=5", "opt.lr=3"])
    assert cfg.lr == 5 and cfg.opt.lr == 3


def test_overridden_settings_reach_the_built_objects(copied, tiny_qwen2_dir, tiny_sft_jsonl):
    """Built, not only loaded: the optimizer's lr, the tokenizer every part loads, the data and its map fn
    (the file is in the standard format already), max_length."""
    from sfttool.registry import build
    cfg = load_config(copied, [f"pretrained_model_name_or_path={tiny_qwen2_dir}", f"data_path={tiny_sft_jsonl}",
                               "dataset_map_fn=None", "max_length=48", "lr=3e-5", "train_dataloader.dataset.map_num_proc=1"])
    optimizer = build(dict(cfg.optim_wrapper.optimizer, params=[torch.nn.Parameter(torch.zeros(1))]))
    assert optimizer.defaults["lr"] == 3e-5
    for key in ("tokenizer", "custom_hooks.1.tokenizer"):
        node = cfg.tokenizer if key == "tokenizer" else cfg.custom_hooks[1].tokenizer
        assert build(node, key).name_or_path == str(tiny_qwen2_dir)
    dataset = build(cfg.train_dataloader.dataset, "train_dataloader.dataset")
    lengths = [len(row["input_ids"]) for row in dataset]
    # val_ratio=0.02 holds one of the 64 rows out for validation, through the same pipeline
    held_out = build(cfg.val_dataloader.dataset, "val_dataloader.dataset")
    assert max(lengths) <= 48 and sum(len(row["sample_lengths"]) for row in dataset) == 63
    assert sum(len(row["sample_lengths"]) for row in held_out) == 1


def test_an_object_from_python_code_sets_a_key_the_runner_reads(tmp_path):
    """`load_config(..., {'custom_hooks': [...]})` from Python may pass objects that are no literal."""
    from datetime import timedelta
    path = _write(tmp_path / "c.py", """
        from datetime import timedelta
        lr = 1.0
        model = dict(lr=lr)
        custom_hooks = []
        """)
    cfg = load_config(path, {"custom_hooks": [dict(type=timedelta, days=1)], "lr": 0.5})
    assert cfg.custom_hooks == [dict(type=timedelta, days=1)] and cfg.model.lr == 0.5
    with pytest.raises(ConfigError, match=r"--cfg-options lr: datetime.timedelta\(days=1\) is not a Python literal"):
        load_config(path, {"lr": timedelta(days=1)})


def test_a_dotted_tokenizer_key_warns_with_the_copies_training_reads(copied):
    import logging

    from mmengine.logging import MMLogger

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = MMLogger.get_current_instance()
    logger.addHandler(handler)
    try:
        cfg = load_config(copied, ["tokenizer.padding_side=left"])
    finally:
        logger.removeHandler(handler)
    assert cfg.tokenizer.padding_side == "left" and cfg.train_dataloader.dataset.tokenizer.padding_side == "right"
    assert records == [
        "--cfg-options tokenizer.padding_side: the tools (convert) read `tokenizer` itself, but training uses the "
        "copies the config made of it; to change training, override custom_hooks.0.tokenizer.padding_side, "
        "custom_hooks.1.tokenizer.padding_side, train_dataloader.dataset.tokenizer.padding_side, "
        "val_dataloader.dataset.tokenizer.padding_side"]


# XTuner's configs set these in PART 1 whether or not another line reads them (sequence_parallel_size = 1).
XTUNER_STYLE_PART_1 = '''
from sfttool.engine.runner import TrainLoop
{settings}
unused = 1
max_epochs = 3                 # read by nothing below: train_cfg has its own number
model = dict(type='SupervisedFinetune')
train_cfg = dict(type=TrainLoop, max_epochs=1)
'''


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_a_part1_name_sfttool_reads_is_overridable_where_nothing_in_the_config_reads_it(tmp_path, name):
    settings = "\n".join(f"{setting} = None" for setting in SETTINGS)
    path = _write(tmp_path / "xtuner_style.py", XTUNER_STYLE_PART_1.format(settings=settings))
    cfg = load_config(path, [f"{name}=7"])
    assert cfg[name] == 7 and all(cfg[other] is None for other in SETTINGS if other != name)


def test_names_nothing_reads_are_still_refused(tmp_path):
    settings = "\n".join(f"{setting} = None" for setting in SETTINGS)
    path = _write(tmp_path / "xtuner_style.py", XTUNER_STYLE_PART_1.format(settings=settings))
    for name in ("unused", "max_epochs"):
        with pytest.raises(ConfigError, match=rf"--cfg-options {name}: the config sets `{name}` \(xtuner_style\.py:\d+\) "
                                              "but nothing in it reads the name afterwards"):
            load_config(path, [f"{name}=2"])


def test_a_setting_the_config_lacks_may_be_added(tmp_path):
    path = _write(tmp_path / "plain.py", "model = dict(type='SupervisedFinetune')\n")
    assert load_config(path, ["sequence_parallel_size=2"]).sequence_parallel_size == 2
    with pytest.raises(ConfigError, match="the config has no setting `sequence_paralel_size`"):
        load_config(path, ["sequence_paralel_size=2"])
