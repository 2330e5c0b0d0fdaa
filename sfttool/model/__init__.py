"""The model stage: build the HF LLM (+ quantization, + LoRA) and wrap it for training.

    from sfttool.model import SupervisedFinetune
"""
from sfttool.model.build import build_llm, to_torch_dtype
from sfttool.model.lora import find_linear_names
from sfttool.model.sft import SupervisedFinetune
from sfttool.model.dpo import DPO
from sfttool.model.kto import KTO
from sfttool.model.orpo import ORPO
from sfttool.model.reward import RewardModel
from sfttool.model.grpo import GRPO

__all__ = ["DPO", "GRPO", "KTO", "ORPO", "RewardModel", "SupervisedFinetune", "build_llm", "find_linear_names",
           "to_torch_dtype"]
