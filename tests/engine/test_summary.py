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
