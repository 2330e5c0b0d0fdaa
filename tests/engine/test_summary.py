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
