"""The run's rules in one place (``engine.checks``): every problem at once, before anything is built;
the launcher checks once and the processes it starts do not report again."""
from __future__ import annotations

import json

import pytest
from mmengine.config import Config

from engine_helpers import write_config
from sfttool.config import ConfigError, load_config
from sfttool.dataset import build_preference_dataset, process_hf_dataset
from sfttool.engine import checks
from sfttool.engine.safety import check_work_dir_writable
from sfttool.engine.spec import TrainOptions


def _preference_config(dataset_type, **extra) -> dict:
    return {**dict(model=dict(type="DPO"), optim_wrapper=dict(optimizer=dict(lr=1e-4)), train_cfg=dict(max_epochs=1),
                   train_dataloader=dict(batch_size=1, dataset=dict(type=dataset_type))), **extra}


VAL = dict(val_ratio=0.1, val_dataloader=dict(batch_size=1))


@pytest.mark.parametrize("extra,line", [
    (dict(val_ratio=0.1), "val_ratio: the config has no val_dataloader to validate with; add the validation lines "
                          "of a built-in DPO config (val_dataloader, val_cfg, val_evaluator: see docs/preference.md) "
                          "or remove val_ratio"),
    (dict(VAL, model=dict(type="DPO", loss_type="kto_pair")),
     "model.loss_type='kto_pair' has no held-out loss (its KL baseline is the mean over a micro-batch, so a pair's "
     "loss depends on its batch): set val_ratio = 0 and val_data_path = None, or choose another loss_type"),
    (dict(VAL, model=dict(type="sfttool.model.KTO")),
     "KTO has no held-out loss (its KL baseline is the mean over a micro-batch): set val_ratio = 0 and "
     "val_data_path = None (or val_dataloader = None)"),
    (dict(VAL, val_evaluator=dict(type="sfttool.engine.validation.ValLossMetric")),
     "val_evaluator: ValLossMetric measures the SFT token loss; a preference run validates with "
     "val_evaluator = dict(type=PairValMetric) (from sfttool.engine.validation)"),
])
def test_preference_validation_problems_are_one_line_each(extra, line):
    for dataset_type in (build_preference_dataset, "sfttool.dataset.build_preference_dataset"):
        assert checks.preference_validation_problems(_preference_config(dataset_type, **extra), "dpo.py") == [
            f"dpo.py: {line}"]


def test_the_built_in_preference_configs_validate_and_pass_the_checks(tmp_path):
    for name, evaluator in (("qwen2_5_7b_instruct_lora_dpo_ultrafeedback_e1", "PairValMetric"),
                            ("qwen2_5_7b_instruct_lora_reward_ultrafeedback_e1", "PairValMetric")):
        cfg = load_config(name, ["val_ratio=0.1"])
        assert cfg.val_evaluator["type"].__name__ == evaluator
        assert checks.run_checks(cfg, TrainOptions(work_dir=str(tmp_path / name), dry_run=True), 1).errors == []


def test_unset_validation_and_sft_configs_pass():
    assert checks.preference_validation_problems(
        _preference_config(build_preference_dataset, val_ratio=None, val_data_path=None), "dpo.py") == []
    assert checks.preference_validation_problems(_preference_config(build_preference_dataset, **VAL), "dpo.py") == []
    assert checks.preference_validation_problems(_preference_config(process_hf_dataset, val_ratio=0.1), "sft.py") == []


@pytest.fixture
def tiny(tmp_path, tiny_qwen2_dir, tiny_sft_jsonl):
    return write_config(tmp_path / "tiny.py", tiny_qwen2_dir, tiny_sft_jsonl, max_epochs=0.2, save_steps=4)


def test_every_problem_of_the_run_is_reported_at_once_and_nothing_is_made(tmp_path, tiny):
    """A config mistake, a sequence-parallel one, a DeepSpeed preset and --resume: one error naming
    each, before anything is built, and no work dir."""
    preset = tmp_path / "ds.json"
    preset.write_text(json.dumps({"train_batch_size": 3, "train_micro_batch_size_per_gpu": "auto",
                                  "gradient_accumulation_steps": "auto", "zero_optimization": {"stage": 2}}))
    cfg = load_config(str(tiny), ["train_dataloader.batch_size=0", "sequence_parallel_size=2"])
    work = tmp_path / "work"
    found = checks.run_checks(cfg, TrainOptions(work_dir=str(work), deepspeed=str(preset), resume="auto"), 1)
    messages = [str(e) for e in found.errors]
    assert messages[0] == f"{tiny}: train_dataloader.batch_size: must be a positive integer, got 0"
    assert messages[1].startswith("sequence_parallel_size=2 must divide the number of processes (1)")
    assert messages[2].startswith(f"the DeepSpeed config {preset} does not fit the training config:\n  ")
    assert messages[3] == f"--resume: no checkpoint (iter_*.pth) in {work}; train without --resume or pass a " \
                          "checkpoint path"
    assert len(messages) == 4 and not work.exists()
    with pytest.raises(ConfigError) as error:
        checks.report(found)
    lines = str(error.value).splitlines()
    assert lines[0] == "the run has problems:" and lines[1] == f"  {messages[0]}"
    assert lines[4] == f"    {messages[2].splitlines()[1].strip()}"  # the preset's own lines, indented under it


