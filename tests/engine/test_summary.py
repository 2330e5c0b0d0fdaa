"""The run summary names the model as the user knows it: the config's name or folder, or, where the
config builds the folder (the demo's ``dict(type=export_smollm2)``), the folder it was loaded from."""
from __future__ import annotations

from mmengine.config import Config

from sfttool.engine.summary import model_source
from sfttool.model.sft import SupervisedFinetune


def _model(path):
    from transformers import AutoModelForCausalLM
    return SupervisedFinetune(llm=dict(type=AutoModelForCausalLM.from_pretrained,
                                       pretrained_model_name_or_path=str(path)),
                              lora=dict(type="peft.LoraConfig", r=4, lora_alpha=8, task_type="CAUSAL_LM"),
                              use_activation_checkpointing=False)


def export_folder():
    """Stands for a config function that returns the model's folder."""


def test_the_summary_names_the_folder_a_built_path_loaded_from(tiny_qwen2_dir):
    model = _model(tiny_qwen2_dir)
    built = Config(dict(model=dict(llm=dict(pretrained_model_name_or_path=dict(type=export_folder)))))
    assert model_source(built, model) == str(tiny_qwen2_dir)
    named = Config(dict(model=dict(llm=dict(pretrained_model_name_or_path="Qwen/Qwen2.5-7B-Instruct"))))
    assert model_source(named, model) == "Qwen/Qwen2.5-7B-Instruct"


def test_tokens_per_step_count_each_sequence_parallel_row_once(tmp_path, tiny_qwen2_dir):
    """Under sequence parallelism the processes of a group share one row: 4 processes with
    sequence_parallel_size=2 take 2 rows per micro-batch, not 4."""
    from datasets import Dataset

    from sfttool.engine.spec import TrainOptions, build_spec
    from sfttool.engine.summary import summary_text
    model = _model(tiny_qwen2_dir)
    rows = Dataset.from_dict({"input_ids": [[1] * 100, [2] * 300]})  # 200 tokens a row on average
    cfg = Config(dict(model=dict(llm=dict(pretrained_model_name_or_path="m")), accumulative_counts=3,
                      train_dataloader=dict(batch_size=1), train_cfg=dict(max_iters=6),
                      optim_wrapper=dict(accumulative_counts=3)))
    options = TrainOptions(work_dir=str(tmp_path))
    plain = summary_text(cfg, model, rows, build_spec(cfg, options, world_size=4))
    assert "about 2,400 tokens per optimizer step (batch 1 x 3 accumulation x 4 processes)" in plain
    cfg.sequence_parallel_size = 2
    split = summary_text(cfg, model, rows, build_spec(cfg, options, world_size=4))
    assert ("about 1,200 tokens per optimizer step (batch 1 x 3 accumulation x 2 data-parallel groups of 2 "
            "sequence-parallel processes)") in split


def test_the_summary_says_which_rows_the_sampler_repeats_to_even_out_the_processes(tmp_path, tiny_qwen2_dir):
    """5 rows over 2 data-parallel processes: mmengine's sampler (round_up=True) reads one of them twice each
    epoch, which the summary says; none over 1 process, with round_up=False, or when the rows divide."""
    from datasets import Dataset
    from mmengine.dataset import DefaultSampler

    from sfttool.engine.spec import TrainOptions, build_spec
    from sfttool.engine.summary import repeated_rows, summary_text
    model = _model(tiny_qwen2_dir)
    rows = Dataset.from_dict({"input_ids": [[1] * 10] * 5})
    cfg = Config(dict(model=dict(llm=dict(pretrained_model_name_or_path="m")),
                      train_dataloader=dict(batch_size=1, sampler=dict(type=DefaultSampler, shuffle=True)),
                      train_cfg=dict(max_iters=4), optim_wrapper=dict(accumulative_counts=1)))
    options = TrainOptions(work_dir=str(tmp_path))
    said = "; the sampler repeats 1 row each epoch so that the 2 data-parallel processes read as many (round_up=True)"
    assert said in summary_text(cfg, model, rows, build_spec(cfg, options, world_size=2))
    assert "the sampler repeats" not in summary_text(cfg, model, rows, build_spec(cfg, options, world_size=1))
    assert [repeated_rows(cfg, n, replicas) for n, replicas in ((5, 2), (5, 4), (8, 4), (5, 1), (0, 2))] == [1, 3, 0, 0, 0]
    cfg.train_dataloader.sampler.round_up = False
    assert repeated_rows(cfg, 5, 2) == 0
    cfg.train_dataloader.sampler = dict(type="InfiniteSampler")  # not one whose sharing the summary knows
    assert repeated_rows(cfg, 5, 2) == 0


def test_the_run_length_counts_iterations_steps_and_epochs_as_the_run_takes_them():
    from sfttool.engine.summary import for_people, run_length

    assert run_length(57, 57, 1, 19) == "57 iterations = 57 optimizer steps = 3 epochs"
    assert run_length(57, 57, 16, 57) == "57 iterations = 4 optimizer steps = 1 epoch"  # the last one short
    # --max-steps 1 with accumulation 16 on 168 iterations per epoch: the summary used to say 0.0952381 epochs
    assert run_length(16, 504, 16, 168) == "16 iterations = 1 optimizer step = 0.1 epochs"
    # --dry-run: one micro-batch of a 16-iteration step takes no step (it used to say "= 1 optimizer steps")
    assert run_length(1, 504, 16, 168) == "1 iteration = 0 optimizer steps (16 iterations make one) = 0.006 epochs"
    assert [for_people(v) for v in (1.0, 2.96, 0.25, 0.04, 0.0952381)] == ["1", "3", "0.2", "0.04", "0.1"]


def test_the_summary_says_how_many_cpu_threads_torch_runs(tmp_path, tiny_qwen2_dir):
    import torch
    from datasets import Dataset

    from sfttool.engine.spec import TrainOptions, build_spec
    from sfttool.engine.summary import summary_text

    model = _model(tiny_qwen2_dir)
    rows = Dataset.from_dict({"input_ids": [[1] * 10] * 4})
    cfg = Config(dict(model=dict(llm=dict(pretrained_model_name_or_path="m")), train_dataloader=dict(batch_size=1),
                      train_cfg=dict(max_epochs=1), optim_wrapper=dict()))
    before = torch.get_num_threads()
    try:
        for threads, shown in ((1, "on CPU (1 thread): "), (2, "on CPU (2 threads): ")):
            torch.set_num_threads(threads)
            assert shown in summary_text(cfg, model, rows, build_spec(cfg, TrainOptions(work_dir=str(tmp_path)), world_size=1))
    finally:
        torch.set_num_threads(before)
