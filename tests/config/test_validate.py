"""Every typed node's arguments are checked against what will be called, before anything is built:
a typo is one line with its key path and the close match, all of them at once."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from sfttool.cli.main import cli
from sfttool.config import load_config, validate_config
from sfttool.config.validate import check_data_paths
from sfttool.config.arguments import accepted_arguments, check_arguments
from sfttool.registry import BUILDER

NAME = "qwen2_5_7b_instruct_qlora_alpaca_e3"
TYPOS = ["model.lora.rr=8", "model.llm.torch_dtpye=float32", "train_dataloader.dataset.max_lenght=5"]
EXPECTED = [
    "c.py: model.llm.torch_dtpye: AutoModelForCausalLM.from_pretrained takes no argument `torch_dtpye` "
    "(did you mean torch_dtype?)",
    "c.py: model.lora.rr: LoraConfig takes no argument `rr` (did you mean r?)",
    "c.py: train_dataloader.dataset.max_lenght: process_hf_dataset takes no argument `max_lenght` (did you mean "
    "max_length or pack_to_max_length?)",
]


def test_the_typos_users_make_are_all_reported_at_once():
    assert validate_config(load_config(NAME), "c.py") == []
    assert validate_config(load_config(NAME, TYPOS), "c.py") == EXPECTED


def test_every_kind_of_node_is_checked():
    options = ["model.llm.quantization_config.load_in_4bits=True", "tokenizer.padding_sid=left",
               "train_dataloader.dataset.dataset.dataset.splt=train", "train_dataloader.dataset.template_map_fn.templat=x",
               "train_dataloader.collate_fn.use_varlen_atn=True", "custom_hooks.1.max_new_token=5",
               "model.use_varlen_atn=True"]
    assert validate_config(load_config(NAME, options), "c.py") == [
        "c.py: model.use_varlen_atn: SupervisedFinetune takes no argument `use_varlen_atn` (did you mean "
        "use_varlen_attn?)",
        "c.py: model.llm.quantization_config.load_in_4bits: BitsAndBytesConfig takes no argument `load_in_4bits` "
        "(did you mean load_in_4bit or load_in_8bit?)",
        "c.py: tokenizer.padding_sid: AutoTokenizer.from_pretrained takes no argument `padding_sid` (did you mean "
        "padding_side?)",
        "c.py: train_dataloader.dataset.dataset.dataset.splt: load_data_path takes no argument `splt` (did you mean split?)",
        "c.py: train_dataloader.dataset.template_map_fn.templat: template_map_fn_factory takes no argument "
        "`templat` (did you mean template?)",
        "c.py: train_dataloader.collate_fn.use_varlen_atn: default_collate_fn takes no argument `use_varlen_atn` "
        "(did you mean use_varlen_attn?)",
        "c.py: custom_hooks.1.max_new_token: EvaluateChatHook takes no argument `max_new_token` (did you mean "
        "max_new_tokens?)"]


def test_kwargs_that_are_no_typo_pass_where_the_callable_takes_any():
    """from_pretrained hands unknown names to the model's config (rope_scaling, use_cache, ...), and
    load_dataset to its reader: only a near miss of a known name is reported there."""
    options = ["model.llm.use_cache=False", "model.llm.rope_scaling=None", "model.llm.attn_implementation=eager",
               "train_dataloader.dataset.dataset.dataset.split=train", "train_dataloader.dataset.dataset.dataset.field=rows",
               "tokenizer.model_max_length=512"]
    assert validate_config(load_config(NAME, options), "c.py") == []
    # Taken out of the node before the call: by mmengine (priority) or sfttool's non-finite loss guard.
    taken = ["custom_hooks.2.priority='LOW'", "optim_wrapper.max_consecutive_nonfinite=3"]
    assert validate_config(load_config(NAME, taken), "c.py") == []
    names, open_ended = accepted_arguments(BUILDER.get("load_data_path"))
    assert open_ended and {"path", "split", "data_files", "streaming"} <= names


def test_an_untyped_optim_wrapper_is_mmengines_default():
    cfg = {"optim_wrapper": {"optimizer": {"type": "AdamW", "lr": 1e-4}, "accumulative_count": 2}}
    assert check_arguments(cfg, "c.py") == [
        "c.py: optim_wrapper.accumulative_count: OptimWrapper takes no argument `accumulative_count` (did you mean "
        "accumulative_counts?)"]


def test_a_node_and_its_copies_report_a_typo_once():
    """`tokenizer` is copied into the dataset and two hooks: the typo is named where it was written."""
    cfg = {"tokenizer": {"type": "transformers.AutoTokenizer.from_pretrained", "padding_sid": "left"},
           "custom_hooks": [{"type": "sfttool.engine.hooks.DatasetInfoHook",
                             "tokenizer": {"type": "transformers.AutoTokenizer.from_pretrained",
                                           "padding_sid": "left"}}]}
    assert check_arguments(cfg, "c.py") == [
        "c.py: tokenizer.padding_sid: AutoTokenizer.from_pretrained takes no argument `padding_sid` (did you mean "
        "padding_side?)"]


@pytest.fixture
def recorded_loads():
    """A data loader that records its calls, registered for this test only."""
    calls = []

    def recording_loader(path):
        calls.append(path)
        raise AssertionError("the data was loaded")

    BUILDER.register_module(name="recording_loader", module=recording_loader, force=True)
    yield calls
    BUILDER.module_dict.pop("recording_loader")


def test_train_stops_at_validation_before_the_data_is_loaded(recorded_loads, tmp_path):
    work_dir = tmp_path / "work"
    result = CliRunner().invoke(cli, ["train", NAME, "--work-dir", str(work_dir), "--cfg-options",
                                      "train_dataloader.dataset.dataset.type=recording_loader", *TYPOS])
    assert result.exit_code == 1, result.output
    for line in EXPECTED:
        assert line.replace("c.py", NAME + ".py") in result.output
    assert recorded_loads == [] and not work_dir.exists()


def test_a_missing_data_file_is_reported_at_validation_naming_data_path(tiny_sft_jsonl):
    assert validate_config(load_config(NAME, [f"data_path={tiny_sft_jsonl}"]), "c.py") == []
    assert validate_config(load_config(NAME, ["data_path=/data/missing.jsonl"]), "c.py") == [
        "c.py: train_dataloader.dataset.dataset.dataset.path: data_path '/data/missing.jsonl': no such file or folder; "
        "set data_path (PART 1 of the config) to your data file, a folder or a glob, or a dataset name on the hub"]


def test_a_missing_data_file_of_an_xtuner_style_dataset_is_reported_at_validation(tmp_path, tiny_sft_jsonl):
    path = tmp_path / "c.py"
    path.write_text("from datasets import load_dataset\n"
                    f"train_dataloader = dict(dataset=dict(type=load_dataset, path='json', data_files=["
                    f"'{tiny_sft_jsonl}', 'missing.jsonl', 'parts/*.jsonl']))\n")
    assert check_data_paths(load_config(path), "c.py") == [
        "c.py: train_dataloader.dataset.data_files: no such file 'missing.jsonl'; set data_files to your data "
        "file (a path relative to the folder you run from, or absolute)"]


def test_dicts_unpacked_into_a_known_function_are_checked():
    """Issue: `optim_wrapper.clip_grad.max_nrom` failed with a 69-line torch traceback at the first optimizer
    step, after the data and the model were built. Each dict mmengine unpacks into a call, or reads keys from."""
    options = ["optim_wrapper.clip_grad.max_nrom=1", "randomness.seedd=1", "log_processor.by_epochh=False",
               "env_cfg.mp_cfg.mp_start_methd=fork", "env_cfg.dist_cfg.backendd=gloo", "env_cfg.cudnn_benchmrk=True"]
    assert validate_config(load_config(NAME, options), "c.py") == [
        "c.py: optim_wrapper.clip_grad.max_nrom: clip_grad_norm_ takes no argument `max_nrom` (did you mean max_norm?)",
        "c.py: randomness.seedd: set_randomness takes no argument `seedd` (did you mean seed?)",
        "c.py: log_processor.by_epochh: LogProcessor takes no argument `by_epochh` (did you mean by_epoch?)",
        "c.py: env_cfg.cudnn_benchmrk: Runner.setup_env reads no key `cudnn_benchmrk` (did you mean cudnn_benchmark?)",
        "c.py: env_cfg.mp_cfg.mp_start_methd: set_multi_processing takes no argument `mp_start_methd` (did you mean "
        "mp_start_method?)",
        "c.py: env_cfg.dist_cfg.backendd: init_dist reads no key `backendd` (did you mean backend or init_backend?)"]
    fine = ["env_cfg.dist_cfg.timeout=60", "randomness.diff_rank_seed=True", "log_processor.window_size=5",
            "optim_wrapper.clip_grad.norm_type=1.0"]
    assert validate_config(load_config(NAME, fine), "c.py") == []


@pytest.mark.parametrize("clip_grad, errors", [
    ({"type": "value", "max_norm": 1}, [
        "c.py: optim_wrapper.clip_grad.max_norm: clip_grad_value_ takes no argument `max_norm`",
        "c.py: optim_wrapper.clip_grad: clip_grad_value_ needs `clip_value` (e.g. optim_wrapper.clip_grad="
        "dict(clip_value=1.0))"]),
    ({"norm_type": 2}, ["c.py: optim_wrapper.clip_grad: clip_grad_norm_ needs `max_norm` (e.g. "
                        "optim_wrapper.clip_grad=dict(max_norm=1.0))"]),
    ({"type": "nrom", "max_norm": 1}, ["c.py: optim_wrapper.clip_grad.type: 'nrom' is not a kind of clipping "
                                       "mmengine knows; use 'norm' (clip_grad_norm_, the default) or 'value' "
                                       "(clip_grad_value_)"]),
    ({"type": "value", "clip_value": 0.5}, []),
])
def test_clip_grad_is_checked_against_the_clipping_it_selects(clip_grad, errors):
    cfg = {"optim_wrapper": {"optimizer": {"type": "AdamW", "lr": 1e-4}, "clip_grad": clip_grad}}
    assert check_arguments(cfg, "c.py") == errors


def test_untyped_loops_and_the_keys_mmengine_reads_are_checked():
    cfg = {"optim_wrapper": {"optimizer": {"type": "AdamW", "lr": 1e-4}, "paramwise_cfg": {"bias_decay_mul": 0}},
           "val_cfg": {"fp17": True}, "test_cfg": {"fp16": False}}
    assert check_arguments(cfg, "c.py") == [
        "c.py: optim_wrapper.paramwise_cfg.bias_decay_mul: DefaultOptimWrapperConstructor reads no key "
        "`bias_decay_mul` (did you mean bias_decay_mult or flat_decay_mult?)",
        "c.py: val_cfg.fp17: ValLoop takes no argument `fp17` (did you mean fp16?)"]
    cfg["optim_wrapper"]["constructor"] = "MyConstructor"  # its keys are its own to read
    assert check_arguments(cfg, "c.py") == ["c.py: val_cfg.fp17: ValLoop takes no argument `fp17` (did you mean fp16?)"]


def test_train_stops_at_a_clip_grad_typo_before_the_data_is_loaded(recorded_loads, tmp_path):
    work_dir = tmp_path / "work"
    result = CliRunner().invoke(cli, ["train", NAME, "--work-dir", str(work_dir), "--cfg-options",
                                      "train_dataloader.dataset.dataset.type=recording_loader",
                                      "optim_wrapper.clip_grad.max_nrom=1"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.output.endswith("optim_wrapper.clip_grad.max_nrom: clip_grad_norm_ takes no argument `max_nrom` "
                                  "(did you mean max_norm?)\n")
    assert recorded_loads == [] and not work_dir.exists()