def test_one_problem_is_raised_as_it_is(tmp_path, tiny):
    found = checks.run_checks(load_config(str(tiny), ["sequence_parallel_size=0"]),
                              TrainOptions(work_dir=str(tmp_path / "w")), 1)
    with pytest.raises(checks.SequenceParallelError, match=r"^sequence_parallel_size must be a positive integer "
                                                           r"\(1: off\), got 0$"):
        checks.report(found)
    assert not (tmp_path / "w").exists()


def test_a_passing_run_makes_its_work_dir_and_a_dry_run_does_not(tmp_path, tiny):
    cfg = load_config(str(tiny))
    for dry_run in (True, False):
        work = tmp_path / f"dry{dry_run}" / "work"
        found = checks.run_checks(cfg, TrainOptions(work_dir=str(work), dry_run=dry_run), 1)
        assert found.errors == [] and found.warnings == []
        assert work.is_dir() != dry_run and (tmp_path / f"dry{dry_run}").exists() != dry_run


def test_the_dry_run_probe_keeps_folders_that_were_there(tmp_path):
    (tmp_path / "mine").mkdir()
    check_work_dir_writable(tmp_path / "mine" / "a" / "b", keep=False)
    assert list(tmp_path.rglob("*")) == [tmp_path / "mine"]
    check_work_dir_writable(tmp_path / "mine", keep=False)
    assert (tmp_path / "mine").is_dir()


def test_checkpoints_inside_an_accumulation_window_are_warned_about():
    name = "qwen2_5_0_5b_instruct_lora_alpaca_e3"
    assert checks.checkpoint_interval_warning(load_config(name)) is None  # the built-ins save on step boundaries
    message = checks.checkpoint_interval_warning(load_config(name, ["default_hooks.checkpoint.interval=500"]))
    assert message.startswith("default_hooks.checkpoint.interval=500 is not a multiple of "
                              "optim_wrapper.accumulative_counts=16") and message.endswith("(e.g. 496)")


def test_processes_the_launcher_checked_do_not_report_again(tmp_path, tiny, monkeypatch):
    """The launcher ran the checks (and showed their warnings) once; each process it started only loads."""
    from sfttool.engine.train import prepare

    said = []
    monkeypatch.setattr(checks, "warn", said.append)  # where report() shows warnings
    options = TrainOptions(work_dir=str(tmp_path / "w"), cfg_options=("default_hooks.checkpoint.interval=3",))
    monkeypatch.setenv(checks.CHECKED_BY_LAUNCHER, "1")
    cfg, spec = prepare(str(tiny), options)
    assert said == [] and not (tmp_path / "w").exists()
    assert spec.work_dir == tmp_path / "w" and cfg.default_hooks.checkpoint.interval == 3
    monkeypatch.delenv(checks.CHECKED_BY_LAUNCHER)
    prepare(str(tiny), options)
    assert len(said) == 1 and said[0].startswith("default_hooks.checkpoint.interval=3 is not a multiple of")
    assert (tmp_path / "w").is_dir()


def test_the_model_type_is_checked_before_the_model_is_built():
    cfg = Config(dict(sequence_parallel_size=2, model=dict(type="sfttool.model.GRPO"),
                      train_dataloader=dict(sampler=dict(type="DefaultSampler"))))
    assert [str(p) for p in checks.sequence_parallel_problems(cfg, 2)] == [
        "model.type=GRPO does not train with sequence parallelism (SupervisedFinetune and the preference models do): "
        "set sequence_parallel_size = 1"]


def test_the_dataset_builders_settings_are_checked_before_anything_is_built():
    """process_hf_dataset's and a stream's own setting checks, with the key, before the process group."""
    from sfttool.dataset.streaming import StreamingPackedDataset

    cfg = Config(dict(train_dataloader=dict(dataset=dict(
        type=process_hf_dataset, dataset=dict(type="datasets.load_dataset", path="json"),
        tokenizer=dict(type="transformers.AutoTokenizer.from_pretrained"), max_length=64,
        use_varlen_attn=True, pack_to_max_length=False))))
    assert [str(p) for p in checks.dataset_setting_problems(cfg)] == [
        "train_dataloader.dataset: use_varlen_attn=True needs pack_to_max_length=True (as in XTuner)"]
    cfg.train_dataloader.dataset = dict(type=StreamingPackedDataset, dataset=dict(type="datasets.load_dataset"),
                                        tokenizer=None, max_length=64, pack_strategy="concat")
    assert [str(p) for p in checks.dataset_setting_problems(cfg)] == [
        "train_dataloader.dataset: pack_strategy='concat' (XTuner's cut, which splits samples across rows) is not "
        "available when streaming: rows are packed best-fit-decreasing within a buffer and no sample is split; "
        "remove pack_strategy, or use process_hf_dataset"]
    cfg.train_dataloader.dataset.update(pack_strategy="bfd", max_length=dict(type="sfttool.assets.longest"))
    assert checks.dataset_setting_problems(cfg) == []  # built lazily: left to the builder


def test_data_sources_settings_are_checked_before_anything_is_built():
    """Every problem of PART 1's data_sources and mix settings, one line each, under the dataset's key."""
    from sfttool.dataset import process_data_sources

    cfg = Config(dict(train_dataloader=dict(dataset=dict(
        type=process_data_sources, tokenizer=None, max_length=64, mix_strategy="interleave",
        mix_probabilities=[0.9, 0.2],
        data_sources=[dict(data_path="missing.jsonl"), dict(name="b", data_path="tatsu-lab/alpaca", filtr=None)]))))
    assert [str(p) for p in checks.dataset_setting_problems(cfg)] == [
        "train_dataloader.dataset: data_sources[0].data_path 'missing.jsonl': no such file or folder; set "
        "data_sources[0].data_path to your data file, a folder or a glob, or a dataset name on the hub\n"
        "data_sources[1]: unknown key 'filtr'; did you mean 'filter_fn'? a source takes data_path, name, subset, "
        "split, map_fn, filter_fn, slice, ratio\n"
        "mix_probabilities [0.9, 0.2] sum to 1.1; they must sum to 1"]


def test_the_template_check_covers_data_sources(tiny_tokenizer_dir):
    """train's template check (preflight.template_problems) reads a process_data_sources node as it reads
    process_hf_dataset's: llama3_chat on a ChatML tokenizer is found before any data is processed."""
    from transformers import AutoTokenizer

    from sfttool.dataset import process_data_sources
    from sfttool.dataset.map_fns import template_map_fn_factory
    from sfttool.engine.preflight import template_problems

    def node(template):
        return Config(dict(train_dataloader=dict(dataset=dict(
            type=process_data_sources, data_sources=[dict(data_path="tatsu-lab/alpaca")], max_length=64,
            tokenizer=dict(type=AutoTokenizer.from_pretrained, pretrained_model_name_or_path=str(tiny_tokenizer_dir)),
            template_map_fn=dict(type=template_map_fn_factory, template=template)))))

    assert template_problems(node("llama3_chat"))[0].startswith(
        "the configured template renders differently from the tokenizer's chat_template")
    assert template_problems(node("qwen_chat")) == []


def test_streamed_data_sources_settings_are_checked_before_anything_is_built():
    from sfttool.dataset.streaming_sources import StreamingDataSources

    cfg = Config(dict(train_dataloader=dict(dataset=dict(
        type=StreamingDataSources, tokenizer=None, max_length=64, buffer_size=0,
        data_sources=[dict(data_path="tatsu-lab/alpaca", slice=range(10))]))))
    problems = [str(p) for p in checks.dataset_setting_problems(cfg)]
    assert len(problems) == 1 and problems[0].startswith("train_dataloader.dataset: buffer_size must be")
    cfg.train_dataloader.dataset.buffer_size = 100
    assert [str(p) for p in checks.dataset_setting_problems(cfg)] == [
        "train_dataloader.dataset: data_sources[0].slice is not available when streaming: row indices need the "
        "source's length, which a stream does not know; remove it, or use process_data_sources"]


def test_a_sampler_on_a_stream_is_one_line():
    from sfttool.dataset.streaming import StreamingPackedDataset
    from sfttool.dataset.streaming_sources import StreamingDataSources

    for stream in (StreamingPackedDataset, StreamingDataSources):
        cfg = Config(dict(train_dataloader=dict(dataset=dict(type=stream), sampler=dict(type="DefaultSampler"))))
        assert checks.stream_sampler_problems(cfg) == [
            f"train_dataloader.sampler: {stream.__name__} is a stream, read in its own seeded order (set_epoch "
            "varies it per epoch); set sampler=None"]
        cfg.train_dataloader.sampler = None
        assert checks.stream_sampler_problems(cfg) == []
    cfg = Config(dict(train_dataloader=dict(dataset=dict(type=process_hf_dataset), sampler=dict(type="DefaultSampler"))))
    assert checks.stream_sampler_problems(cfg) == []
    cfg.train_dataloader.dataset.lazy_encode = True  # built, an iterable dataset too
    assert checks.lazy_validation_problems(cfg) == []
    cfg.val_dataloader = dict(dataset=dict(cfg.train_dataloader.dataset))  # the train node copied
    assert checks.lazy_validation_problems(cfg) == [
        "val_dataloader.dataset: lazy_encode=True is for training data; the validation rows are encoded once, "
        "before training: set lazy_encode=False there, e.g. dataset=dict(train_dataset, lazy_encode=False, "
        "buffer_size=None, ...)"]
    assert checks.stream_sampler_problems(cfg) == [
        "train_dataloader.sampler: process_hf_dataset with lazy_encode=True reads its rows in its own seeded order "
        "(seed and epoch), as a stream does; set sampler=None"]
